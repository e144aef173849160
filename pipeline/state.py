"""Shared pipeline state in Redis: counters, policy version, engine URL, trainer settings."""

from __future__ import annotations

from typing import Any, Mapping

import msgspec
import redis.asyncio as aioredis

from pipeline.keys import Keys
from pipeline.redis_conn import new_op_id, run_once


class TrainerInfo(msgspec.Struct, kw_only=True):
    """What the slime side publishes in `{ns}:trainer` so producers can check their settings."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    eta: int


class PipelineState:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis = redis
        self.keys = keys

    # counters -----------------------------------------------------------
    async def incr(self, *, op_id: str | None = None, **deltas: int) -> None:
        """Apply the counter deltas once (`op_id`, default one per call), whatever replies are lost."""
        if not deltas:
            return

        def stage(pipe: Any) -> None:
            for name, delta in deltas.items():
                pipe.hincrby(self.keys.counters, name, delta)

        await run_once(self.redis, self.keys.op(op_id or new_op_id()), stage)

    async def counters(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.counters)
        return {k.decode(): int(v) for k, v in raw.items()}

    # policy version -------------------------------------------------------
    async def get_version(self) -> int:
        raw = await self.redis.get(self.keys.version)
        return int(raw) if raw is not None else 0

    async def set_version(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        await self.redis.set(self.keys.version, int(version))

    # engine URL -------------------------------------------------------------
    async def get_engine(self) -> str | None:
        raw = await self.redis.get(self.keys.engine)
        return raw.decode() if raw is not None else None

    async def set_engine(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url {url!r} must start with http:// or https://")
        await self.redis.set(self.keys.engine, url)

    # trainer settings ---------------------------------------------------------
    async def set_trainer_info(self, info: TrainerInfo) -> None:
        mapping: Mapping[str, int] = msgspec.structs.asdict(info)
        await self.redis.hset(self.keys.trainer, mapping=mapping)

    async def get_trainer_info(self) -> TrainerInfo | None:
        raw = await self.redis.hgetall(self.keys.trainer)
        if not raw:
            return None
        values = {k.decode(): int(v) for k, v in raw.items()}
        return msgspec.convert(values, TrainerInfo)
