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

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter, Keys
from tests.support.chaos_helpers import Trainer, counters, live_workers, sim_run, write_tasks
from tests.support.engine_stack import START_TIMEOUT_S

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(START_TIMEOUT_S + 300)]  # + the session stack's start

TASKS = 240
BATCH, N, ETA = 8, 2, 4
KILLS = 4


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

    rng = random.Random(1234)
    task_ids = write_tasks(tmp_path / "tasks.jsonl", namespace, TASKS)
    sim = dict(token_latency_s=0.004, latency_sigma=0.6, length_sigma=0.8)
    async with sim_run(redis, keys, redis_url, tmp_path, sim=sim, batch=BATCH, n=N, eta=ETA, max_response_tokens=256,
                       concurrency=8, dead_after_s=2.0, poll_delay_s=0.02, max_tries=4) as run:
        kills: list[dict] = []
        run.producer = asyncio.create_task(run_producer(parse_config(run.data), tmp_path / "tasks.jsonl", follow=True,
                                                        stop_event=run.stop))
        epoch0 = set(task_ids)  # train until every epoch-0 task was trained
        trainer = Trainer(redis_url, namespace, batch=BATCH, n=N, eta=ETA, max_steps=3 * TASKS // BATCH,
                          done=lambda t: epoch0 <= t.trained_tasks(0))
        trainer.start()
        recoveries = []
        while trainer.is_alive() and len(kills) < KILLS:
            await asyncio.sleep(rng.uniform(0.8, 2.5))
            victim = rng.choice([w for w in run.workers if w.proc.poll() is None])
            pid = victim.proc.pid
            ids = [w for w in await live_workers(redis, keys) if f":{pid}:" in w]
            # group ids of its jobs (arq job ids may carry the namespace: `{ns}:{group id}`)
            jobs = [j.decode().removeprefix(f"{keys.ns}:") for w in ids for j in await redis.smembers(keys.worker_jobs(w))]
            victim.signal(signal.SIGKILL)
            killed_at = time.monotonic()
            victim.proc.wait(10)
            run.start_worker()
            kills.append({"pid": pid, "running_groups": len(jobs)})
            recoveries.append(asyncio.create_task(_recovery_s(redis, keys, jobs, killed_at)))
        for kill, seconds in zip(kills, await asyncio.gather(*recoveries)):
            kill["recovery_s"] = round(seconds, 2)
        await asyncio.to_thread(trainer.join_and_check, 200)

    counts = await counters(redis, keys)
    # per (task, epoch): the producer's follow mode starts epoch 1 meanwhile
    lost, duplicates = trainer.lost_and_duplicates(task_ids)
    report = {
        "tasks": TASKS, "steps": len(trainer.trained_groups) // BATCH, "groups_trained": len(trainer.trained_groups), "kills": kills,
        "lost": len(lost), "duplicates": len(duplicates),
        "duplicate_pushes_refused": counts.get(Counter.DUPLICATES, 0),
        "stale_kept": counts.get(Counter.STALE, 0), "dead_letters": counts.get(Counter.DEAD, 0),
        "jobs_failed": counts.get(Counter.FAILED, 0),
    }
    print("\nCHAOS worker SIGKILL report:", json.dumps(report))
    assert len(kills) == KILLS
    assert any(k["running_groups"] for k in kills), "no kill hit a running group: the test proved nothing"
    assert all(k["recovery_s"] < 30 for k in kills), kills
    assert lost == [] and duplicates == {}, report
    assert len(trainer.trained_groups) == len(set(trainer.trained_groups))
    assert os.path.exists(run.config_path)
