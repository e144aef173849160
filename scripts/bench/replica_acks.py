"""What `redis.min_replica_acks` costs a write: push latency with 0 and 1 replica acks.

    python -m scripts.bench.replica_acks [--pushes 400] [--n 4] [--response-len 256] [--writers 1,8]

A private redis-server primary and one replica (`REPLICAOF`) on loopback; `GroupBuffer.push` of
synthetic groups (n samples of 64 + response_len tokens), `writers` at a time (one: the latency
of one push; eight: a worker process's pushes coalescing), against the same primary, with the
client's `min_replica_acks` 0 and 1 in turn. Prints p50/p99 per push and pushes/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from pipeline.keys import Keys
from pipeline.store.buffer import GroupBuffer
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group


async def _replicate(replica: LocalRedis, primary: LocalRedis) -> None:
    client = connect(replica.url)
    try:
        await client.execute_command("REPLICAOF", "127.0.0.1", primary.port)
        while (await client.info("replication")).get("master_link_status") != "up":
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def _pushes(url: str, acks: int, *, pushes: int, writers: int, n: int, response_len: int) -> dict[str, float]:
    client = connect(url, min_replica_acks=acks)
    keys = Keys(f"bench-acks-{uuid.uuid4().hex[:8]}")
    buffer = GroupBuffer(client, keys)
    await buffer.ensure_group()
    groups = [make_group(f"{keys.ns}-t{i}:0", n=n, response_len=response_len, seed=i) for i in range(pushes)]
    gate = asyncio.Semaphore(writers)
    latencies: list[float] = []

    async def push(group) -> None:  # type: ignore[no-untyped-def]
        async with gate:
            started = time.perf_counter()
            await buffer.push(group)
            latencies.append(time.perf_counter() - started)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(push(g) for g in groups))
        wall = time.perf_counter() - started
    finally:
        await client.aclose()
    latencies.sort()
    return {"p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
            "pushes_per_s": pushes / wall}


async def main_async(args: argparse.Namespace) -> None:
    with LocalRedis() as primary, LocalRedis() as replica:
        await _replicate(replica, primary)
        print(f"push latency, GroupBuffer.push, n={args.n} x {64 + args.response_len} tokens, {args.pushes} pushes, "
              "primary + 1 replica on loopback")
        print(f"{'writers':>7} {'min_replica_acks':>16} {'p50 ms':>8} {'p99 ms':>8} {'pushes/s':>9}")
        for writers in args.writers:
            for acks in (0, 1, 0, 1):  # twice, alternating: the first round warms up
                r = await _pushes(primary.url, acks, pushes=args.pushes, writers=writers, n=args.n,
                                  response_len=args.response_len)
                print(f"{writers:>7} {acks:>16} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['pushes_per_s']:>9.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench_replica_acks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=400)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--writers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
