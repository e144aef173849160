"""`rollout bench --sections scale` (scripts/bench/scale.py) on tiny sizes: it runs, and what it
counts holds (issue 26 item 2): a heartbeat's Redis commands do not grow with W, and the keys
the buffer and trainer path leave without a TTL do not grow with the groups pushed."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.store.local_redis import LocalRedis
from scripts.bench import scale as bench_scale


def test_liveness_commands_per_heartbeat_do_not_grow_with_workers():
    with LocalRedis() as server:
        idle_cpu, _p99 = asyncio.run(bench_scale._idle(server.url, 0.2))
        small = asyncio.run(bench_scale._liveness_run(server.url, 8, 1, idle_cpu))
        large = asyncio.run(bench_scale._liveness_run(server.url, 128, 1, idle_cpu))
    assert small["beats"] >= 8 and large["beats"] >= 128
    assert small["pings"] > 0 and large["p99_ms"] > 0
    # the beat, the own job set, and the cluster's one sweep (<= ~800 commands) shared by all beats:
    # every worker walking every job set was W SMEMBERS a beat (128 here)
    assert large["commands_per_beat"] < 25, large


def test_the_poll_bench_runs_the_real_pollers_and_counts_their_commands():
    """W real RolloutWorker pollers with free slots beside J jobs in progress: the jobs in progress
    are looked at once per recheck interval by the cluster (EXISTS), not by every poll of every
    worker, which arq 0.28's poll (the baseline row) does."""
    with LocalRedis() as server:
        figures = bench_scale.bench_poll(server.url, quick=True, worker_counts=(2, 4), jobs_in_progress=(0, 60),
                                         windows_s=(1.0, 1.5))
    details = figures[0].details
    table, arq = details["table"], details["arq_0_28_poll"]
    assert set(table) == {2, 4} and set(table[4]) == {0, 60}
    # each job looked at most twice in the window (shorter than both intervals): once by a claim's
    # recheck (every IN_PROGRESS_RECHECK_S, 5 s) and once by the cluster's orphan sweep (every
    # heartbeat, 5 s); both passes fall in one 1.5 s window now and then (a CI run saw 70/s)
    assert table[4][60]["exists_per_s"] <= 2 * 60 / 1.5 + 1, table
    assert arq["exists_per_s"] > 10 * max(table[2][60]["exists_per_s"], 1.0), (arq, table[2])
    assert figures[2].baseline_value > figures[2].value  # commands per worker: arq's poll above


# Families without a TTL that grow by design, each up to its cap: the dead letters
# (ROLLOUT_DEAD_MAXLEN), the monitor's recent summaries and the trainer's trained ids.
CAPPED = ("{ns}:dead", "{ns}:recent", "{ns}:trained")


def _untimed_bytes(url: str, groups: int) -> dict[str, int]:
    figures = bench_scale.bench_memory(url, quick=True, groups=groups)
    families = figures[0].details["after_consumption"]["families"]
    trained_markers = groups + groups // bench_scale.BATCH * (bench_scale.FILTERED + bench_scale.STALE
                                                              + bench_scale.WORKER_DEAD)
    assert families["{ns}:dedup:*"]["keys"] == trained_markers and families["{ns}:dedup:*"]["ttl_s"] > 0
    assert figures[1].value < 300 < figures[1].baseline_value  # the arq result without the job's arguments
    return {name: round(row["bytes_per_1000_groups"] * groups / 1000) for name, row in families.items()
            if row["ttl_s"] < 0 and name not in CAPPED}


# ~1 s alone; 65-85 s in two full runs under pytest-xdist at load 8-13: every step hands off between
# this thread and two loop threads (LoopThread, the data source's), and each wake-up waits for a core
@pytest.mark.timeout(300)
def test_keys_without_a_ttl_do_not_grow_with_the_groups_through_every_ending():
    """MEMORY USAGE per key family (not key counts: a hash that keeps a field per task is one key)
    after groups ended every way: trained (some a handed-back task's), dropped by the filter, stale
    (dead-lettered), dead-lettered by a worker, re-run after a reap, eval jobs. 3x the groups: the
    same bytes (a few for counters' longer numbers). `rollout bench --sections scale` runs 100,000."""
    with LocalRedis() as server:
        few = _untimed_bytes(server.url, 2 * bench_scale.BATCH)
        many = _untimed_bytes(server.url, 6 * bench_scale.BATCH)
    assert set(few) == set(many), (few, many)
    grown = {name: many[name] - few[name] for name in few if many[name] - few[name] > 32}
    assert not grown, (grown, few, many)
