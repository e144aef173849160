"""Tests that run real workers without a slime-side trainer must stand in for its first
rollout: workers stamp every generate call with the policy version the trainer publishes
and wait until one is published (pipeline/state.py `PolicyClock`)."""

from __future__ import annotations

from typing import Any

from pipeline.keys import Keys
from pipeline.state import PipelineState


async def trainer_started(redis, keys: Keys, version: int = 0) -> int:
    """What `RedisDataSource` + its first `generate_rollout` publish; returns the run number."""
    state = PipelineState(redis, keys)
    run = await state.begin_run()
    await state.publish_policy(run=run, start=version, engine_version=version, rollout_id=version)
    return run


def calc_config(redis_url: str, ns: str, *, engine: str, eta: int, batch: int, n: int,
                max_response_tokens: int, concurrency: int) -> dict[str, Any]:
    """A pipeline config for the calculator tasks these tests write, through `engine` (a router's URL,
    or "auto"); the sizes are each test's own."""
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": n, "rollout_batch_size": batch, "eta": eta,
                    "max_response_tokens": max_response_tokens},
        "environments": {"calc": {"kind": "calculator"}},
        "workers": {"concurrency": concurrency, "heartbeat_s": 0.5, "dead_after_s": 5.0, "poll_delay_s": 0.02},
    }
