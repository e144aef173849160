"""Chaos: worker processes SIGKILLed at random points, repeatedly, during a run of a few
hundred groups. Real parts end to end: redis-server, the simulated SGLang engine over
HTTP, the producer with admission control, `rollout workers` processes (arq), and the
slime data source in a trainer thread. Every admitted task must be trained exactly
once (0 lost, 0 duplicates); the recovery time of each kill is reported.

Run alone: `python -m pytest -m chaos -s` (prints the report).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter as Tally
from pathlib import Path

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter, Keys
from tests.chaos_helpers import Trainer, live_workers, wait_workers

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

TASKS = 240
BATCH, N, ETA = 8, 2, 4
KILLS = 4


def _config(redis_url: str, ns: str, engine_url: str, tokenizer: str) -> dict:
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine_url, "tokenizer": tokenizer, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": N, "rollout_batch_size": BATCH, "eta": ETA, "max_response_tokens": 256},
        "environments": {"arith": {"kind": "arithmetic"}},
        "workers": {"concurrency": 8, "heartbeat_s": 0.5, "dead_after_s": 2.0, "poll_delay_s": 0.02, "max_tries": 4},
    }


def _write_tasks(path: Path, ns: str) -> list[str]:
    ids = [f"{ns}-t{i}" for i in range(TASKS)]
    lines = [json.dumps({"id": tid, "env": "arith", "prompt": f"What is {i} + {i}?", "label": str(2 * i)})
             for i, tid in enumerate(ids)]
    path.write_text("\n".join(lines) + "\n")
    return ids


async def _recovery_s(redis, keys: Keys, jobs: list[str], killed_at: float, timeout: float = 60.0) -> float:
    """Seconds from the kill until every group the killed worker was running is in the buffer."""
    deadline = killed_at + timeout
    while time.monotonic() < deadline:
        if all([await redis.exists(keys.dedup(job)) for job in jobs]):
            return time.monotonic() - killed_at
        await asyncio.sleep(0.05)
    return float("inf")


async def test_sigkilled_workers_lose_nothing_and_train_nothing_twice(redis, redis_url, keys, namespace, tmp_path):
    from producers.enqueue import run_producer
    from workers.sim.engine import SimConfig, serve_sim_engine
    from workers.sim.processes import WorkerProcess, write_config
    from workers.sim.tokenizer import default_tokenizer_path

    rng = random.Random(1234)
    task_ids = _write_tasks(tmp_path / "tasks.jsonl", namespace)
    tokenizer = default_tokenizer_path()
    sim = SimConfig(token_latency_s=0.004, latency_sigma=0.6, length_sigma=0.8, slots=64, tokenizer_path=tokenizer)
    async with serve_sim_engine(sim) as engine:
        data = _config(redis_url, namespace, engine.url, tokenizer)
        config_path = write_config(data, tmp_path / "pipeline.yaml")
        workers = [WorkerProcess(config_path, log_path=str(tmp_path / f"w{i}.log")).start() for i in range(2)]
        stop = asyncio.Event()
        producer = None
        kills: list[dict] = []
        try:
            await wait_workers(redis, keys, 2)
            producer = asyncio.create_task(run_producer(parse_config(data), tmp_path / "tasks.jsonl", follow=True,
                                                        stop_event=stop))
            epoch0 = set(task_ids)  # train until every epoch-0 task was trained
            trainer = Trainer(redis_url, namespace, batch=BATCH, n=N, eta=ETA, max_steps=3 * TASKS // BATCH,
                              done=lambda t: epoch0 <= t.trained_tasks(0))
            trainer.start()
            recoveries = []
            while trainer.is_alive() and len(kills) < KILLS:
                await asyncio.sleep(rng.uniform(0.8, 2.5))
                victim = rng.choice([w for w in workers if w.proc.poll() is None])
                pid = victim.proc.pid
                ids = [w for w in await live_workers(redis, keys) if f":{pid}:" in w]
                # group ids of its jobs (arq job ids may carry the namespace: `{ns}:{group id}`)
                jobs = [j.decode().removeprefix(f"{keys.ns}:") for w in ids for j in await redis.smembers(keys.worker_jobs(w))]
                victim.signal(signal.SIGKILL)
                killed_at = time.monotonic()
                victim.proc.wait(10)
                workers.append(WorkerProcess(config_path, log_path=str(tmp_path / f"w{len(workers)}.log")).start())
                kills.append({"pid": pid, "running_groups": len(jobs)})
                recoveries.append(asyncio.create_task(_recovery_s(redis, keys, jobs, killed_at)))
            for kill, seconds in zip(kills, await asyncio.gather(*recoveries)):
                kill["recovery_s"] = round(seconds, 2)
            await asyncio.to_thread(trainer.join_and_check, 200)
        finally:
            stop.set()
            if producer is not None:
                await asyncio.wait_for(asyncio.gather(producer, return_exceptions=True), 15)
            for w in workers:
                w.stop(grace_s=5)

    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    per_task = Tally(trainer.trained())  # (task, epoch): the producer's follow mode starts epoch 1 meanwhile
    lost = sorted(set(task_ids) - {t for t, e in per_task if e == 0})
    duplicates = {t: c for t, c in per_task.items() if c > 1}
    report = {
        "tasks": TASKS, "steps": len(trainer.trained_groups) // BATCH, "groups_trained": len(trainer.trained_groups), "kills": kills,
        "lost": len(lost), "duplicates": len(duplicates),
        "duplicate_pushes_refused": counters.get(Counter.DUPLICATES, 0),
        "stale_kept": counters.get(Counter.STALE, 0), "dead_letters": counters.get(Counter.DEAD, 0),
        "jobs_failed": counters.get(Counter.FAILED, 0),
    }
    print("\nCHAOS worker SIGKILL report:", json.dumps(report))
    assert len(kills) == KILLS
    assert any(k["running_groups"] for k in kills), "no kill hit a running group: the test proved nothing"
    assert all(k["recovery_s"] < 30 for k in kills), kills
    assert lost == [] and duplicates == {}, report
    assert len(trainer.trained_groups) == len(set(trainer.trained_groups))
    assert os.path.exists(config_path)
