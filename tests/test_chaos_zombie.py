"""Chaos: a worker frozen (SIGSTOP) past `dead_after_s` while running jobs on their last try,
then resumed (issue 13 item 3). The reaper releases its jobs; their re-run is past
`max_tries` (1), so it dead-letters them and hands the tasks back with each group's dedup
marker as a tombstone; the producer re-admits them; the zombie wakes and pushes its groups
late: the tombstones refuse them. Every task trained exactly once.

Run alone: `python -m pytest tests/test_chaos_zombie.py -s -p no:warnings`.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter as Tally

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter
from tests.chaos_helpers import Trainer, live_workers, wait_workers
from tests.test_chaos_aof import _write_tasks

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

BATCH, N, ETA = 2, 2, 2
FROZEN_S = 6.0  # > dead_after_s (2) + a heartbeat


def _config(redis_url: str, ns: str, engine_url: str, tokenizer: str) -> dict:
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine_url, "tokenizer": tokenizer, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": N, "rollout_batch_size": BATCH, "eta": ETA, "max_response_tokens": 96},
        "environments": {"arith": {"kind": "arithmetic"}},
        "workers": {"concurrency": 2, "heartbeat_s": 0.5, "dead_after_s": 2.0, "poll_delay_s": 0.05, "max_tries": 1},
    }


async def test_a_zombie_worker_on_its_last_try_trains_nothing_twice(redis, keys, namespace, redis_url, tmp_path):
    from producers.enqueue import ProducerOptions, run_producer
    from workers.sim.engine import SimConfig, serve_sim_engine
    from workers.sim.processes import WorkerProcess, write_config
    from workers.sim.tokenizer import default_tokenizer_path

    task_ids = _write_tasks(tmp_path / "tasks.jsonl", namespace)[:12]
    (tmp_path / "tasks.jsonl").write_text("\n".join((tmp_path / "tasks.jsonl").read_text().splitlines()[:12]) + "\n")
    tokenizer = default_tokenizer_path()
    sim = SimConfig(token_latency_s=0.02, latency_sigma=0.2, length_sigma=0.2, slots=64, tokenizer_path=tokenizer)
    async with serve_sim_engine(sim) as engine:
        data = _config(redis_url, namespace, engine.url, tokenizer)
        config_path = write_config(data, tmp_path / "pipeline.yaml")
        workers = [WorkerProcess(config_path, log_path=str(tmp_path / f"w{i}.log")).start() for i in range(2)]
        stop = asyncio.Event()
        producer = None
        frozen: dict = {}
        try:
            await wait_workers(redis, keys, 2)
            epoch0 = set(task_ids)
            trainer = Trainer(redis_url, namespace, batch=BATCH, n=N, eta=ETA, max_steps=40,
                              done=lambda t: epoch0 <= t.trained_tasks(0), wait_timeout_s=60.0)
            trainer.start()
            producer = asyncio.create_task(run_producer(parse_config(data), tmp_path / "tasks.jsonl", follow=False,
                                                        stop_event=stop, options=ProducerOptions(max_requeues=3)))
            zombie = workers[0]
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
        finally:
            stop.set()
            if producer is not None:
                await asyncio.wait_for(asyncio.gather(producer, return_exceptions=True), 15)
            for w in workers:
                w.signal(signal.SIGCONT)
                w.stop(grace_s=5)

    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    per_task = Tally(trainer.trained())
    lost = sorted(set(task_ids) - {t for t, e in per_task if e == 0})
    duplicates = {t: c for t, c in per_task.items() if c > 1}
    in_stream = await redis.xlen(keys.groups)
    report = {
        "tasks": len(task_ids), "frozen_jobs": len(frozen["jobs"]), "frozen_s": FROZEN_S,
        "groups_trained": len(trainer.trained_groups), "lost": len(lost), "duplicates": len(duplicates),
        "handed_back_readmitted": sum("r" in g.rsplit(":", 1)[1] for g in trainer.trained_groups),
        "late_pushes_refused": counters.get(Counter.DUPLICATES, 0), "dead_letters": counters.get(Counter.DEAD, 0),
        "left_in_stream": in_stream,
    }
    print("\nCHAOS zombie worker report:", json.dumps(report))
    assert lost == [] and duplicates == {}, report
    assert report["handed_back_readmitted"] >= 1, report  # the freeze did hit last tries
    assert in_stream == 0, report  # no late group slipped into the buffer
