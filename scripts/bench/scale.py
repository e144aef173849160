"""`rollout bench --sections scale`: what a cluster's size costs Redis (issue 26).

Liveness: W simulated workers (the real `workers.liveness.Liveness`, many per process: this
machine has 2 cores) with J = 32 recorded jobs each heart-beat against one private
redis-server. Each W runs a few heartbeat intervals, the workers' beats spread over each
interval as real workers' are; measured: the server's CPU time per interval (INFO cpu, the
server process's own accounting, less its idle rate measured beside the pinger alone), and the
p99 latency of a plain PING issued every 2 ms by a separate process beside them. The interval
is compressed to HEARTBEAT_S (1 s) so the run is short; the share of a Redis core is then
quoted at the default heartbeat (`workers.heartbeat_s` 5 s). Growth exponent: the slope of
log(CPU per interval) against log(W), least squares over the W's medians.
Goal: exponent <= 1.3, and at W = 500 below 10% of one core with PING p99 < 5 ms.

Memory: GROUPS groups pushed through the buffer (`GroupBuffer.push`) and taken by the trainer
side (`RedisDataSource.get_samples`, `save` each step: the real data source path), batch 64.
used_memory per 1,000 groups, while running (half-way, a step's groups in the stream) and after
consumption, broken down by key family (MEMORY USAGE over SCAN, by prefix), with each family's
TTL. Next to it, one arq result as the workers now store it and as arq's default would.

The parts: scale_liveness.py, scale_poll.py, scale_memory.py; this module runs them as the section.
"""

from __future__ import annotations

from pipeline.local_redis import LocalRedis
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
