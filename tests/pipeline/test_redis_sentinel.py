"""Sentinel addresses and replica acks (`pipeline.store.redis_conn`), against a real primary, replica and
three sentinels on loopback (tests/support/sentinel_helpers.py). The whole run under failovers is
tests/chaos/test_chaos_sentinel.py (chaos set)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pipeline.config import ConfigError, RedisSection, load_config
from pipeline.store.redis_conn import (
    ReplicaAckTimeout,
    confirm_replicated,
    connect,
    parse_redis_url,
    redact,
    replica_acks,
    run_once,
)
from tests.support.sentinel_helpers import SentinelCluster

pytestmark = pytest.mark.timeout(120)


def test_a_sentinel_url_names_the_sentinels_the_service_the_database_and_the_replica_acks():
    target = parse_redis_url("redis+sentinel://u:s3cret@10.0.0.1:26379,[::1]:26380,h3/mymaster/2?min_replica_acks=1")
    assert target.sentinels == (("10.0.0.1", 26379), ("::1", 26380), ("h3", 26379))
    assert (target.service, target.db, target.username, target.password) == ("mymaster", 2, "u", "s3cret")
    assert target.acks.replicas == 1
    assert "s3cret" not in redact("redis+sentinel://u:s3cret@h1:1,h2:2/m/0")
    assert parse_redis_url("redis://h:6379/0?min_replica_acks=2&replica_ack_timeout_ms=50").url == "redis://h:6379/0"
    for bad, says in (("redis+sentinel://h1:1,h2:2", "service name"), ("redis+sentinel://h1:x/m", "port"),
                      ("redis://h/0?min_replica_acks=-1", ">= 0"), ("redis+sentinel://h1:1/m/zero", "database")):
        with pytest.raises(ValueError, match=says):
            parse_redis_url(bad)


def test_the_config_takes_a_sentinel_url_and_min_replica_acks_and_every_component_gets_them_in_the_url():
    url = "redis+sentinel://127.0.0.1:26379,127.0.0.2:26379/mymaster/0"
    section = RedisSection(url=url, min_replica_acks=1)
    assert parse_redis_url(section.resolved_url()).acks.replicas == 1
    config = load_config(None, {"redis.url": url}, environ={"ROLLOUT_REDIS_MIN_REPLICA_ACKS": "2"})
    assert parse_redis_url(config.redis.resolved_url()).acks.replicas == 2  # env > file > default
    with pytest.raises(ConfigError, match="ROLLOUT_REDIS_MIN_REPLICA_ACKS"):
        load_config(None, environ={"ROLLOUT_REDIS_MIN_REPLICA_ACKS": "one"})
    with pytest.raises(ConfigError, match="service name"):
        load_config(None, {"redis.url": "redis+sentinel://127.0.0.1:26379"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with SentinelCluster(tmp_path_factory.mktemp("sentinel")) as c:
        yield c


async def _get_from(port: int, key: str) -> bytes | None:
    """GET straight from one data node (not through the sentinels)."""
    node = connect(f"redis://127.0.0.1:{port}/0", outage_s=1)
    try:
        return await node.get(key)
    finally:
        await node.aclose()


async def test_clients_follow_a_failover_to_the_replica_through_the_sentinels(cluster, caplog):
    """The pipeline's client and arq's pool (the workers') built from a redis+sentinel:// URL: a
    SIGKILLed primary is an outage they ride out, and they carry on against the promoted replica.
    A write the replica never got (its link cut before it) is on the old primary only when the
    kill comes, its writer still waiting for the replica: the promoted primary lacks it, the
    writer is told so (`confirm_replicated` -> False) and applies it again."""
    from arq.connections import create_pool

    from pipeline.store.jobqueue import fit_arq_pool, redis_settings

    url = cluster.url(min_replica_acks=1)
    redis = connect(url, outage_s=30)
    arq = await create_pool(redis_settings(url, outage_s=30))
    fit_arq_pool(arq, url)
    try:
        await run_once(redis, "sentinel-test:op1", lambda pipe: pipe.set("sentinel-test:k", b"1"))
        old = cluster.primary()
        cluster.cut_replication(cluster.replica_of(old))
        unconfirmed = asyncio.create_task(
            run_once(redis, "sentinel-test:op-lost", lambda pipe: pipe.set("sentinel-test:lost", b"1")))
        while await _get_from(old.port, "sentinel-test:lost") is None:
            await asyncio.sleep(0.02)  # its EXEC is on the primary, not on the replica
        cluster.kill_primary()
        started = time.monotonic()
        # in flight during the failover: retried until the sentinels name the new primary
        assert await redis.get("sentinel-test:k") == b"1"  # confirmed by the replica before the kill
        assert await arq.get("sentinel-test:k") == b"1"
        new = cluster.primary()
        assert new is not old and time.monotonic() - started < 30
        cluster.mend_replication(new)
        assert not unconfirmed.done()  # no replica has it: its writer waits
        cluster.restart_as_replica(old)
        cluster.wait_synced()
        await asyncio.wait_for(unconfirmed, 30)
        assert "a write was lost by a failover" in caplog.text  # the promoted primary lacked it
        assert await _get_from(new.port, "sentinel-test:lost") == b"1"  # applied again
        await run_once(redis, "sentinel-test:op2", lambda pipe: pipe.set("sentinel-test:k2", b"2"))
        assert await arq.get("sentinel-test:k2") == b"2"
    finally:
        await redis.aclose()
        await arq.aclose()


async def test_a_write_no_replica_confirms_waits_out_the_budget_then_raises_and_one_confirmed_late_returns(cluster):
    """min_replica_acks 1 and the replica frozen (SIGSTOP): the writer waits, WAIT after WAIT;
    past the outage budget it raises ReplicaAckTimeout (the write stays on the primary). Thawed
    within the budget, the write returns once the replica has it."""
    cluster.wait_synced()
    replica = cluster.replica_of(cluster.primary())
    redis = connect(cluster.url(min_replica_acks=1) + "&replica_ack_timeout_ms=200", outage_s=1.5)
    assert replica_acks(redis).replicas == 1
    try:
        os.kill(replica.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ReplicaAckTimeout, match="1 replica"):
            await run_once(redis, "sentinel-test:op3", lambda pipe: pipe.set("sentinel-test:k3", b"3"))
        assert time.monotonic() - started >= 1.5
        assert await redis.get("sentinel-test:k3") == b"3"  # on the primary, unconfirmed


        async def thaw() -> None:
            await asyncio.sleep(0.6)
            os.kill(replica.proc.pid, signal.SIGCONT)

        thawing = asyncio.create_task(thaw())
        await run_once(redis, "sentinel-test:op4", lambda pipe: pipe.set("sentinel-test:k4", b"4"))
        await thawing
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
        await redis.aclose()


async def test_a_confirmation_on_another_connection_than_the_write_still_waits_for_it():
    """WAIT counts the replicas that acknowledged the *connection's* last write, and the pool may
    confirm on another connection than the write's: on one with no write of its own WAIT counts a
    frozen replica at once. The PUBLISH barrier makes it wait for the stream up to the write."""
    from pipeline.store.local_redis import LocalRedis

    with LocalRedis() as primary, LocalRedis() as replica:
        writer, other = connect(primary.url), connect(primary.url + "?min_replica_acks=1&replica_ack_timeout_ms=200",
                                                       outage_s=0.5)
        follower = connect(replica.url)
        try:
            await follower.execute_command("REPLICAOF", "127.0.0.1", primary.port)
            while (await follower.info("replication")).get("master_link_status") != "up":
                await asyncio.sleep(0.05)
            await other.ping()
            os.kill(replica.proc.pid, signal.SIGSTOP)
            await writer.set("barrier-test:k", b"1")
            with pytest.raises(ReplicaAckTimeout):
                await confirm_replicated(other)
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
            for client in (writer, other, follower):
                await client.aclose()
