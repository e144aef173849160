"""Publish to first request: how long after the trainer publishes a policy version the engine sees
the first request of the cohort that version lets in (issue 46 item 5).

    python -m scripts.bench.push_gap [--steps 5] [--scales 1,50] [--modes poll,wake] [--json out.json]

The real path, each part its own process: redis-server, the simulated engine (`rollout engine`,
Qwen3-8B on an H100 by aiconfigurator's step times, at the time scale given), `rollout workers`
and `rollout enqueue --follow`. The trainer is played here: eta 0, so every version lets exactly
B more groups in; before each publish it waits until every admitted group is in the stream (the
engine is empty: every request after the publish is the new cohort's), then `--idle-s` more (the
bench's trainer step at 50x, 91.4 s / 50: the workers' queue has been empty that long, as at
every push of a run where everything admitted is running), then publishes the next version
(`PipelineState.publish_policy`, the data source's own call) and times, from just before it:

- admitted: `{ns}:counters` enqueued moved (the producer's admission script ran);
- claimed: `{ns}:counters` running moved (a worker's take script recorded a job as its own);
- request: the engine's arrival time of its first /generate after the publish (GET /sim/arrivals).

The first two are read by a probe every millisecond (their resolution); the third is the
engine's own clock (the same host's wall clock). `poll` runs the workers with
`workers.wake_on_admission: false` (the queue polled alone: an idle poll backs off to 1 s),
`wake` with the default (a worker waits on the admission's `{ns}:queued_events` message).
Engine steps are the engine's simulated seconds: wall seconds x the time scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from pipeline.keys import Counter, Keys
from pipeline.state import PipelineState, TrainerInfo
from pipeline.store.redis_conn import connect
from scripts.bench.harness import math_tasks, pipeline_contender

NS = "gap"
PROBE_S = 0.001  # the probe's period: the resolution of the admitted and claimed times
STEP_TIMEOUT_S = 60.0
MODES = {"poll": False, "wake": True}  # mode -> workers.wake_on_admission


@dataclass
class Setup:
    """What one measurement runs: B groups of n a version, the engine's time scale, the idle
    time before each publish, and the workers' wake-up on or off."""

    time_scale: float = 50.0
    wake: bool = True
    steps: int = 5
    batch: int = 2
    n: int = 16
    idle_s: float = 1.8
    concurrency: int = 8  # groups a worker runs at once (more than B: every admitted job starts)
    length_median: int = 100  # tokens of an answer (lognormal, sigma 0.5): a cohort in seconds at 1x
    max_tokens: int = 300

    def engine_args(self, tasks: Path) -> list[str]:
        return ["--model", "Qwen/Qwen3-8B", "--gpu", "h100_sxm", "--time-scale", str(self.time_scale),
                "--length-mu", str(math.log(self.length_median)), "--length-sigma", "0.5",
                "--max-filler-tokens", str(self.max_tokens), "--tasks", str(tasks), "--seed", "0"]

    def pipeline_config(self, redis_url: str, engine_url: str) -> dict[str, Any]:
        from workers.sim.tokenizer import default_tokenizer_path

        return {
            "redis": {"url": redis_url, "namespace": NS},
            "engine": {"url": engine_url, "tokenizer": default_tokenizer_path(), "request_timeout_s": 120.0},
            "rollout": {"n_samples_per_prompt": self.n, "rollout_batch_size": self.batch, "eta": 0,
                        "max_response_tokens": self.max_tokens + 64, "max_turns": 1,
                        "sampling": {"temperature": 1.0}},
            "workers": {"concurrency": self.concurrency, "heartbeat_s": 1.0, "dead_after_s": 30.0,
                        "drain_grace_s": 2.0, "poll_delay_s": 0.05, "wake_on_admission": self.wake},
            "environments": {"math": {"kind": "math", "options": {"check_in": "inline"}}},
        }


@dataclass
class StepGap:
    """Seconds after the publish (None: not seen within STEP_TIMEOUT_S)."""

    admitted_s: float | None
    claimed_s: float | None
    request_s: float | None


@dataclass
class GapRun:
    setup: Setup
    steps: list[StepGap] = field(default_factory=list)

    def column(self, name: str) -> list[float]:
        return [v for v in (getattr(s, name) for s in self.steps) if v is not None]


async def measure_gaps(redis: aioredis.Redis, engine_url: str, keys: Keys, setup: Setup) -> list[StepGap]:
    """Play the trainer for `setup.steps` publishes (eta 0) and time each (see the module doc).
    The producer and the workers run elsewhere, on `keys`' namespace."""
    state = PipelineState(redis, keys)
    run = await state.begin_run()
    await state.set_trainer_info(TrainerInfo(rollout_batch_size=setup.batch, n_samples_per_prompt=setup.n, eta=0))
    await state.publish_policy(run=run, start=0, engine_version=0, rollout_id=0)
    gaps = []
    async with aiohttp.ClientSession() as http:
        for version in range(1, setup.steps + 1):
            await _wait_for(lambda v=version: _groups_in(redis, keys, v * setup.batch), STEP_TIMEOUT_S)
            await _wait_for(lambda: _running_is(redis, keys, 0), STEP_TIMEOUT_S)
            await asyncio.sleep(setup.idle_s)
            gaps.append(await _time_publish(state, http, engine_url, run, version))
    return gaps


