"""Async vs sync, measured as a user runs the pipeline (issue 17): real processes end to end.

What runs (all real, nothing in-process but the trainer loop):
- a private redis-server (the one `rollout bench` starts, or LocalRedis when run alone);
- the simulated SGLang engine, `rollout engine` in a subprocess: lognormal response lengths
  (length_sigma 1.0, the long tail), a per-token latency (mean episode ~0.1-0.3 s), 64 slots,
  the bundled tasks' answers; it counts every token it answers (`/sim/stats` output_tokens);
- `rollout workers` (one process) and `rollout enqueue --follow` on the bundled tasks
  (scripts/demo_tasks.jsonl) with the demo's pipeline YAML (scripts/demo.py `pipeline_config`);
- the trainer loop, in this process, as a slime train.py-style loop: each step calls
  `generate_rollout(args, rid, source)` with `RedisDataSource`, sleeps the simulated train time,
  calls `save(rid)` and pushes the next weight version to the engine (pause in `Setup.push_mode`,
  `/update_weight_version`, continue: pipeline.slime.weight_push; labelled as slime's updater labels its
  pushes). `pipeline_trainer_loop: sync` (the engines
  hold version r at generate(r)), so eta = 0 is possible: the sync baseline is this same
  pipeline at eta = 0.

Compared: eta in {0, 1, 2, 4}; for eta >= 1 both consume orders (`arrival` with the default
stale policy `requeue`, and `due-first`), B = 8 groups x n = 4, 12 steps (8 with --quick), the
first 2 steps (process start-up, pipeline fill) outside the measurement window, 3 repeats, the
configurations interleaved within a repeat (speedup = a run's trained groups/s over the same
repeat's sync run).

Per run: trained groups/s; admission occupancy (live / ((eta + v + 1) * B) sampled every 50 ms
from the Redis counters and `{ns}:version` over the window); generated tokens never trained
(engine's own count: everything it answered, minus the tokens of trained samples, minus those
of groups still in flight or waiting in the stream at the end, which are reported and not counted
as waste; discarded, regenerated, failed or masked-out tokens are waste); response length
(model tokens per sample) of trained vs generated samples over the resolved groups (trained or
discarded), mean and p90; lag per trained token (the step that trains it minus the policy version
stamped on the generate call that produced it, per turn: the oldest stamp of the turn's calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from pipeline.keys import Counter, Keys
from pipeline.schema import SampleGroup, Status, decode_group
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.slime.weight_push import push_weights
from scripts.bench.harness import TASKS, PipelineProcs, engine_stats, fleet_of, post_json
from scripts.bench.report import Figure
from scripts.processes import write_config

AREAL_SPEEDUP = 2.77  # AReaL (Fu et al. 2025): async RL vs synchronous, same hardware
OCCUPANCY_GOAL = 0.9
WASTE_GOAL_PCT = 1.0
LENGTH_GOAL_PCT = 2.0
ETAS = (1, 2, 4)
ORDERS = ("arrival", "due-first")
TASKS_FILE = TASKS


@dataclass
class Setup:
    batch: int = 8  # B
    n: int = 4
    steps: int = 12
    warmup: int = 2  # steps outside the measurement window
    train_s: float = 0.4  # the simulated optimizer step
    token_latency_s: float = 0.002  # engine, mean per output token: a mean episode ~0.25 s
    length_sigma: float = 1.0
    slots: int = 64
    worker_processes: int = 1
    concurrency: int = 40  # groups per worker process: (eta + 1) * B at eta = 4
    seed: int = 7
    accuracy: float = 0.6
    drain_s: float = 60.0  # how long the end of a run waits for groups still generating
    due_wait_s: float = 600.0
    # the engine's --enable-priority-scheduling: the workers send each group's clock as `priority`
    priority_scheduling: bool = True
    push_mode: str = "abort"  # SGLang's pause mode of each weight push (pipeline/slime/weight_push.py)


# ------------------------------------------------------------------ one run


class RecordingSource(RedisDataSource):
    """The real data source, recording what each step took and what it discarded (wire groups)."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.trained: list[tuple[int, SampleGroup]] = []
        self.discarded: list[SampleGroup] = []

    async def _take(self, rid: int, *args: Any, **kwargs: Any) -> Any:
        entries, stats = await super()._take(rid, *args, **kwargs)
        self.trained += [(rid, e.group) for e in entries]
        return entries, stats

    async def _discard(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
        self.discarded.append(entry.group)
        return await super()._discard(entry, *args, **kwargs)


def model_tokens(sample: Any) -> int:
    """Tokens the engine generated for this sample (loss mask 1: tool output and templates are 0)."""
    return int(sample.loss_mask_array().sum())


def token_lags(sample: Any, rid: int, fallback: int) -> list[tuple[int, int]]:
    """(lag, tokens) per turn: each turn's tokens carry the oldest stamp of its generate calls
    (a turn resumed after an abort is several calls); without a turn log, the sample's oldest."""
    stamps = list(sample.policy_versions)
    turns = [t for t in (sample.metadata.get("turn_log") or []) if "tokens" in t]
    if stamps and turns and sum(int(t.get("aborts", 0)) + 1 for t in turns) == len(stamps):
        out, i = [], 0
        for turn in turns:
            k = int(turn.get("aborts", 0)) + 1
            out.append((rid - min(stamps[i:i + k]), int(turn["tokens"])))
            i += k
        return out
    return [(rid - (min(stamps) if stamps else fallback), model_tokens(sample))]


def engine_args(setup: Setup) -> list[str]:
    return ["--length-sigma", str(setup.length_sigma), "--token-latency-s", str(setup.token_latency_s),
            "--slots", str(setup.slots), "--seed", str(setup.seed), "--accuracy", str(setup.accuracy),
            "--tasks", str(TASKS_FILE), *(["--enable-priority-scheduling"] if setup.priority_scheduling else [])]


class OccupancySampler(threading.Thread):
    """live / ((eta + v + 1) * B) from the Redis counters and {ns}:version, every 50 ms."""

    def __init__(self, redis_url: str, keys: Keys, eta: int, batch: int):
        super().__init__(daemon=True)
        import redis as redis_sync

        self.client: Any = redis_sync.Redis.from_url(redis_url)  # sync client: redis-py types replies Awaitable | T
        self.keys, self.eta, self.batch = keys, eta, batch
        self.samples: list[float] = []
        self.recording = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            if not self.recording.is_set():
                continue
            enqueued, discarded = self.client.hmget(self.keys.counters, [Counter.ENQUEUED, Counter.DISCARDED])
            version = int(self.client.get(self.keys.version) or 0)
            live = int(enqueued or 0) - int(discarded or 0)
            self.samples.append(live / ((self.eta + version + 1) * self.batch))
        self.client.close()


def run_once(redis_url: str, engine_url: str, setup: Setup, *, eta: int, order: str, workdir: Path,
             steps: int | None = None, keep_source: bool = False) -> Any:
    """One pipeline run: fresh namespace, workers and producer subprocesses, the trainer loop here.
    Returns the run's figures (and, with `keep_source`, the closed data source with its records)."""
    from scripts.demo import Profile, pipeline_config
    from workers.sim.tokenizer import default_tokenizer_path

    steps = steps or setup.steps
    ns = f"ba{uuid.uuid4().hex[:8]}"
    keys = Keys(ns)
    profile = Profile(steps=steps, batch=setup.batch, n=setup.n, eta=eta, worker_processes=setup.worker_processes,
                      concurrency=setup.concurrency, train_step_s=setup.train_s, length_sigma=setup.length_sigma)
    config = pipeline_config(profile, redis_url, ns, engine_url, default_tokenizer_path())
    config_path = write_config(config, workdir / f"{ns}.yaml")
    args = SimpleNamespace(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=setup.batch,
        n_samples_per_prompt=setup.n, pipeline_eta=eta, pipeline_stale_policy="requeue",
        pipeline_consume_order=order, pipeline_due_wait_s=setup.due_wait_s,
        pipeline_wait_timeout_s=300.0, pipeline_wait_log_s=30.0, pipeline_publish_engine=False,
        pipeline_trainer_loop="sync",  # weights pushed after each step, before the next rollout
    )
    source = RecordingSource(args)
    post_json(engine_url, "/update_weight_version", {"new_version": "1"}, timeout=10)  # slime's first push: label "1" = version 0
    tokens_before = int(engine_stats(engine_url)["output_tokens"])
    procs = PipelineProcs(config_path, TASKS_FILE, workdir, processes=setup.worker_processes,
                          concurrency=setup.concurrency, enqueue_args=["--seed", str(setup.seed)],
                          log=str(workdir / f"{ns}.log")).start()
    sampler = OccupancySampler(redis_url, keys, eta, setup.batch)
    sampler.start()
    wait_s = 0.0
    window_start = window_end = 0.0
    try:
        for rid in range(steps):
            if rid == setup.warmup:
                window_start = time.monotonic()
                sampler.recording.set()
            started = time.monotonic()
            out = generate_rollout(args, rid, source)
            if rid >= setup.warmup:
                wait_s += time.monotonic() - started
            assert len(out.samples) == setup.batch, f"rollout {rid}: {len(out.samples)} groups"
            time.sleep(setup.train_s)  # train(rid)
            source.save(rid)
            push_weights([engine_url], str(rid + 2), setup.push_mode)  # version rid + 1
        window_end = time.monotonic()
        sampler.recording.clear()
        procs.producer.stop()
        in_flight = _drain(source, keys, setup.drain_s)
        generated = int(engine_stats(engine_url)["output_tokens"]) - tokens_before
        counters = source._run(source.state.counters())
        left = [decode_group(fields[b"g"]) for _id, fields in source._run(source._redis.xrange(keys.groups))]
    finally:
        sampler.stopped.set()
        procs.stop()
        source.close()
    summary = _summarise(setup, eta=eta, order=order, steps=steps, source=source, generated=generated, left=left,
                         in_flight=in_flight, counters=counters, occupancy=sampler.samples,
                         window_s=window_end - window_start, wait_s=wait_s)
    return (summary, source) if keep_source else summary


def _drain(source: RecordingSource, keys: Keys, limit_s: float) -> int:
    """After the last step, with the producer stopped: wait for the groups still generating
    (admitted, not discarded, not trained, not in the stream). Returns how many never came."""
    deadline = time.monotonic() + limit_s
    while True:
        counters = source._run(source.state.counters())
        buffered = source._run(source._redis.xlen(keys.groups))
        in_flight = (counters.get(Counter.ENQUEUED, 0) - counters.get(Counter.DISCARDED, 0)
                     - counters.get(Counter.ACCEPTED, 0) - buffered)
        if in_flight <= 0 or time.monotonic() > deadline:
            return max(0, in_flight)
        time.sleep(0.1)


def _lengths(samples: list[Any]) -> dict[str, float]:
    a = np.asarray([model_tokens(s) for s in samples] or [0], dtype=np.float64)
    return {"mean": float(a.mean()), "p90": float(np.percentile(a, 90)), "samples": len(samples)}


def _summarise(setup: Setup, *, eta: int, order: str, steps: int, source: RecordingSource, generated: int,
               left: list[SampleGroup], in_flight: int, counters: dict[str, int], occupancy: list[float],
               window_s: float, wait_s: float) -> dict[str, Any]:
    trained_samples = [s for _rid, g in source.trained for s in g.samples if s.status is not Status.FAILED]
    resolved_samples = [s for _rid, g in source.trained for s in g.samples] + [
        s for g in source.discarded for s in g.samples]
    trained_tokens = sum(model_tokens(s) for s in trained_samples)
    left_tokens = sum(model_tokens(s) for g in left for s in g.samples)
    waste = generated - trained_tokens - left_tokens
    lags = [(lag, n) for rid, g in source.trained for s in g.samples if s.status is not Status.FAILED
            for lag, n in token_lags(s, rid, g.admission_version)]
    lag_tokens = sum(n for _lag, n in lags)
    trained_len, generated_len = _lengths(trained_samples), _lengths(resolved_samples)
    measured = steps - setup.warmup
    return {
        "eta": eta, "order": order, "steps": steps,
        "throughput": measured * setup.batch / window_s if window_s > 0 else 0.0,
        "window_s": window_s, "trainer_wait": wait_s / window_s if window_s > 0 else 0.0,
        "occupancy": float(np.mean(occupancy)) if occupancy else 0.0,
        "occupancy_min": float(np.min(occupancy)) if occupancy else 0.0,
        "generated_tokens": generated, "trained_tokens": trained_tokens, "left_tokens": left_tokens,
        "left_groups": len(left), "in_flight_groups": in_flight, "waste_tokens": waste,
        "waste_pct": 100.0 * waste / generated if generated else 0.0,
        "discarded_groups": len(source.discarded), "stale": counters.get(Counter.STALE, 0),
        "requeued": counters.get(Counter.REQUEUED, 0), "failed_jobs": counters.get(Counter.FAILED, 0),
        "episodes_failed": counters.get(Counter.EPISODES_FAILED, 0),
        "trained_len": trained_len, "generated_len": generated_len,
        "len_diff_mean_pct": _pct(trained_len["mean"], generated_len["mean"]),
        "len_diff_p90_pct": _pct(trained_len["p90"], generated_len["p90"]),
        "lag_max": max((lag for lag, _n in lags), default=0),
        "lag_mean": sum(lag * n for lag, n in lags) / lag_tokens if lag_tokens else 0.0,
    }


def _pct(trained: float, generated: float) -> float:
    return 100.0 * (trained / generated - 1.0) if generated else 0.0


# ------------------------------------------------------------------ the section


def configurations(etas: tuple[int, ...] = ETAS, orders: tuple[str, ...] = ORDERS) -> list[tuple[int, str]]:
    return [(0, "due-first")] + [(eta, order) for eta in etas for order in orders]


def run_all(redis_url: str, setup: Setup, *, repeats: int, configs: list[tuple[int, str]],
            progress: bool = True) -> dict[tuple[int, str], list[dict[str, Any]]]:
    results: dict[tuple[int, str], list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp, \
            fleet_of(engine_args(setup), 1, Path(tmp)) as engine:
        for rep in range(repeats):
            sync = None
            for eta, order in configs:
                r = run_once(redis_url, engine.url, setup, eta=eta, order=order, workdir=Path(tmp))
                if eta == 0:
                    sync = r
                r["speedup"] = r["throughput"] / sync["throughput"] if sync and sync["throughput"] else float("nan")
                results[(eta, order)].append(r)
                if progress:
                    print(f"[async] repeat {rep + 1}/{repeats} eta={eta} {order}: {r['throughput']:.2f} groups/s "
                          f"x{r['speedup']:.2f}, occupancy {r['occupancy']:.2f}, waste {r['waste_pct']:.1f}%, "
                          f"len {r['len_diff_mean_pct']:+.1f}%/{r['len_diff_p90_pct']:+.1f}%, lag max {r['lag_max']}, "
                          f"discarded {r['discarded_groups']}, left {r['left_groups']}+{r['in_flight_groups']}",
                          flush=True)
    return results


def _mmm(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def _fmt(values: list[float], spec: str = ".2f") -> str:
    lo, mid, hi = _mmm(values)
    return f"{mid:{spec}} ({lo:{spec}}-{hi:{spec}})"


def figures_from(results: dict[tuple[int, str], list[dict[str, Any]]], setup: Setup) -> list[Figure]:
    figures: list[Figure] = []
    sync_thr = [r["throughput"] for r in results.get((0, "due-first"), [])]
    sync_mid = statistics.median(sync_thr) if sync_thr else 0.0
    for (eta, order), runs in results.items():
        label = "sync baseline (eta=0)" if eta == 0 else f"eta={eta} {order}"
        col = {k: [r[k] for r in runs] for k in runs[0] if isinstance(runs[0][k], (int, float))}
        details = {"runs": runs, "setup": asdict(setup)}
        spd = col["speedup"]
        occ = col["occupancy"]
        speed_met = None if eta == 0 else (min(spd) >= AREAL_SPEEDUP and min(occ) >= OCCUPANCY_GOAL)
        figures.append(Figure(
            section="async", name=f"{label}: trained groups/s, median (min-max) {_fmt(col['throughput'])}, "
            f"speedup {_fmt(spd)}x, admission occupancy {_fmt(occ)}, trainer wait {_fmt(col['trainer_wait'])}",
            value=statistics.median(col["throughput"]), unit="groups/s", baseline="sync (eta=0) median",
            baseline_value=sync_mid, ratio=statistics.median(spd),
            goal="" if eta == 0 else f"speedup >= {AREAL_SPEEDUP}x with occupancy >= {OCCUPANCY_GOAL}, every repeat",
            met=speed_met, details=details))
        figures.append(Figure(
            section="async", name=f"{label}: generated tokens never trained, median (min-max) "
            f"{_fmt(col['waste_pct'], '.1f')} % ({_fmt(col['discarded_groups'], '.0f')} groups discarded; "
            f"left at the end, not waste: {_fmt(col['left_groups'], '.0f')} groups waiting, "
            f"{_fmt(col['in_flight_groups'], '.0f')} in flight)",
            value=statistics.median(col["waste_pct"]), unit="%", goal=f"<= {WASTE_GOAL_PCT:g} %, every repeat",
            met=max(col["waste_pct"]) <= WASTE_GOAL_PCT))
        mean_t = [r["trained_len"]["mean"] for r in runs]
        mean_g = [r["generated_len"]["mean"] for r in runs]
        p90_t = [r["trained_len"]["p90"] for r in runs]
        p90_g = [r["generated_len"]["p90"] for r in runs]
        worst = max(max(abs(v) for v in col["len_diff_mean_pct"]), max(abs(v) for v in col["len_diff_p90_pct"]))
        figures.append(Figure(
            section="async", name=f"{label}: trained vs generated response length, mean {_fmt(mean_t, '.1f')} vs "
            f"{_fmt(mean_g, '.1f')} tokens = {_fmt(col['len_diff_mean_pct'], '+.1f')} %, p90 {_fmt(p90_t, '.0f')} vs "
            f"{_fmt(p90_g, '.0f')} = {_fmt(col['len_diff_p90_pct'], '+.1f')} %",
            value=statistics.median(col["len_diff_mean_pct"]), unit="% (mean)",
            goal=f"within {LENGTH_GOAL_PCT:g} % (mean and p90), every repeat", met=worst <= LENGTH_GOAL_PCT))
        figures.append(Figure(
            section="async", name=f"{label}: lag per trained token, max {max(col['lag_max']):.0f}, mean "
            f"{_fmt(col['lag_mean'])} versions", value=float(max(col["lag_max"])), unit="versions",
            goal=f"<= eta ({eta})", met=max(col["lag_max"]) <= eta))
    figures += _all_goals_together(figures)
    return figures


def _all_goals_together(figures: list[Figure]) -> list[Figure]:
    """Issue 17's goal is the four at once: the fastest configuration that meets speedup (with
    occupancy), waste, length and lag in every repeat; if none does, the fastest one, marked missed."""
    by_label: dict[str, list[Figure]] = {}
    for f in figures:
        label = f.name.split(":")[0]
        if not label.startswith("sync"):
            by_label.setdefault(label, []).append(f)
    if not by_label:
        return []
    speed = {label: next(f for f in figs if f.unit == "groups/s") for label, figs in by_label.items()}
    together = [label for label, figs in by_label.items() if all(f.met for f in figs)]
    best = max(together or speed, key=lambda label: speed[label].ratio)
    fig = speed[best]
    return [Figure(
        section="async", name=f"speedup, waste, length and lag goals met together, fastest ({best}; met by: "
        f"{', '.join(together) or 'none'})", value=fig.value, unit="groups/s", baseline="sync (eta=0) median",
        baseline_value=fig.baseline_value, ratio=fig.ratio,
        goal=f"ratio >= {AREAL_SPEEDUP} (AReaL), waste <= {WASTE_GOAL_PCT:g} %, length within {LENGTH_GOAL_PCT:g} %, "
        "lag <= eta, every repeat", met=bool(together))]


def table(results: dict[tuple[int, str], list[dict[str, Any]]]) -> str:
    """A markdown table, median (min-max) of the repeats."""
    head = ("| eta | order | trained groups/s | speedup vs sync | admission occupancy | tokens never trained | "
            "groups discarded | trained vs generated length, mean | p90 | lag max / mean per token | left at end |")
    lines = [head, "|" + "---|" * 11]
    for (eta, order), runs in results.items():
        col = {k: [r[k] for r in runs] for k in runs[0] if isinstance(runs[0][k], (int, float))}
        lines.append(
            f"| {eta} | {'sync' if eta == 0 else order} | {_fmt(col['throughput'])} | {_fmt(col['speedup'])}x | "
            f"{_fmt(col['occupancy'])} | {_fmt(col['waste_pct'], '.1f')} % | {_fmt(col['discarded_groups'], '.0f')} | "
            f"{_fmt(col['len_diff_mean_pct'], '+.1f')} % | {_fmt(col['len_diff_p90_pct'], '+.1f')} % | "
            f"{max(col['lag_max']):.0f} / {_fmt(col['lag_mean'])} | "
            f"{_fmt(col['left_groups'], '.0f')} + {_fmt(col['in_flight_groups'], '.0f')} |")
    return "\n".join(lines)


def bench_async(redis_url: str, *, quick: bool, setup: Setup | None = None, repeats: int = 3,
                configs: list[tuple[int, str]] | None = None) -> list[Figure]:
    setup = setup or Setup(steps=8 if quick else 12)
    results = run_all(redis_url, setup, repeats=repeats, configs=configs or configurations())
    print(table(results), flush=True)
    return figures_from(results, setup)


def main(argv: list[str] | None = None) -> int:
    from pipeline.store.local_redis import LocalRedis

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--etas", default=",".join(map(str, ETAS)))
    p.add_argument("--orders", default=",".join(ORDERS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--train-s", type=float, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    setup = Setup(steps=a.steps or (8 if a.quick else 12))
    if a.train_s is not None:
        setup.train_s = a.train_s
    configs = configurations(tuple(int(e) for e in a.etas.split(",") if e), tuple(a.orders.split(",")))
    with LocalRedis() as server:
        results = run_all(server.url, setup, repeats=a.repeats, configs=configs)
    print(table(results))
    figures = figures_from(results, setup)
    for f in figures:
        print(f.line())
    if a.json:
        import msgspec
        Path(a.json).write_text(json.dumps(msgspec.to_builtins(figures), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
