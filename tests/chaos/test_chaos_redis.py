"""Chaos: Redis itself misbehaves during a whole run (issue 13).

Every client of the pipeline (the `rollout workers` processes with their arq connection and
our own, the producer, the slime data source in a trainer thread) talks to redis-server
through `LossyProxy`, which forwards each command and then, for 1 reply in `1/RATE`, drops the
connection instead of forwarding the reply: the server executed the command, the client
retries it. Once during the run the proxy also goes down for `OUTAGE_S` seconds (open
connections cut, new ones refused): a Redis restart as the clients see it.

Asserts: every epoch-0 task trained exactly once (0 lost, 0 duplicates); no process crashed;
after the run drains, the counters equal ground truth (enqueued = the producer's admissions
= pushed + failed jobs; buffered = trained + still in the stream; accepted = trained; dead =
dead letters; running = 0); each consumed record holds exactly B ids.
Run alone: `python -m pytest tests/chaos/test_chaos_redis.py -s` (prints the report).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter, Keys
from tests.support.chaos_helpers import LossyProxy, Trainer, counters, sim_run, write_tasks
from tests.support.engine_stack import START_TIMEOUT_S

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(START_TIMEOUT_S + 240)]  # + the session stack's start

TASKS = 80
BATCH, N, ETA = 4, 2, 2
RATE = 50  # 1 reply in RATE is lost
OUTAGE_S = 2.0


async def test_lost_replies_and_an_outage_lose_nothing_and_count_true(redis, redis_server, keys, namespace, tmp_path):
    from producers.enqueue import ProducerOptions, run_producer

    task_ids = write_tasks(tmp_path / "tasks.jsonl", namespace, TASKS)
    sim = dict(token_latency_s=0.002, latency_sigma=0.5, length_sigma=0.5)
    proxy = LossyProxy(redis_server.port, rate=0.0, seed=13).start()
    outage: dict = {}
    try:
        async with sim_run(redis, keys, proxy.url, tmp_path, sim=sim, batch=BATCH, n=N, eta=ETA, max_response_tokens=128,
                           concurrency=4, dead_after_s=3.0, poll_delay_s=0.05, max_tries=4) as run:
            proxy.rate = 1 / RATE  # from here on every client loses replies

            def after_step(rid: int) -> None:
                if rid == 3:
                    outage["dropped_before"] = proxy.dropped
                    proxy.down(OUTAGE_S)

            epoch0 = set(task_ids)
            trainer = Trainer(proxy.url, namespace, batch=BATCH, n=N, eta=ETA, max_steps=3 * TASKS // BATCH,
                              done=lambda t: epoch0 <= t.trained_tasks(0), after_step=after_step,
                              wait_timeout_s=40.0)
            trainer.start()  # publishes {ns}:trainer: the producer waits for it
            run.producer = asyncio.create_task(run_producer(
                parse_config(run.data), tmp_path / "tasks.jsonl", follow=True, stop_event=run.stop,
                options=ProducerOptions(max_requeues=3),
            ))
            await asyncio.to_thread(trainer.join_and_check, 180)
            run.stop.set()
            stats = await asyncio.wait_for(run.producer, 60)  # raises if the producer crashed
            proxy.rate = 0.0
            # drain: every admitted job pushed or failed, nothing running
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                counts = await counters(redis, keys)
                if (not await redis.zcard(keys.queue) and counts.get(Counter.RUNNING, 0) == 0
                        and counts.get(Counter.ENQUEUED, 0)
                        == counts.get(Counter.BUFFERED, 0) + counts.get(Counter.FAILED, 0)):
                    break
                await asyncio.sleep(0.2)
            crashed = [w.proc.returncode for w in run.workers if w.proc.poll() is not None]
    finally:
        proxy.close()

    counts = await counters(redis, keys)
    lost, duplicates = trainer.lost_and_duplicates(task_ids)
    in_stream = await redis.xlen(keys.groups)
    consumed = [await redis.llen(k) async for k in redis.scan_iter(match=Keys(namespace).consumed_pattern)]
    report = {
        "tasks": TASKS, "steps": trainer.steps, "groups_trained": len(trainer.trained_groups),
        "replies": proxy.replies, "replies_lost": proxy.dropped, "connections_refused_in_outage": proxy.refused,
        "lost": len(lost), "duplicates": len(duplicates), "workers_crashed": len(crashed),
        "producer": {"admitted": stats.admitted, "requeued": stats.requeued, "refused": stats.refused},
        "counters": {k: counts.get(k, 0) for k in (Counter.ENQUEUED, Counter.BUFFERED, Counter.ACCEPTED,
                                                     Counter.FAILED, Counter.DUPLICATES, Counter.DEAD,
                                                     Counter.RUNNING, Counter.REQUEUED)},
        "in_stream": in_stream, "dead_letters": await redis.xlen(keys.dead),
    }
    print("\nCHAOS redis lost replies report:", json.dumps(report))
    assert proxy.dropped >= 20, "too few replies lost: the test proved little"
    assert outage, "the outage never happened"
    assert lost == [] and duplicates == {}, report
    assert crashed == [], report
    # counters = ground truth
    assert counts.get(Counter.ENQUEUED, 0) == stats.admitted + stats.requeued, report
    assert counts.get(Counter.ENQUEUED, 0) == counts.get(Counter.BUFFERED, 0) + counts.get(Counter.FAILED, 0), report
    assert counts.get(Counter.ACCEPTED, 0) == len(trainer.trained_groups), report
    assert counts.get(Counter.BUFFERED, 0) == len(trainer.trained_groups) + in_stream, report
    assert counts.get(Counter.DEAD, 0) == report["dead_letters"], report
    assert counts.get(Counter.RUNNING, 0) == 0, report
    assert counts.get(Counter.REQUEUED, 0) == await redis.llen(keys.requeue) + stats.requeued + stats.refused, report
    assert all(n == BATCH for n in consumed), consumed
