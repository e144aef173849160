"""Shared pieces of the tests of the slime data source (`pipeline.slime.data_source.RedisDataSource`) on a
real redis-server: the args namespace slime's parser would hand it, and the sync wrappers that
push groups into the buffer and read the counters. pipeline.slime.data_source itself is not imported here
(the slime conformance tests import their own copy after slime)."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from pipeline.keys import Keys
from pipeline.schema import SampleGroup
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import connect


def source_args(redis_url: str, ns: str, *, eta: int, batch: int = 2, n: int = 4,
                ledger_dir: Optional[str | Path] = None, **extra: Any) -> Namespace:
    """slime's args as the data source reads them: the pipeline's flags (`eta`, a 0.2 s wait log,
    `ledger_dir` when given) and the batch shape (`batch` groups of `n`); `extra` adds any
    attribute or overrides one by its full name (`pipeline_eta=...`)."""
    base: dict[str, Any] = dict(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=batch, n_samples_per_prompt=n,
        pipeline_eta=eta, pipeline_wait_log_s=0.2,
    )
    if ledger_dir is not None:
        base["pipeline_ledger_dir"] = str(ledger_dir)
    base.update(extra)
    return Namespace(**base)


def push_groups(redis_url: str, ns: str, groups: Iterable[SampleGroup]) -> None:
    """Push `groups` into the namespace's buffer, as workers do."""
    async def go() -> None:
        client = connect(redis_url)
        buf = GroupBuffer(client, Keys(ns))
        await buf.ensure_group()
        for g in groups:
            await buf.push(g)
        await client.aclose()

    asyncio.run(go())


def read_counters(redis_url: str, ns: str) -> dict[str, int]:
    """The namespace's counters hash."""
    async def go() -> dict[str, int]:
        client = connect(redis_url)
        raw = await client.hgetall(Keys(ns).counters)
        await client.aclose()
        return {k.decode(): int(v) for k, v in raw.items()}

    return asyncio.run(go())
