"""Shared fixtures: a private redis-server per test session, a fresh namespace per test."""

from __future__ import annotations

import os
import uuid

import pytest

from pipeline.keys import Keys
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The chaos set (~5 min on 2 cores) runs when asked for: `-m chaos` (any -m expression), or
    a chaos test file or node named on the command line. The default run leaves it out, which
    keeps it under ten minutes; .ci/run runs both."""
    asked = config.option.markexpr or any("chaos" in str(arg) for arg in config.args)
    if asked:
        return
    chaos = [item for item in items if item.get_closest_marker("chaos")]
    if chaos:
        config.hook.pytest_deselected(items=chaos)
        items[:] = [item for item in items if not item.get_closest_marker("chaos")]


# .ci/run: the README's run (a fresh venv, no conformance extra) lists the tests it skipped here, and
# CI runs exactly those again with the extras installed and required, not the whole suite twice.
SKIPPED_TESTS_LOG_ENV = "CI_SKIPPED_TESTS_LOG"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    log = os.environ.get(SKIPPED_TESTS_LOG_ENV)
    if log and report.skipped and not hasattr(report, "wasxfail"):
        with open(log, "a", encoding="utf-8") as out:
            out.write(report.nodeid + "\n")
