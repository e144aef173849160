"""`rollout smoke`: push synthetic groups through the buffer into the slime data source.

Checks an install in seconds without GPUs, engines or slime: a private redis-server
(or --redis-url), synthetic contract-valid groups pushed the way workers push them,
then `pipeline.slime.data_source.generate_rollout` pulling whole batches as slime would.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from types import SimpleNamespace

from pipeline.keys import Keys
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.store.buffer import GroupBuffer
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect, redact
from pipeline.synthetic import make_group


async def push_groups(url: str, keys: Keys, *, steps: int, batch: int, n: int, response_len: int) -> float:
    """Push steps * batch groups; returns seconds spent."""
    redis = connect(url)
    try:
        buffer = GroupBuffer(redis, keys)
        await buffer.ensure_group()
        started = time.perf_counter()
        for i in range(steps * batch):
            group = make_group(f"smoke{i}:0", n=n, response_len=response_len, seed=i, admission_version=i // batch)
            await buffer.push(group)
        return time.perf_counter() - started
    finally:
        await redis.aclose()


def pull_steps(url: str, keys: Keys, *, steps: int, batch: int, n: int) -> tuple[float, int]:
    """Run generate_rollout for `steps` steps, saving after each; returns (seconds, samples)."""
    args = SimpleNamespace(
        pipeline_redis_url=url, pipeline_namespace=keys.ns, rollout_batch_size=batch, n_samples_per_prompt=n,
        pipeline_eta=steps, pipeline_wait_timeout_s=30.0,
    )
    source = RedisDataSource(args)
    samples = 0
    started = time.perf_counter()
    try:
        for rollout_id in range(steps):
            out = generate_rollout(args, rollout_id, source)
            if len(out.samples) != batch or any(len(g) != n for g in out.samples):
                raise RuntimeError(f"step {rollout_id}: got {len(out.samples)} groups, expected {batch} of {n}")
            samples += sum(len(g) for g in out.samples)
            source.save(rollout_id)
        return time.perf_counter() - started, samples
    finally:
        source.close()


def run(url: str, *, steps: int, batch: int, n: int, response_len: int) -> None:
    keys = Keys(f"smoke-{uuid.uuid4().hex[:8]}")
    push_s = asyncio.run(push_groups(url, keys, steps=steps, batch=batch, n=n, response_len=response_len))
    pull_s, samples = pull_steps(url, keys, steps=steps, batch=batch, n=n)
    groups = steps * batch
    print(f"redis          {redact(url)} (namespace {keys.ns})")
    print(f"pushed         {groups} groups x {n} samples x {response_len} response tokens "
          f"in {push_s:.2f}s ({groups / push_s:,.0f} groups/s)")
    print(f"trained on     {steps} steps x {batch} groups = {samples} samples "
          f"in {pull_s:.2f}s ({groups / pull_s:,.0f} groups/s)")
    print("smoke ok: every step got whole, contiguous groups and was acknowledged")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout smoke", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting a private redis-server")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="groups per step")
    p.add_argument("--n", type=int, default=4, help="samples per group")
    p.add_argument("--response-len", type=int, default=512)
    args = p.parse_args(argv)
    sizes = dict(steps=args.steps, batch=args.batch, n=args.n, response_len=args.response_len)
    if args.redis_url:
        run(args.redis_url, **sizes)
        return 0
    try:
        with LocalRedis() as server:
            run(server.url, **sizes)
    except FileNotFoundError as exc:
        print(f"rollout smoke: {exc}; or pass --redis-url", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
