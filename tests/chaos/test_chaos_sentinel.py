"""A Redis primary SIGKILLed twice under a run of processes; Sentinel fails over to the replica.

Real parts: two redis-servers (primary + replica) and three sentinels (`redis-server --sentinel`)
on loopback (tests/support/sentinel_helpers.py, failure detected after 1 s), the simulated SGLang engine
over HTTP, a worker pool (`rollout workers --processes 2`), the producer (`rollout enqueue`) and
the trainer (tests/support/chaos_trainer.py, the ledger on), shaped like tests/chaos/test_chaos_run.py and
reusing its `Run`. Every process is given only the `redis+sentinel://` URL. Twice, at a random
point of a step, the primary gets SIGKILL; nobody is told; once the sentinels name the promoted
replica, the dead node is started again (empty) as its replica, as an operator would.

With `?min_replica_acks=1` the oracle is strict: the ledger says 0 lost, 0 trained twice, and
the counters equal it. Without acks, the same run counts what each failover lost: the counters
and stream entries read from the primary just before the kill, against what the promoted
replica has (docs/reliability.md "Redis Sentinel failover").

On loopback the replica is not behind at a kill, so those two runs cannot tell acks on from off.
The third test makes it fall behind (its link cut 1 s before the kill) under one writer of
groups: acks 0 lose every push that returned in that second, acks 1 none, and with one replica
the writes wait after the failover until the dead node is back and synced.

Run alone: `python -m pytest tests/chaos/test_chaos_sentinel.py -s -p no:warnings` (prints the reports).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

import pytest

from pipeline.keys import Counter, Keys
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import ReplicaAckTimeout, connect
from pipeline.synthetic import make_group
from tests.chaos.test_chaos_run import Run, assert_exactly_once
from tests.support.chaos_helpers import counters
from tests.support.sentinel_helpers import SentinelCluster

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

SIM = {"token_latency_s": 0.004, "latency_sigma": 0.3, "length_sigma": 1.0, "slots": 64}
TRACKED = (Counter.ENQUEUED, Counter.BUFFERED, Counter.ACCEPTED)


async def _snapshot(port: int, keys: Keys) -> dict:
    """Counters and stream ids straight from one node (the primary about to be killed)."""
    node = connect(f"redis://127.0.0.1:{port}/0", outage_s=1)
    try:
        counts = await counters(node, keys)
        ids = [sid.decode() for sid, _ in await node.xrange(keys.groups)]
        last = (await node.xinfo_stream(keys.groups))["last-generated-id"].decode() if await node.exists(keys.groups) else "0-0"
    finally:
        await node.aclose()
    return {"counters": counts, "ids": ids, "last": last}


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _lost(before: dict, after: dict) -> dict:
    """What the primary had just before its kill and the promoted replica never got: stream entries
    added after the replica's last one (entries acknowledged since are gone from both, legitimately),
    and counter moves (counters only grow: behind on the replica = lost)."""
    return {
        "entries": sum(_id(i) > _id(after["last"]) for i in before["ids"]),
        **{f"{name}_moves": max(0, before["counters"].get(name, 0) - after["counters"].get(name, 0)) for name in TRACKED},
    }


async def _failover_run(namespace: str, tmp_path, *, acks: int) -> tuple[dict, list[dict], int]:
    from workers.sim.engine import SimConfig, serve_sim_engine
    from workers.sim.tokenizer import default_tokenizer_path

    rng = random.Random(33 + acks)
    keys = Keys(namespace)
    lost: list[dict] = []
    with SentinelCluster(tmp_path / "redis") as cluster:
        url = cluster.url(min_replica_acks=acks)
        redis = connect(url)
        sim = SimConfig(**SIM, tokenizer_path=default_tokenizer_path())
        async with serve_sim_engine(sim) as engine:
            run = Run(redis, url, keys, tmp_path, engine.url, tasks=48, max_response_tokens=256,
                      dead_after_s=3.0, max_tries=6)
            try:
                await run.start()
                for step in (2, 6):
                    await run.until_step(step)
                    await asyncio.to_thread(cluster.wait_synced)  # a failover needs a replica in sync
                    await asyncio.sleep(rng.uniform(0.0, 0.3))
                    old = cluster.primary()
                    before = await _snapshot(old.port, keys)
                    cluster.kill_primary()  # SIGKILL
                    run.note("primary SIGKILL", port=old.port)
                    new = await asyncio.to_thread(cluster.wait_failover, old)
                    run.faults[-1]["promoted_after_s"] = round(time.monotonic() - run.started - run.faults[-1]["t"], 1)
                    lost.append(_lost(before, await _snapshot(new.port, keys)))
                    await asyncio.to_thread(cluster.restart_as_replica, old)
                status, result = await run.conclude()
            finally:
                await run.stop()
                await redis.aclose()
    return result, lost, status


async def test_primary_sigkilled_twice_with_replica_acks_loses_nothing_and_counters_equal_the_ledger(namespace, tmp_path):
    result, lost, status = await _failover_run(namespace, tmp_path, acks=1)
    result["report"]["lost_per_failover"] = lost
    print("\nCHAOS sentinel failover (min_replica_acks 1) report:", json.dumps(result["report"]))
    assert status == 0, "trainer failed"
    assert len(result["report"]["faults"]) == 2
    assert_exactly_once(result)
    # nothing a writer was told had happened went missing with the dead primary
    for failover in lost:
        assert all(value == 0 for value in failover.values()), lost


async def test_primary_sigkilled_twice_without_replica_acks_measures_what_each_failover_lost(namespace, tmp_path):
    """No WAIT: a failover may lose the last writes the replica had not received (counted here
    and written in docs/reliability.md); the repairs made for a lost AOF second apply. The run
    must still end with every task trained once."""
    result, lost, status = await _failover_run(namespace, tmp_path, acks=0)
    report = result["report"]
    report["lost_per_failover"] = lost
    # what the counters lost over the whole run, failovers the sentinels started on their own included
    report["accepted_behind_ledger"] = report["groups_in_ledger"] - report["accepted"]
    print("\nCHAOS sentinel failover (min_replica_acks 0) report:", json.dumps(report))
    assert status == 0, "trainer failed"
    verdict = result["verdict"]
    assert verdict.lost == [] and verdict.twice == {} and verdict.in_two_steps == [], result["report"]


CUT_S = 1.0  # how long the replica is behind before the primary's kill
RESTART_AFTER_S = 2.0  # from the promotion to the dead node's restart (the operator's delay)


async def _pushes_across_a_failover(cluster: SentinelCluster, namespace: str, *, acks: int) -> dict:
    """One writer pushes groups (`GroupBuffer.push`, one at a time) through the sentinels; the
    replica's link is cut, CUT_S later the primary is SIGKILLed, the sentinels promote the replica
    that is behind, RESTART_AFTER_S later the dead node comes back empty as its replica. A second
    writer with a 1 s outage budget pushes once between the promotion and the restart. Returns
    what returned when, and which returned groups the promoted primary does not have."""
    keys = Keys(namespace)
    url = cluster.url(min_replica_acks=acks)
    client = connect(url, outage_s=30)
    buffer = GroupBuffer(client, keys)
    await buffer.ensure_group()
    returned: list[tuple[float, str]] = []
    done = asyncio.Event()

    async def writer() -> None:
        for i in itertools.count():
            if done.is_set():
                return
            group_id = f"{namespace}-t{i}:0"
            if await buffer.push(make_group(group_id, n=2, prompt_len=8, response_len=8, seed=i)) is not None:
                returned.append((time.monotonic(), group_id))

    await asyncio.to_thread(cluster.wait_synced)
    writing = asyncio.create_task(writer())
    t: dict[str, float] = {}
    probe = connect(url, outage_s=1.0)
    try:
        await asyncio.sleep(0.3)
        old = cluster.primary()
        t["cutting"] = time.monotonic()
        await asyncio.to_thread(cluster.cut_replication, cluster.replica_of(old))
        t["cut"] = time.monotonic()  # the link is down: what returns from here on is not on the replica
        await asyncio.sleep(CUT_S)
        t["kill"] = time.monotonic()  # (pushes the old primary answered until its death return after it)
        await asyncio.to_thread(cluster.kill_primary)
        new = await asyncio.to_thread(cluster.wait_failover, old)
        t["promoted"] = time.monotonic()
        await asyncio.to_thread(cluster.mend_replication, new)
        started = time.monotonic()
        try:
            await GroupBuffer(probe, keys).push(make_group(f"{namespace}-probe:0", n=2, prompt_len=8, response_len=8))
            probe_outcome = "returned"
        except ReplicaAckTimeout:
            probe_outcome = "ReplicaAckTimeout"
        probe_s = time.monotonic() - started
        await asyncio.sleep(max(0.0, t["promoted"] + RESTART_AFTER_S - time.monotonic()))
        t["restarted"] = time.monotonic()
        await asyncio.to_thread(cluster.restart_as_replica, old)
        await asyncio.to_thread(cluster.wait_synced)
        t["synced"] = time.monotonic()
        deadline = time.monotonic() + 10
        while not any(at > t["synced"] for at, _ in returned) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        done.set()
        await writing
        present = {fields[b"id"].decode() for _, fields in await client.xrange(keys.groups)}
    finally:
        done.set()
        writing.cancel()
        await probe.aclose()
        await client.aclose()

    def between(start: str | None, end: str | None) -> set[str]:
        lo, hi = t[start] if start else 0.0, t[end] if end else float("inf")
        return {g for at, g in returned if lo <= at < hi}

    lost = {g for _, g in returned} - present
    windows = ("cutting", "cut", "kill", "promoted", "restarted", "synced")
    return {
        "acks": acks,
        "returned": {f"{a or 'start'} to {b or 'end'}": len(between(a, b))
                     for a, b in zip((None, *windows), (*windows, None))},
        "lost": len(lost),
        "lost_before_the_cut": len(lost & between(None, "cutting")),
        "not_lost_after_the_link_went_down": len(between("cut", "kill") - lost),
        "first_return_after_kill_s": round(min((at for at, _ in returned if at > t["kill"]), default=-1.0) - t["kill"], 2),
        "promoted_after_kill_s": round(t["promoted"] - t["kill"], 2),
        "synced_after_restart_s": round(t["synced"] - t["restarted"], 2),
        "probe": probe_outcome, "probe_s": round(probe_s, 2),
    }


async def test_a_failover_to_a_replica_that_fell_behind_loses_returned_writes_without_acks_and_none_with(
        namespace, tmp_path):
    """Issue 39 items 8 and 9: the replica's link cut CUT_S before the primary's SIGKILL, so the
    promoted replica lacks the last second of writes. With acks 0 the pushes that returned in it
    are lost; with acks 1 none returned in it (each waits for a replica), none is lost, and writes
    wait until the dead node is back and synced: a writer whose budget runs out first raises
    ReplicaAckTimeout (docs/operations.md, docs/reliability.md)."""
    runs = []
    with SentinelCluster(tmp_path / "redis") as cluster:
        for acks in (0, 1):
            runs.append(await _pushes_across_a_failover(cluster, f"{namespace}-acks{acks}", acks=acks))
    print("\nCHAOS replica behind at the failover:", json.dumps(runs))
    off, on = runs
    # acks off: every push that returned after the link went down is gone, nothing else is
    assert off["lost"] > 0 and off["not_lost_after_the_link_went_down"] == 0, off
    assert off["lost_before_the_cut"] == 0 and off["probe"] == "returned", off
    # acks on: nothing lost; from the cut until the restarted node took the stream no push returned
    assert on["lost"] == 0 and on["returned"]["synced to end"] > 0, on
    assert on["returned"]["kill to promoted"] == on["returned"]["promoted to restarted"] == 0, on
    assert on["returned"]["cut to kill"] <= 1, on  # (one confirmed as the link went down)
    assert on["probe"] == "ReplicaAckTimeout" and on["probe_s"] >= 1.0, on
