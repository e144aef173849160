"""Shared fixtures: a private redis-server per test session, a fresh namespace per test."""

from __future__ import annotations

import uuid

import pytest

from pipeline.keys import Keys
from pipeline.local_redis import LocalRedis
from pipeline.redis_conn import connect


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port (never the shared 6379)."""
    server = LocalRedis().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def keys(namespace: str) -> Keys:
    return Keys(namespace)


@pytest.fixture
async def redis(redis_url: str):
    client = connect(redis_url)
    yield client
    await client.aclose()
