"""Benchmark: one worker process against the simulated engine (zero latency unless `engine_args` say).

Prints episodes/s and the worker's event-loop lag (p50/p99/max) at a given number of
concurrent episodes (goal: lag p99 < 50 ms at 1,000), side by side with a low
concurrency run as the baseline. The worker runs in this process (so its loop is the
one measured); the engine and redis-server are child processes.

    python scripts/bench/worker.py --concurrency 1000 --episodes 8000
`run_worker_bench(concurrency, episodes, ...) -> dict` is what `rollout bench` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.config import parse_config  # noqa: E402
from pipeline.keys import Keys  # noqa: E402
from pipeline.schema import PromptJob, Task  # noqa: E402
from pipeline.state import PipelineState  # noqa: E402
from pipeline.store.jobqueue import create_arq_pool, enqueue_prompt_job  # noqa: E402
from pipeline.store.local_redis import LocalRedis  # noqa: E402
from pipeline.store.redis_conn import connect  # noqa: E402
from scripts.bench.harness import engine_stats, fleet_of  # noqa: E402
from workers.jobs import CTX_KEY  # noqa: E402
from workers.settings import build_worker, stop_worker  # noqa: E402

LAG_INTERVAL_S = 0.01


async def _sample_lag(samples: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(LAG_INTERVAL_S)
        samples.append(loop.time() - start - LAG_INTERVAL_S)


async def _bench(redis_url: str, engine_url: str, concurrency: int, episodes: int, n_samples: int, env: str) -> dict:
    ns = f"bench{int(time.time() * 1000) % 10**9}"
    keys = Keys(ns)
    groups = max(1, episodes // n_samples)
    config = parse_config({
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine_url},
        "rollout": {"n_samples_per_prompt": n_samples, "max_response_tokens": 1024},
        "environments": {env: {"kind": env}},
        "workers": {"poll_delay_s": 0.01},
    })
    arq = await create_arq_pool(redis_url, keys)
    for i in range(groups):
        task = Task(id=f"{ns}-{i}", env=env, prompt=f"What is {i} * 7?", label=str(7 * i))
        await enqueue_prompt_job(arq, PromptJob(task=task, epoch=0, n_samples=n_samples), keys)
    await arq.aclose()
    redis = connect(redis_url)
    # Workers stamp every generate call with the policy version the trainer publishes and wait
    # until one is (pipeline/state.py PolicyClock): stand in for the trainer's first rollout.
    state = PipelineState(redis, keys)
    await state.publish_policy(run=await state.begin_run(), start=0, engine_version=0, rollout_id=0)
    lags: list[float] = []
    worker = build_worker(config, concurrency=max(1, concurrency // n_samples), handle_signals=False)
    worker_task = asyncio.create_task(worker.async_run())
    while CTX_KEY not in worker.ctx:  # startup (tokenizer load) is not steady-state lag
        await asyncio.sleep(0.01)
    started = time.perf_counter()
    sampler = asyncio.create_task(_sample_lag(lags))
    while await redis.xlen(keys.groups) < groups:
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - started
    sampler.cancel()
    await stop_worker(worker, worker_task)
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
    engine = await asyncio.to_thread(engine_stats, engine_url)
    await redis.aclose()
    lag_ms = np.asarray(lags) * 1000 if lags else np.zeros(1)
    return {
        "concurrency": concurrency,
        "episodes": groups * n_samples,
        "seconds": round(elapsed, 3),
        "episodes_per_s": round(groups * n_samples / elapsed, 1),
        "response_tokens_per_s": round(counters.get("tokens", 0) / elapsed, 1),
        "lag_p50_ms": round(float(np.percentile(lag_ms, 50)), 2),
        "lag_p99_ms": round(float(np.percentile(lag_ms, 99)), 2),
        "lag_max_ms": round(float(lag_ms.max()), 2),
        "episodes_failed": counters.get("episodes_failed", 0),
        "engine_max_running": engine.get("max_running", 0),  # generate calls in flight at once, engine side
    }


def run_worker_bench(
    concurrency: int, episodes: int, *, n_samples: int = 8, env: str = "calculator", engine_args: list[str] | None = None
) -> dict[str, Any]:
    """One in-process worker, `concurrency` episodes at once, against the simulated engine (zero latency
    unless `engine_args` set one, e.g. ["--token-latency-s", "0.01"]; `rollout bench` does)."""
    logging.getLogger("arq.worker").setLevel(logging.WARNING)
    with LocalRedis() as redis, fleet_of(["--slots", "0", *(engine_args or [])], 1, None) as engine:
        return asyncio.run(_bench(redis.url, engine.url, concurrency, episodes, n_samples, env))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--episodes", type=int, default=8000)
    p.add_argument("--baseline-concurrency", type=int, default=64)
    p.add_argument("--n-samples", type=int, default=8)
    args = p.parse_args(argv)
    rows = [
        run_worker_bench(args.baseline_concurrency, args.episodes // 4, n_samples=args.n_samples),
        run_worker_bench(args.concurrency, args.episodes, n_samples=args.n_samples),
    ]
    cols = list(rows[0])
    print(" | ".join(f"{c:>20}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]!s:>20}" for c in cols))
    base, high = rows
    print(f"\nat {high['concurrency']} concurrent episodes: lag p99 {high['lag_p99_ms']} ms "
          f"({'meets' if high['lag_p99_ms'] < 50 else 'MISSES'} the 50 ms goal); "
          f"episodes/s x{high['episodes_per_s'] / max(base['episodes_per_s'], 1e-9):.2f} vs concurrency "
          f"{base['concurrency']}; lag p99 x{high['lag_p99_ms'] / max(base['lag_p99_ms'], 1e-3):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
