"""The monitor's terminal view (rich): one renderable per snapshot, and the live loop."""

from __future__ import annotations

import argparse
import asyncio

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from pipeline.ops.monitor import MonitorSnapshot, Target
from pipeline.store.redis_conn import connect, redact

MAX_WORKER_ROWS = 12
BAR_WIDTH = 30


def _overview(snap: MonitorSnapshot) -> Table:
    t = Table(title=f"pipeline '{snap.namespace}'  ·  policy version {snap.policy_version}", title_justify="left")
    for column in ("", "figure", "", "figure"):
        t.add_column(column, justify="right" if column else "left")
    q, tp = snap.queue, snap.throughput
    headroom = "no trainer yet" if snap.admission_headroom is None else str(snap.admission_headroom)
    eta = "-" if snap.trainer is None else f"{snap.trainer.eta} (B={snap.trainer.rollout_batch_size})"
    rows = [
        ("queue ready", q.ready, "groups pushed/min", f"{tp.groups_per_min:.1f}"),
        ("queue deferred", q.deferred, "episodes/min", f"{tp.episodes_per_min:.1f}"),
        ("jobs running", f"{q.running} (counter {snap.running_counter})", "tokens/s", f"{tp.tokens_per_s:,.0f}"),
        ("buffer ready", snap.buffer_ready, "rates over", f"groups pushed in the last {tp.span_s:.0f}s"),
        ("buffer pending", snap.buffer_pending, "admission headroom", headroom),
        ("dead letters", snap.dead_letters, "eta", eta),
        ("requeue waiting", snap.requeue_waiting, "workers live", f"{snap.workers_live}/{len(snap.workers)}"),
        ("stale rejected", f"{snap.stale_rejected} ({snap.stale_share:.0%} of groups read)", "", ""),
    ]
    if snap.eval_rounds.get("started"):  # background evaluation (pipeline/eval/background.py)
        e = snap.eval_rounds
        rows.append(("eval rounds running", f"{e['running']} (+{e['queued']} queued)", "eval rounds skipped",
                     f"{e['skipped']} ({e['reported']} reported, {e['failed']} failed)"))
    for row in rows:
        t.add_row(*(str(cell) for cell in row))
    return t


def _staleness(snap: MonitorSnapshot) -> Table:
    """Two histograms: the groups waiting for the trainer (what its next read would see) and the
    groups trained in the last steps, each at the lag it had at the step that trained it."""
    t = Table(title="staleness (version - admission version)", title_justify="left", min_width=64,
              caption=f"waiting: the {sum(snap.waiting_staleness_hist.values())} groups the trainer has not read yet\n"
                      f"trained: the {sum(snap.staleness_hist.values())} groups of the last {snap.trained_steps} "
                      "step(s), at the step that trained them", caption_justify="left")
    t.add_column("lag", justify="right")
    t.add_column("waiting", justify="right")
    t.add_column(f"trained (last {snap.trained_steps} steps)", justify="right")
    t.add_column("")
    biggest = max(snap.staleness_hist.values(), default=0)
    eta = snap.trainer.eta if snap.trainer else None
    for lag in sorted(set(snap.staleness_hist) | set(snap.waiting_staleness_hist)):
        groups = snap.staleness_hist.get(lag, 0)
        bar = "█" * max(1, round(BAR_WIDTH * groups / biggest)) if biggest and groups else ""
        style = "red" if eta is not None and lag > eta else "green"
        t.add_row(str(lag), str(snap.waiting_staleness_hist.get(lag, 0)), str(groups), f"[{style}]{bar}[/{style}]")
    return t



def _envs(snap: MonitorSnapshot) -> Table:
    t = Table(title="environments (recent groups)", title_justify="left")
    for column in ("env", "groups", "episodes", "reward mean", "failure rate"):
        t.add_column(column, justify="left" if column == "env" else "right")
    for env, s in snap.envs.items():
        t.add_row(env, str(s.groups), str(s.episodes), f"{s.reward_mean:.3f}", f"{s.failure_rate:.1%}")
    return t


def _eval(snap: MonitorSnapshot) -> Table:
    """Each eval dataset's last round reported: its score over every task with a result, the
    version(s) that is reported under, its tasks and those without a result."""
    t = Table(title="evaluation (last round reported, per dataset)", title_justify="left")
    for column in ("dataset", "rollout", "version", "pass@1", "reward mean", "tasks", "failed", "mixed"):
        t.add_column(column, justify="left" if column == "dataset" else "right")
    for dataset, r in snap.eval_results.items():
        versions = "-" if not r.versions else (
            str(r.versions[0]) if len(r.versions) == 1 else f"{r.versions[0]}..{r.versions[-1]}")
        t.add_row(dataset, str(r.rollout_id), versions, "-" if r.pass_at_1 is None else f"{r.pass_at_1:.3f}",
                  "-" if r.reward_mean is None else f"{r.reward_mean:.3f}", str(r.tasks),
                  f"[red]{r.failed}[/red]" if r.failed else "0", str(r.mixed))
    return t


def _workers(snap: MonitorSnapshot) -> Table:
    t = Table(title="workers", title_justify="left")
    for column in ("id", "state", "last heartbeat", "load"):
        t.add_column(column, justify="left" if column in ("id", "state") else "right")
    for w in snap.workers[:MAX_WORKER_ROWS]:
        state = "[green]live[/green]" if w.live else "[red]silent[/red]"
        t.add_row(w.id, state, f"{w.age_s:.1f}s ago", str(w.load))
    if len(snap.workers) > MAX_WORKER_ROWS:
        t.caption = f"... and {len(snap.workers) - MAX_WORKER_ROWS} more"
    return t


def render(snap: MonitorSnapshot) -> Group:
    parts = [_overview(snap), _staleness(snap), _envs(snap)]
    if snap.eval_results:
        parts.append(_eval(snap))
    return Group(*parts, _workers(snap))


def print_once(snap: MonitorSnapshot, console: Console | None = None) -> None:
    (console or Console()).print(render(snap))


async def run_live(target: Target, args: argparse.Namespace) -> int:
    """Refresh every `args.interval` s. Rates are the snapshot's own (groups pushed within the
    window, as `--json` and Prometheus report them): one definition of throughput everywhere."""
    logger = None
    if args.wandb:
        from pipeline.ops.metrics import WandbLogger

        logger = WandbLogger(project=args.wandb_project, namespace=target.keys.ns, mode=args.wandb_mode)
    redis = connect(target.redis_url, retries=2)
    header = f"[dim]{redact(target.redis_url)} · every {args.interval:g}s · Ctrl-C quits[/dim]"
    try:
        with Live(Panel(header), refresh_per_second=4, screen=False) as live:
            while True:
                snap = await target.snapshot(redis)
                live.update(Group(render(snap), header))
                if logger is not None:
                    logger.log(snap)
                await asyncio.sleep(args.interval)
    finally:
        await redis.aclose()
        if logger is not None:
            logger.close()
