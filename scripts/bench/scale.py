"""`rollout bench --sections scale`: what a cluster's size costs Redis (issue 26).

Liveness (scale_liveness.py): W simulated workers (the real `workers.liveness.Liveness`) heart-beat
against one private redis-server; measured: the server's CPU per interval and a PING's p99 beside
them, and how the CPU grows with W. Goal: exponent <= 1.3, and at W = 500 below 10% of one core
with PING p99 < 5 ms.

Poll (scale_poll.py): what W idle workers' queue polls cost Redis beside their heartbeats.

Memory (scale_memory.py): used_memory per 1,000 groups pushed through the buffer and taken by the
trainer side, by key family, and one arq result as the workers store it and as arq's default would.

This module runs the three as the section, each on a private redis-server of its own.
"""

from __future__ import annotations

from pipeline.store.local_redis import LocalRedis
from scripts.bench.report import Figure
from scripts.bench.scale_liveness import _idle, _liveness_run, bench_liveness
from scripts.bench.scale_memory import BATCH, FILTERED, STALE, WORKER_DEAD, bench_memory
from scripts.bench.scale_poll import bench_poll

# what the tests reach through this module
__all__ = ["BATCH", "FILTERED", "STALE", "WORKER_DEAD", "_idle", "_liveness_run", "bench_liveness", "bench_memory",
           "bench_poll", "bench_scale"]


def bench_scale(url: str, *, quick: bool) -> list[Figure]:
    """The section: liveness, then the poll beside it, each on a private redis-server of its own
    (clean CPU accounting), memory next."""
    with LocalRedis() as server:
        figures = bench_liveness(server.url, quick=quick)
    with LocalRedis() as server:
        figures += bench_poll(server.url, quick=quick)
    with LocalRedis() as server:
        figures += bench_memory(server.url, quick=quick)
    return figures
