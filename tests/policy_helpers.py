"""Tests that run real workers without a slime-side trainer must stand in for its first
rollout: workers stamp every generate call with the policy version the trainer publishes
and wait until one is published (pipeline/state.py `PolicyClock`)."""

from __future__ import annotations

from pipeline.keys import Keys
from pipeline.state import PipelineState


async def trainer_started(redis, keys: Keys, version: int = 0) -> int:
    """What `RedisDataSource` + its first `generate_rollout` publish; returns the run number."""
    state = PipelineState(redis, keys)
    run = await state.begin_run()
    await state.publish_policy(run=run, start=version, engine_version=version, rollout_id=version)
    return run