async def _time_publish(state: PipelineState, http: aiohttp.ClientSession, engine_url: str, run: int,
                        version: int) -> StepGap:
    redis, keys = state.redis, state.keys
    enqueued0, running0 = await _admitted_running(redis, keys)
    published = time.time()
    await state.publish_policy(run=run, start=0, engine_version=version, rollout_id=version)
    admitted = claimed = None
    deadline = published + STEP_TIMEOUT_S
    while time.time() < deadline and claimed is None:
        enqueued, running = await _admitted_running(redis, keys)
        now = time.time() - published
        if admitted is None and enqueued > enqueued0:
            admitted = now
        if running > running0:
            claimed = now
        await asyncio.sleep(PROBE_S)
    while time.time() < deadline:
        async with http.get(f"{engine_url}/sim/arrivals", params={"since": repr(published)}) as reply:
            arrivals = (await reply.json())["arrivals"]
        if arrivals:
            return StepGap(admitted, claimed, min(arrivals) - published)
        await asyncio.sleep(0.002)
    return StepGap(admitted, claimed, None)


async def _admitted_running(redis: aioredis.Redis, keys: Keys) -> tuple[int, int]:
    raw = await redis.hmget(keys.counters, [Counter.ENQUEUED, Counter.RUNNING])  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
    return int(raw[0] or 0), int(raw[1] or 0)


async def _groups_in(redis: aioredis.Redis, keys: Keys, groups: int) -> bool:
    return int(await redis.xlen(keys.groups)) >= groups


async def _running_is(redis: aioredis.Redis, keys: Keys, running: int) -> bool:
    return (await _admitted_running(redis, keys))[1] == running


async def _wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pipeline did not get there within {timeout_s:.0f} s")
        await asyncio.sleep(0.01)


def run_setup(setup: Setup, workdir: Path) -> GapRun:
    """One measurement on fresh processes: Redis, the engine, one worker process, the producer."""
    tasks = math_tasks(workdir)
    with pipeline_contender(workdir, tasks, setup.pipeline_config, engine_args=setup.engine_args(tasks)) as c:
        return GapRun(setup, asyncio.run(_measure_on(c.redis.url, c.fleet.url, setup)))


async def _measure_on(redis_url: str, engine_url: str, setup: Setup) -> list[StepGap]:
    redis = connect(redis_url)
    try:
        return await measure_gaps(redis, engine_url, Keys(NS), setup)
    finally:
        await redis.aclose()


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def table(runs: list[GapRun]) -> str:
    """Markdown: per time scale and mode, median (min-max) ms after the publish, and the request
    gap in engine seconds (wall x time scale)."""
    lines = ["| time scale | workers | steps | admitted (ms) | claimed (ms) | first request (ms) | "
             "first request (engine s) |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        requests = r.column("request_s")
        engine_s = statistics.median(requests) * r.setup.time_scale if requests else float("nan")
        lines.append(f"| {r.setup.time_scale:g}x | {'wake' if r.setup.wake else 'poll'} | {len(requests)}/{len(r.steps)} "
                     f"| {_ms(r.column('admitted_s'))} | {_ms(r.column('claimed_s'))} | {_ms(requests)} "
                     f"| {engine_s:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.push_gap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="publishes timed per time scale and mode")
    parser.add_argument("--scales", default="1,50", help="engine time scales, comma-separated")
    parser.add_argument("--modes", default="poll,wake", help="poll (workers.wake_on_admission false), wake, or both")
    parser.add_argument("--idle-s", type=float, default=Setup.idle_s, help="the trainer's step before each publish")
    parser.add_argument("--json", default="", help="write every step's times here")
    opts = parser.parse_args(argv)
    runs = []
    for scale in (float(s) for s in opts.scales.split(",")):
        for mode in opts.modes.split(","):
            if mode not in MODES:
                parser.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
            setup = Setup(time_scale=scale, wake=MODES[mode], steps=opts.steps, idle_s=opts.idle_s)
            with tempfile.TemporaryDirectory(prefix="push_gap_") as tmp:
                runs.append(run_setup(setup, Path(tmp)))
            print(f"[push_gap] {scale:g}x {mode}: " + ", ".join(
                f"{s.request_s * 1e3:.1f} ms" if s.request_s is not None else "none" for s in runs[-1].steps),
                flush=True)
    print(table(runs))
    if opts.json:
        Path(opts.json).write_text(json.dumps([{"setup": asdict(r.setup), "steps": [asdict(s) for s in r.steps]}
                                               for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
