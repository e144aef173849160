"""Chaos: a worker frozen (SIGSTOP) past `dead_after_s` while running jobs on their last try,
then resumed (issue 13 item 3). The reaper releases its jobs; their re-run is past
`max_tries` (1), so it dead-letters them and hands the tasks back with each group's dedup
marker as a tombstone; the producer re-admits them; the zombie wakes and pushes its groups
late: the tombstones refuse them. Every task trained exactly once.

Run alone: `python -m pytest tests/chaos/test_chaos_zombie.py -s -p no:warnings`.
"""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter
from tests.support.chaos_helpers import Trainer, counters, live_workers, sim_run, write_tasks
from tests.support.engine_stack import START_TIMEOUT_S

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(START_TIMEOUT_S + 120)]  # + the session stack's start

BATCH, N, ETA = 2, 2, 2
FROZEN_S = 6.0  # > dead_after_s (2) + a heartbeat


async def test_a_zombie_worker_on_its_last_try_trains_nothing_twice(redis, keys, namespace, redis_url, tmp_path):
    from producers.enqueue import ProducerOptions, run_producer

    task_ids = write_tasks(tmp_path / "tasks.jsonl", namespace, 12)
    sim = dict(token_latency_s=0.02, latency_sigma=0.2, length_sigma=0.2)
    async with sim_run(redis, keys, redis_url, tmp_path, sim=sim, batch=BATCH, n=N, eta=ETA, max_response_tokens=96,
                       concurrency=2, dead_after_s=2.0, poll_delay_s=0.05, max_tries=1) as run:
        frozen: dict = {}
        epoch0 = set(task_ids)
        trainer = Trainer(redis_url, namespace, batch=BATCH, n=N, eta=ETA, max_steps=40,
                          done=lambda t: epoch0 <= t.trained_tasks(0), wait_timeout_s=60.0)
        trainer.start()
        run.producer = asyncio.create_task(run_producer(parse_config(run.data), tmp_path / "tasks.jsonl", follow=False,
                                                        stop_event=run.stop, options=ProducerOptions(max_requeues=3)))
        zombie = run.workers[0]
        pid = zombie.proc.pid
        while not frozen:  # freeze it while it runs jobs (each on its only try)
            ids = [w for w in await live_workers(redis, keys) if f":{pid}:" in w]
            jobs = [j.decode() for w in ids for j in await redis.smembers(keys.worker_jobs(w))]
            if jobs:
                zombie.signal(signal.SIGSTOP)
                frozen = {"jobs": jobs}
            await asyncio.sleep(0.05)
        await asyncio.sleep(FROZEN_S)
        zombie.signal(signal.SIGCONT)
        await asyncio.to_thread(trainer.join_and_check, 90)
        await asyncio.sleep(2.0)  # the zombie's late pushes land (and are refused) by now

    counts = await counters(redis, keys)
    lost, duplicates = trainer.lost_and_duplicates(task_ids)
    in_stream = await redis.xlen(keys.groups)
    report = {
        "tasks": len(task_ids), "frozen_jobs": len(frozen["jobs"]), "frozen_s": FROZEN_S,
        "groups_trained": len(trainer.trained_groups), "lost": len(lost), "duplicates": len(duplicates),
        "handed_back_readmitted": sum("r" in g.rsplit(":", 1)[1] for g in trainer.trained_groups),
        "late_pushes_refused": counts.get(Counter.DUPLICATES, 0), "dead_letters": counts.get(Counter.DEAD, 0),
        "left_in_stream": in_stream,
    }
    print("\nCHAOS zombie worker report:", json.dumps(report))
    assert lost == [] and duplicates == {}, report
    assert report["handed_back_readmitted"] >= 1, report  # the freeze did hit last tries
    assert in_stream == 0, report  # no late group slipped into the buffer
