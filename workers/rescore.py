"""Re-scoring the ledger: verify the stored episodes of trained steps again with a config's
environments (a changed reward, clamp, nonterminal reward, checker option...). Nothing is
generated.

    rollout ledger rescore --dir D --config new.yaml [--from A --to B] [--env E] [-o rows.jsonl]

It runs the environments, so it lives with them; the ledger itself (`pipeline/ops/ledger.py`) is
storage every side reads, and `rollout ledger` is its list/summary/export plus this action
(`ledger_main`). `stored_record` is also what slime in-process mode's reward verifies
(`workers/inslime.py`).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.ops.ledger import Ledger, LedgerAction, LedgerError, LedgerGroup, open_ledger
from pipeline.ops.ledger import main as ledger_cli
from pipeline.schema import Sample, Status, Task
from workers.envs.base import Environment, EpisodeRecord
from workers.envs.registry import build_environment
from workers.envs.rewards import final_reward
from workers.episode import PLAIN_CONVERSATION


def stored_record(task: Task, metadata: Mapping[str, Any], response: str, status: Status) -> tuple[EpisodeRecord, bool]:
    """The `EpisodeRecord` verify saw, rebuilt from a stored sample, and whether it is exact.

    Exact when the worker recorded the conversation (`metadata.messages`: the messages, or
    PLAIN_CONVERSATION for a plain single-turn episode); otherwise (groups from older workers,
    built elsewhere, or slime's own generate) the task's messages and the response as the one
    assistant turn, which is exact for a plain single-turn episode only."""
    messages = metadata.get("messages")
    exact = isinstance(messages, list) or messages == PLAIN_CONVERSATION
    if not isinstance(messages, list):
        prompt = task.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        messages.append({"role": "assistant", "content": response.strip()})
    record = EpisodeRecord(
        task=task,
        messages=messages,
        response_text=str(metadata.get("response_text", response)),
        step_rewards=[float(x) for x in metadata.get("step_rewards", [])],
        finished=bool(metadata.get("finished", False)),
        status=status,
        turns=int(metadata.get("turns", 1) or 1),
    )
    return record, exact


def episode_record(task: Task, sample: Sample) -> tuple[EpisodeRecord, bool]:
    """`stored_record` of a ledger sample."""
    return stored_record(task, sample.metadata, sample.response, sample.status)


async def rescore(
    ledger: Ledger, config: PipelineConfig, *, start: int | None = None, end: int | None = None,
    envs: Iterable[str] | None = None, concurrency: int = 16,
) -> list[dict[str, Any]]:
    """Verify the stored episodes of steps [start, end] again with `config`'s environments.

    One row per sample: old and new reward and components. Failed episodes were never
    verified (an outage) and are not re-verified (`skipped`)."""
    wanted = set(envs) if envs else None
    built: dict[str, Environment] = {}
    sem = asyncio.Semaphore(max(1, concurrency))
    jobs = []

    async def one(lg: LedgerGroup, j: int, sample: Sample, env: Environment) -> dict[str, Any]:
        group = lg.group
        row: dict[str, Any] = {
            "rollout_id": lg.rollout_id, "group_id": group.group_id, "task_id": group.task_id, "env": group.env,
            "sample_index": j, "status": sample.status.value, "old_reward": sample.reward, "new_reward": None,
            "old_components": sample.reward_components, "new_components": None, "exact_record": None, "error": None,
        }
        if sample.status is Status.FAILED:
            row["error"] = "skipped: a failed episode was never verified"
            return row
        record, exact = episode_record(group.task, sample)
        row["exact_record"] = exact
        async with sem:
            try:
                session = await env.start(group.task)
                try:
                    verification = await session.verify(record)
                finally:
                    await session.close()
            except Exception as exc:  # noqa: BLE001 - one sample's failure is reported, the rest go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                return row
        row["new_reward"] = final_reward(env.config, verification, finished=record.finished)
        row["new_components"] = verification.components
        return row

    try:
        for lg in ledger.iter_groups(start, end):
            name = lg.group.env
            if wanted is not None and name not in wanted:
                continue
            if name not in built:
                built[name] = build_environment(name, config.env(name))
            for j, sample in enumerate(lg.group.samples):
                jobs.append(one(lg, j, sample, built[name]))
        return list(await asyncio.gather(*jobs))
    finally:
        for env in built.values():
            await env.aclose()


def rescore_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        s = out.setdefault(r["env"], {"samples": 0, "rescored": 0, "changed": 0, "errors": 0, "skipped": 0,
                                      "old_sum": 0.0, "new_sum": 0.0})
        s["samples"] += 1
        if r["new_reward"] is None:
            s["skipped" if str(r["error"] or "").startswith("skipped") else "errors"] += 1
            continue
        s["rescored"] += 1
        s["old_sum"] += r["old_reward"]
        s["new_sum"] += r["new_reward"]
        s["changed"] += r["new_reward"] != r["old_reward"]
    for s in out.values():
        n = s.pop("rescored")
        s["old_mean"] = s.pop("old_sum") / n if n else None
        s["new_mean"] = s.pop("new_sum") / n if n else None
        s["rescored"] = n
    return out


# ------------------------------------------------------------------------ CLI

def _arguments(rs: argparse.ArgumentParser) -> None:
    rs.add_argument("--config", required=True, help="pipeline YAML with the environments to score with")
    rs.add_argument("--env", action="append", default=None, help="only this environment (repeatable)")
    rs.add_argument("--output", "-o", default=None, help="write one JSON line per sample here")
    rs.add_argument("--concurrency", type=int, default=16)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    ledger = open_ledger(args)
    try:
        config = load_config(args.config)
        rows = asyncio.run(rescore(ledger, config, start=args.start, end=args.end, envs=args.env,
                                   concurrency=args.concurrency))
    except ConfigError as exc:
        raise LedgerError(str(exc)) from None
    if args.output:
        with open(args.output, "wb") as f:
            for row in rows:
                f.write(msgspec.json.encode(row) + b"\n")
    summary = rescore_summary(rows)
    if args.json:
        print(msgspec.json.encode(summary).decode())
        return 0
    table = Table("env", "samples", "rescored", "changed", "old mean", "new mean", "skipped", "errors",
                  title=f"rescore of {ledger.dir} with {args.config}")
    for env, s in sorted(summary.items()):
        fmt = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
        table.add_row(env, str(s["samples"]), str(s["rescored"]), str(s["changed"]), fmt(s["old_mean"]),
                      fmt(s["new_mean"]), str(s["skipped"]), str(s["errors"]))
    Console().print(table)
    return 0


RESCORE = LedgerAction("rescore", "verify stored episodes again with a changed environment config", _arguments, _run)


def ledger_main(argv: list[str] | None = None) -> int:
    """`rollout ledger`: list, summary, export (pipeline/ops/ledger.py) and rescore."""
    return ledger_cli(argv, extra=[RESCORE])
