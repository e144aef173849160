"""Chaos: redis-server SIGKILLed mid-run and restarted from its AOF, 3 times (issue 13).

Real parts: a private redis-server with `appendonly yes` (`appendfsync` always, then
everysec), the simulated SGLang engine over HTTP, two `rollout workers` processes (arq), the
producer (`--follow`) and the slime data source in a trainer thread (`chaos_helpers.Trainer`).
Three times during the run redis-server gets SIGKILL (no shutdown, no final fsync) and is
started again on the same port from the same AOF. No process is told: each has to ride the
outage out by itself (the outage budget of pipeline/store/redis_conn.py, arq's connection too).

Asserts: every process is still alive and the run finishes by itself; every epoch-0 task is
trained exactly once (0 lost, 0 duplicates); what the trainer acknowledged (save) before a
kill is still acknowledged after it (none of those groups is back in the stream), and at the
end the counters equal the truth (`accepted` = groups the trainer got, `buffered` = trained +
discarded + still in the stream). The run-shaped variant with the trainer and producer as processes
and the ledger as the oracle is tests/chaos/test_chaos_run.py. With `always` no
write is lost at all (stream and counters after the restart = before the kill). With
`everysec` the last second of writes may be lost: the report says what that cost (pushes and
counter moves that vanished, jobs re-run, duplicate pushes refused).

Run alone: `python -m pytest tests/chaos/test_chaos_aof.py -s -p no:warnings` (prints the reports).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time
from collections import Counter as Tally
from pathlib import Path

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter, Keys
from pipeline.store.buffer import GroupBuffer
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect
from tests.support.chaos_helpers import Trainer, counters, sim_run, write_tasks
from tests.support.engine_stack import START_TIMEOUT_S

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(START_TIMEOUT_S + 180)]  # + the session stack's start

TASKS = 80
BATCH, N, ETA = 4, 2, 2
KILLS = 3
DOWN_S = 0.5  # how long redis-server stays dead before it is started again
LOST_S = 1.0  # everysec: the AOF tail a machine crash may lose, cut at each kill (third case)


class AofTail(threading.Thread):
    """Samples the size of the AOF's incremental file every 50 ms, so that a kill can cut what
    was appended in the last `LOST_S` seconds: the writes `appendfsync everysec` may lose when
    the machine (not only the process) dies. A SIGKILL of redis-server alone loses nothing
    under either setting: its writes are in the OS page cache."""

    def __init__(self, data_dir: Path):
        super().__init__(daemon=True)
        self.dir = data_dir
        self.sizes: list[tuple[float, Path, int]] = []
        self.running = True

    def incr_file(self) -> Path | None:
        files = sorted((self.dir / "appendonlydir").glob("*.incr.aof"))
        return files[-1] if files else None

    def run(self) -> None:
        while self.running:
            f = self.incr_file()
            if f is not None:
                self.sizes.append((time.monotonic(), f, f.stat().st_size))
                del self.sizes[:-100]
            time.sleep(0.05)

    def cut_last(self, seconds: float) -> int:
        """Truncate the incremental file to its size `seconds` ago; the bytes cut."""
        f = self.incr_file()
        assert f is not None
        cutoff = time.monotonic() - seconds
        older = [size for t, path, size in self.sizes if t <= cutoff and path == f]
        keep = older[-1] if older else 0
        cut = f.stat().st_size - keep
        with open(f, "r+b") as fh:
            fh.truncate(keep)
        return cut


async def _state(redis, keys: Keys) -> dict:
    """Where the pipeline stands (printed when a run stalls)."""
    return {"counters": await counters(redis, keys), "queue": await redis.zcard(keys.queue),
            "stream": await redis.xlen(keys.groups), "requeue": await redis.llen(keys.requeue),
            "workers": await redis.zcard(keys.workers),
            "groups_info": await redis.xinfo_groups(keys.groups)}


async def _snapshot(redis, keys: Keys) -> dict:
    """What a restart must keep: the stream's entries, the counters, the trainer's pending ids."""
    counts = await counters(redis, keys)
    # group ids (the `id` field), so that an entry acknowledged (XDEL) by a save in between is told apart
    entries = [f.get(b"id", sid).decode() for sid, f in await redis.xrange(keys.groups)] if await redis.exists(keys.groups) else []
    return {"entries": entries, "counters": counts}


@pytest.mark.parametrize("fsync,cut_s", [
    ("always", 0.0),
    ("everysec", 0.0),
    pytest.param("everysec", LOST_S, id="everysec-lost-second"),
])
async def test_redis_sigkilled_and_restarted_from_its_aof_three_times(fsync, cut_s, namespace, tmp_path):
    from producers.enqueue import ProducerOptions, run_producer

    rng = random.Random(13)
    keys = Keys(namespace)
    task_ids = write_tasks(tmp_path / "tasks.jsonl", namespace, TASKS)
    sim = dict(token_latency_s=0.004, latency_sigma=0.5, length_sigma=0.5)
    (tmp_path / "redis").mkdir()
    server = LocalRedis(appendonly=True, appendfsync=fsync, data_dir=str(tmp_path / "redis")).start()
    redis = connect(server.url)
    tail = AofTail(tmp_path / "redis")
    tail.start()
    kills: list[dict] = []
    try:
        async with sim_run(redis, keys, server.url, tmp_path, sim=sim, batch=BATCH, n=N, eta=ETA, max_response_tokens=128,
                           concurrency=4, dead_after_s=3.0, poll_delay_s=0.05, max_tries=6) as run:
            epoch0 = set(task_ids)
            saved: list[str] = []  # group ids of the steps whose save() returned

            def after_step(rid: int) -> None:
                saved.extend(trainer.trained_groups[len(saved):])

            # done once epoch 0 is trained AND every kill happened: a trainer that outpaces the kill
            # cycle (an idle machine: each kill, copy and restart spans ~6 of its 20 steps) trains on
            # into epoch 1 instead of ending the run before the third kill
            trainer = Trainer(server.url, namespace, batch=BATCH, n=N, eta=ETA, max_steps=3 * TASKS // BATCH,
                              done=lambda t: epoch0 <= t.trained_tasks(0) and len(kills) >= KILLS, after_step=after_step,
                              wait_timeout_s=25.0 if cut_s else 60.0)
            trainer.start()
            run.producer = asyncio.create_task(run_producer(
                parse_config(run.data), tmp_path / "tasks.jsonl", follow=True, stop_event=run.stop, epochs=2,
                options=ProducerOptions(max_requeues=3),
            ))
            while trainer.is_alive() and trainer.steps < 2:  # a few steps in: a lost second is a suffix
                await asyncio.sleep(0.1)
            while trainer.is_alive() and len(kills) < KILLS:
                await asyncio.sleep(rng.uniform(0.6, 1.0))
                if not trainer.is_alive():
                    break
                before = await _snapshot(redis, keys)
                acked_before = list(saved)
                server.stop(kill=True)  # SIGKILL: no shutdown, no last fsync
                killed_at = time.monotonic()
                aof_bytes_cut = tail.cut_last(cut_s) if cut_s else 0
                # what survived, read from a copy of the AOF before any client reconnects
                copy = tmp_path / f"copy{len(kills)}"
                shutil.copytree(tmp_path / "redis", copy, ignore=shutil.ignore_patterns("redis.log"))
                with LocalRedis(appendonly=True, data_dir=str(copy)) as survivor:
                    probe = connect(survivor.url)
                    after = await _snapshot(probe, keys)
                    await probe.aclose()
                await asyncio.sleep(max(0.0, DOWN_S - (time.monotonic() - killed_at)))
                server.start()  # same port, same AOF
                kills.append({
                    "at_step": trainer.steps, "down_s": round(time.monotonic() - killed_at, 2),
                    "aof_bytes_cut": aof_bytes_cut,
                    "entries_lost": len(set(before["entries"]) - set(after["entries"]) - set(trainer.trained_groups)),
                    # only what the snapshot had and the AOF did not: writes between the
                    # snapshot and the kill show up as negative moves and are not losses
                    "counter_moves_lost": {k: v - after["counters"].get(k, 0) for k, v in before["counters"].items()
                                           if v > after["counters"].get(k, 0) and k != Counter.RUNNING},
                    "acked_groups_before": len(acked_before),
                    # acknowledged before the kill, back in the stream after it (must stay acknowledged)
                    "acked_back": sorted(set(acked_before) & set(after["entries"])),
                })
            await asyncio.to_thread(trainer.join, 150)
            if trainer.error is not None or trainer.is_alive():
                print("\nCHAOS redis AOF stalled:", json.dumps({
                    "kills": kills, "trained": len(trainer.trained_groups),
                    "trained_epoch0": len(trainer.trained_tasks(0)),
                    "trained_twice": sum(c > 1 for c in Tally(trainer.trained()).values()),
                    "state": await _state(redis, keys)}, default=str))
            trainer.join_and_check(1)
            run.stop.set()
            stats = await asyncio.wait_for(run.producer, 60)  # raises if the producer crashed
            crashed = [w.proc.returncode for w in run.workers if w.proc.poll() is not None]
        counts = await counters(redis, keys)
        dead = await redis.xlen(keys.dead) if await redis.exists(keys.dead) else 0
        ready, pending = await GroupBuffer(redis, keys).depth()
    finally:
        tail.running = False
        await redis.aclose()
        server.close()

    lost, duplicates = trainer.lost_and_duplicates(task_ids)
    report = {
        "appendfsync": fsync, "tasks": TASKS, "steps": trainer.steps, "groups_trained": len(trainer.trained_groups),
        "kills": kills, "lost": len(lost), "duplicates": len(duplicates), "processes_crashed": len(crashed),
        "producer": {"admitted": stats.admitted, "requeued": stats.requeued},
        "duplicate_pushes_refused": counts.get(Counter.DUPLICATES, 0),
        "jobs_failed": counts.get(Counter.FAILED, 0), "dead_letters": dead,
        "enqueued": counts.get(Counter.ENQUEUED, 0), "buffered": counts.get(Counter.BUFFERED, 0),
        "accepted": counts.get(Counter.ACCEPTED, 0), "ready": ready, "pending": pending,
    }
    print(f"\nCHAOS redis AOF ({fsync}) report:", json.dumps(report))
    assert len(kills) == KILLS, report
    assert crashed == [], report
    assert lost == [] and duplicates == {}, report
    assert len(trainer.trained_groups) == len(set(trainer.trained_groups)), report
    if not cut_s:  # a SIGKILLed redis-server loses no acknowledged write (always or everysec)
        assert all(k["entries_lost"] == 0 and not k["counter_moves_lost"] for k in kills), report
        assert all(k["acked_back"] == [] for k in kills), report  # an acknowledged step stays acknowledged
        # the counters equal the truth: every group the trainer got was counted accepted once, and
        # every group buffered was trained, discarded, or is still in the stream (ready, or read
        # and held by the due-first reader: pending)
        discarded = counts.get(Counter.STALE, 0) + counts.get(Counter.FILTERED, 0)
        assert counts.get(Counter.ACCEPTED, 0) == len(trainer.trained_groups), report
        assert counts.get(Counter.BUFFERED, 0) == len(trainer.trained_groups) + discarded + ready + pending, report
