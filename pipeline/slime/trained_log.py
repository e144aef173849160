"""The staleness of what was trained recently, as the trainer saw it (issue 27).

The monitor's "recent" figures come from the groups pushed lately, seen from today's policy
version: a group trained 25 steps ago counts as 25 stale though it was trained at lag 0. The
data source (pipeline/slime/data_source.py) records here, per step, the lag of every group at the step
that trained it; the monitor reads the last steps back (`{ns}:trained`, newest first, capped).
"""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as aioredis

from pipeline.keys import Keys

KEEP_STEPS = 100  # steps kept in `{ns}:trained`
SHOWN_STEPS = 10  # steps the monitor's "trained" histogram covers


class TrainedStep(msgspec.Struct, array_like=True, kw_only=True):
    rollout_id: int
    at: float  # unix seconds
    staleness: list[int]  # per group: rollout id - its oldest token's policy version


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TrainedStep)


async def record_step(redis: aioredis.Redis, keys: Keys, rollout_id: int, staleness: list[int]) -> None:
    """Note one step's groups (a replayed step is noted again: readers keep its newest entry)."""
    step = TrainedStep(rollout_id=rollout_id, at=time.time(), staleness=list(staleness))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.lpush(keys.trained, _encoder.encode(step))
        pipe.ltrim(keys.trained, 0, KEEP_STEPS - 1)
        await pipe.execute()


async def recent_steps(redis: aioredis.Redis, keys: Keys, steps: int = SHOWN_STEPS) -> list[TrainedStep]:
    """The last `steps` distinct steps trained, newest first (a foreign or corrupt entry is skipped)."""
    out: dict[int, TrainedStep] = {}
    for raw in await redis.lrange(keys.trained, 0, 2 * steps - 1):  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        try:
            step = _decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        out.setdefault(step.rollout_id, step)
        if len(out) == steps:
            break
    return list(out.values())
