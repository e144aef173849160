"""Redis connections: one place that builds clients and keeps passwords out of text.

Two rules every client of the pipeline lives by:

- **Outage budget.** A command that meets a dead connection, a refused connect, or a read
  timeout is retried with jittered backoff until Redis has been unreachable for
  `ROLLOUT_REDIS_OUTAGE_S` seconds (default 30; `connect(outage_s=...)`), then raises
  `RedisUnavailable` with one clear line. The budget covers reconnecting a pooled connection
  (redis-py reconnects in `ConnectionPool.get_connection`, outside `execute_command`'s retry,
  and does not retry a refused connect by itself) and is shared by all connections of one
  client, so nested retries never multiply it. Sockets have connect and read timeouts, so a
  half-open connection fails over instead of hanging a process forever.
- **Writes are safe to repeat.** A retry after a lost reply replays a command the server may
  already have executed. A plain MULTI/EXEC pipeline replays all of it; a WATCHed one raises
  WatchError instead. So every non-idempotent write of the pipeline is either a script keyed by
  an operation id, or a transaction run by `run_once`: WATCH an operation key, apply the writes
  and SET the key in one MULTI/EXEC, and on any WatchError look again: if the key is there the
  writes were applied (the reply was lost), else apply them now.

Two more for a primary that fails over (Redis Sentinel):

- **Sentinel addresses.** Wherever a Redis URL is accepted, `redis+sentinel://[user:pw@]host:26379,
  host2:26379/<service>/<db>` (`rediss+sentinel://` for TLS) asks the sentinels for the service's
  primary before each connect. A failover is then an outage like a restart: the commands in
  flight fail, are retried under the outage budget, and reconnect to the primary the sentinels
  name; the exactly-once rules above make the retries safe.
- **Writes that wait for replicas.** With `min_replica_acks` n > 0 (the URL's
  `?min_replica_acks=n`, else `$ROLLOUT_REDIS_MIN_REPLICA_ACKS`), a write that must not vanish
  in a failover (every `run_once`, a group's push, the trainer's ack, the admission scripts) is
  confirmed by `confirm_replicated`: WAIT until n replicas hold it, and if the primary answering
  no longer has it (a failover lost it before a replica got it), apply it again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis as redis_sync
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.exceptions import AuthenticationError, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel as SyncSentinel

log = logging.getLogger(__name__)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ENV_REDIS_URL = "ROLLOUT_REDIS_URL"
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379


def redact(url: str) -> str:
    """`rediss://user:secret@host:6380/0` -> `rediss://user:***@host:6380/0`."""
    if url.split("://", 1)[0].lower() in SENTINEL_SCHEMES:  # several hosts: urlsplit's port parsing fails
        return re.sub(r"^([^:]+://[^:@/]*):[^@/]*@", r"\1:***@", url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^@/]*@", "//***@", url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redis_url_from_env(default: str = DEFAULT_REDIS_URL) -> str:
    return os.environ.get(ENV_REDIS_URL, default)


ENV_OUTAGE_S = "ROLLOUT_REDIS_OUTAGE_S"
DEFAULT_OUTAGE_S = 30.0  # how long a Redis restart or network cut may last before a process gives up
CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 30.0  # read timeout; longer than any BLOCK the pipeline uses (1 s)
OP_TTL_S = 3600  # how long an operation key remembers that its writes were applied

RETRY_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class RedisUnavailable(RedisConnectionError):
    """Redis stayed unreachable past the outage budget (one clear line for the operator)."""


class ReplicaAckTimeout(RedisUnavailable):
    """A write stayed unconfirmed by `min_replica_acks` replicas for the whole outage budget."""


ENV_MIN_REPLICA_ACKS = "ROLLOUT_REDIS_MIN_REPLICA_ACKS"
DEFAULT_REPLICA_ACK_TIMEOUT_MS = 1000  # one WAIT; a writer waits out several within the outage budget
ACK_QUERY = ("min_replica_acks", "replica_ack_timeout_ms")
REPLICA_BARRIER_CHANNEL = "rollout:replica-barrier"  # a PUBLISH here moves the writer's replication offset


@dataclass(frozen=True)
class ReplicaAcks:
    """WAIT for `replicas` replicas after a write that must not vanish in a failover (0 = never)."""

    replicas: int = 0
    timeout_ms: int = DEFAULT_REPLICA_ACK_TIMEOUT_MS


@dataclass(frozen=True)
class RedisTarget:
    """A Redis URL taken apart: a plain one (`url`, for redis-py's from_url) or Sentinel addresses
    and a service name; and the replica acks its writes wait for."""

    url: str  # the URL without the replica-ack query (plain targets: what from_url gets)
    acks: ReplicaAcks
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)


def parse_redis_url(url: str, *, min_replica_acks: int | None = None) -> RedisTarget:
    """`redis://`, `rediss://`, `unix://` or `redis+sentinel://h:26379,h2:26379/service/db`, each
    with an optional `?min_replica_acks=n&replica_ack_timeout_ms=t`. ValueError naming what is wrong.
    Replica acks: `min_replica_acks` > the URL's query > `$ROLLOUT_REDIS_MIN_REPLICA_ACKS` > 0."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix", *SENTINEL_SCHEMES):
        raise ValueError(f"redis url {redact(url)!r}: scheme must be redis://, rediss://, unix:// or redis+sentinel://")
    base, _, query = url.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    own = {k: v for k, v in params if k in ACK_QUERY}
    rest = urlencode([(k, v) for k, v in params if k not in ACK_QUERY])
    plain = base + (f"?{rest}" if rest else "")
    acks = _replica_acks(url, own, min_replica_acks)
    if scheme not in SENTINEL_SCHEMES:
        return RedisTarget(url=plain, acks=acks)
    return _sentinel_target(url, base, scheme, plain, acks)


def with_replica_acks(url: str, replicas: int) -> str:
    """`url` with its `min_replica_acks` query set to `replicas` (every component reads it there)."""
    base, _, query = url.partition("?")
    params = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "min_replica_acks"]
    return f"{base}?{urlencode([*params, ('min_replica_acks', str(replicas))])}"


def _replica_acks(url: str, query: dict[str, str], explicit: int | None) -> ReplicaAcks:
    raw = {"min_replica_acks": os.environ.get(ENV_MIN_REPLICA_ACKS) or "0", **query}
    values: dict[str, int] = {}
    for name, text in raw.items():
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"redis url {redact(url)!r}: {name}={text!r} is not an integer") from None
        if values[name] < 0:
            raise ValueError(f"redis url {redact(url)!r}: {name}={text!r} must be >= 0")
    replicas = explicit if explicit is not None else values["min_replica_acks"]
    return ReplicaAcks(replicas, values.get("replica_ack_timeout_ms", DEFAULT_REPLICA_ACK_TIMEOUT_MS) or 1)


def _sentinel_target(url: str, base: str, scheme: str, plain: str, acks: ReplicaAcks) -> RedisTarget:
    rest = base.split("://", 1)[1]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h)
    service, _, db_text = path.partition("/")
    if not sentinels or not service:
        raise ValueError(f"redis url {redact(url)!r}: a Sentinel URL is "
                         "redis+sentinel://host:26379[,host2:26379...]/<service name>[/<db>]")
    try:
        db = int(db_text.strip("/") or 0)
    except ValueError:
        raise ValueError(f"redis url {redact(url)!r}: database {db_text!r} is not an integer") from None
    return RedisTarget(url=plain, acks=acks, sentinels=sentinels, service=unquote(service), db=db,
                       username=username, password=password, ssl=scheme == "rediss+sentinel")


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, str(DEFAULT_SENTINEL_PORT)
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"redis url {redact(url)!r}: sentinel address {text!r} has no valid port") from None


def outage_budget_s(default: float = DEFAULT_OUTAGE_S) -> float:
    raw = os.environ.get(ENV_OUTAGE_S)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_OUTAGE_S}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{ENV_OUTAGE_S}={raw!r} must be >= 0")
    return value


_RETRY_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("redis_retry_depth", default=0)


class _Outage:
    """When the current outage started (None: Redis answered last time); shared, never copied."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def __deepcopy__(self, memo: dict) -> _Outage:
        return self


class OutageRetry(Retry):
    """Retry on connection errors, refused connects and timeouts until the outage is older
    than `budget_s`, then raise `RedisUnavailable`.

    redis-py deep-copies the retry object into every connection and nests retries (connect
    inside a command's retry): the outage start is shared, so the budget is one wall-clock
    budget per client, not per call or per connection.
    """

    __slots__ = ("budget_s", "where", "_outage")

    def __init__(self, budget_s: float, where: str = "", *, cap_s: float = 1.0, base_s: float = 0.05):
        # redis.asyncio.retry.Retry annotates supported_errors as RedisError subclasses, but only
        # catches them (`except self._supported_errors`): OSError and asyncio.TimeoutError are fine
        super().__init__(EqualJitterBackoff(cap=cap_s, base=base_s), -1, supported_errors=RETRY_ERRORS)  # type: ignore[arg-type]
        self.budget_s = budget_s
        self.where = where
        self._outage = _Outage()

    def __deepcopy__(self, memo: dict) -> OutageRetry:
        clone = OutageRetry.__new__(OutageRetry)
        clone._backoff, clone._retries, clone._supported_errors = self._backoff, self._retries, self._supported_errors
        clone.budget_s, clone.where, clone._outage = self.budget_s, self.where, self._outage
        return clone

    def update_supported_errors(self, specified_errors: list) -> None:
        self._supported_errors = tuple(set(self._supported_errors + tuple(specified_errors)))

    def check(self, error: BaseException) -> None:
        """Note a failure; raise RedisUnavailable once the outage is older than the budget."""
        now = time.monotonic()
        if self._outage.since is None:
            self._outage.since = now
        elif now - self._outage.since >= self.budget_s:
            raise RedisUnavailable(
                f"redis {self.where or '?'} unreachable for {self.budget_s:.0f}s "
                f"(last error: {type(error).__name__}: {error}); the budget is ${ENV_OUTAGE_S}"
            ) from error

    def ok(self) -> None:
        self._outage.since = None

    async def call_with_retry(self, do: Callable[[], Awaitable[Any]], fail: Callable[[Any], Any]) -> Any:
        failures = 0
        depth = _RETRY_DEPTH.get()
        while True:
            token = _RETRY_DEPTH.set(depth + 1)
            cancels_before = _cancelling()
            try:
                result = await do()
            except (RedisUnavailable, AuthenticationError):
                raise  # out of budget already, or a wrong password: waiting out an outage fixes neither
            except self._supported_errors as error:
                if _cancelling() > cancels_before:
                    # a cancel that arrived during the call and came out as TimeoutError (asyncio.timeout
                    # does when both fire, Python 3.11): retrying would swallow it, and whoever
                    # cancelled waits forever. (A task that caught an earlier cancel and goes on, as
                    # arq's shutdown does, still retries its calls.)
                    raise asyncio.CancelledError() from error
                failures += 1
                await fail(error)  # may raise (WatchError while watching: the caller decides)
                self.check(error)
                await asyncio.sleep(self._backoff.compute(failures))
            else:
                # only a whole call ends an outage: a TCP connect that succeeds inside a command's
                # retry (its handshake may still be cut) must not restart the budget
                if depth == 0:
                    self.ok()
                if _cancelling() > cancels_before:
                    # a cancel that arrived during the call and was swallowed: redis-py sends with
                    # asyncio.wait_for(writer.drain(), socket_timeout), and before Python 3.12
                    # wait_for returns the inner result when a cancel meets a finished drain. The
                    # command ran; the caller was cancelled and hears so now, or it runs on (a
                    # producer told to stop admitted its whole epoch).
                    raise asyncio.CancelledError()
                return result
            finally:
                _RETRY_DEPTH.reset(token)


def _cancelling() -> int:
    """How many cancellations of the running task are pending (Task.cancelling, Python >= 3.11)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return int(cancelling()) if cancelling is not None else 0


def connect(
    url: str, *, outage_s: float | None = None, retries: int | None = None, socket_timeout_s: float = SOCKET_TIMEOUT_S,
    min_replica_acks: int | None = None,
) -> aioredis.Redis:
    """An asyncio client that rides out a Redis restart or a Sentinel failover of up to `outage_s`
    seconds (default `$ROLLOUT_REDIS_OUTAGE_S`, 30 s), then raises `RedisUnavailable`.
    `retries` (older callers, e.g. the monitor's quick look) = a budget of `retries` seconds.
    `min_replica_acks`: see `parse_redis_url` (the writes `confirm_replicated` waits for)."""
    target = parse_redis_url(url, min_replica_acks=min_replica_acks)
    if outage_s is None:
        outage_s = float(retries) if retries is not None else outage_budget_s()
    options: dict[str, Any] = dict(
        decode_responses=False,
        health_check_interval=15,
        socket_keepalive=True,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout_s,
        retry=OutageRetry(outage_s, redact(url)),
        retry_on_error=list(RETRY_ERRORS),
    )
    pool: aioredis.ConnectionPool
    if target.is_sentinel:
        pool = sentinel_pool(target, options)
    else:
        pool = RetryingConnectionPool.from_url(target.url, **options)
    set_replica_acks(pool, target.acks)
    return aioredis.Redis.from_pool(pool)


def sync_client(url: str, *, timeout_s: float) -> redis_sync.Redis:
    """A plain (blocking) client for a quick look, e.g. waiting for Redis before a worker starts;
    a Sentinel URL asks the sentinels for the primary. No outage budget: the caller loops."""
    target = parse_redis_url(url)
    timeouts = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    if not target.is_sentinel:
        return redis_sync.Redis.from_url(target.url, **timeouts)
    sentinel = SyncSentinel(list(target.sentinels), sentinel_kwargs=timeouts, **timeouts)
    client: redis_sync.Redis = sentinel.master_for(target.service, db=target.db, username=target.username,
                                                   password=target.password, ssl=target.ssl)
    return client


def sentinel_pool(target: RedisTarget, options: dict[str, Any]) -> aioredis.ConnectionPool:
    """A pool whose connections ask `target`'s sentinels for the service's primary at every
    connect (redis-py's SentinelConnectionPool) and retry that under the outage budget."""
    sentinel = Sentinel(
        list(target.sentinels),
        # the sentinels' own connections: short timeouts, so a dead sentinel is skipped quickly
        sentinel_kwargs={"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": CONNECT_TIMEOUT_S},
    )
    return RetryingSentinelConnectionPool(
        target.service, sentinel, is_master=True, check_connection=False,
        connection_class=FailoverSSLConnection if target.ssl else FailoverConnection, db=target.db, username=target.username, password=target.password, **options,
    )


def set_replica_acks(pool: aioredis.ConnectionPool, acks: ReplicaAcks) -> None:
    pool.replica_acks = acks  # type: ignore[attr-defined]  # read by confirm_replicated


def replica_acks(redis: aioredis.Redis) -> ReplicaAcks:
    return getattr(redis.connection_pool, "replica_acks", None) or ReplicaAcks()


class _RetryingGet:
    """`get_connection` (which reconnects a dead pooled connection, outside any command's retry in
    redis-py 5.x; a handshake cut or refused there raised at once) retried under the client's
    outage budget."""

    connection_kwargs: dict[str, Any]

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        retry = self.connection_kwargs.get("retry")
        get = super().get_connection  # type: ignore[misc]
        if not isinstance(retry, OutageRetry):
            return await get(*args, **kwargs)

        async def nothing(_error: Any) -> None:
            return None

        return await retry.call_with_retry(lambda: get(*args, **kwargs), nothing)


class FailoverConnection(SentinelManagedConnection):
    """A connection to the primary the sentinels name, tried once per address they give.

    redis-py retries the TCP connect inside the sentinels' lookup with the same retry object: under
    the outage budget that knocked at a dead primary's address for the whole budget and never
    asked the sentinels again. One try there; the outer retry asks them again each time."""

    async def connect_to(self, address: Any) -> None:
        outer, self.retry = self.retry, Retry(NoBackoff(), 0)
        try:
            await super().connect_to(address)
        finally:
            self.retry = outer


class FailoverSSLConnection(FailoverConnection, SSLConnection):
    pass


class RetryingConnectionPool(_RetryingGet, aioredis.ConnectionPool):
    """A plain pool with the retrying `get_connection`."""


class RetryingSentinelConnectionPool(_RetryingGet, SentinelConnectionPool):
    """A Sentinel pool with the retrying `get_connection`."""


def make_pool_retrying(client: aioredis.Redis) -> None:
    """Give a client built elsewhere (arq's) the retrying `get_connection`."""
    pool = client.connection_pool
    if type(pool) is aioredis.ConnectionPool:
        pool.__class__ = RetryingConnectionPool
    elif type(pool) is SentinelConnectionPool:
        pool.__class__ = RetryingSentinelConnectionPool
        ssl = issubclass(pool.connection_class, SSLConnection)
        pool.connection_class = FailoverSSLConnection if ssl else FailoverConnection
        for conn in [*pool._available_connections, *pool._in_use_connections]:
            conn.__class__ = FailoverSSLConnection if ssl else FailoverConnection


async def confirm_replicated(
    redis: aioredis.Redis, *, witness: str | None = None, redo: Callable[[Pipeline], None] | None = None
) -> bool:
    """After a write that must not vanish in a failover: wait until `min_replica_acks` replicas
    hold it. True when they do (or acks are off); False when the primary answering does not have
    `witness` (a key the write set): a failover lost the write, the caller applies it again.

    WAIT counts replicas that acknowledged the *connection's* last write, and the pool may hand
    this call another connection than the write's: a PUBLISH on a channel nobody reads goes
    first on the same connection, so WAIT covers the whole replication stream up to after the
    write. `redo` queues idempotent writes to repeat first (an ack has no witness: repeating it
    on the primary that answers makes WAIT cover it there). If WAIT times out (fewer replicas
    caught up), the writer waits on: it tries again until the outage budget is spent, then raises
    `ReplicaAckTimeout`; the write stays on the primary, unconfirmed.
    """
    acks = replica_acks(redis)
    if acks.replicas <= 0:
        return True
    started = time.monotonic()
    retry = redis.connection_pool.connection_kwargs.get("retry")
    budget_s = retry.budget_s if isinstance(retry, OutageRetry) else outage_budget_s()
    while True:
        pipe = redis.pipeline(transaction=False)
        if redo is not None:
            redo(pipe)
        pipe.publish(REPLICA_BARRIER_CHANNEL, b"")
        pipe.wait(acks.replicas, acks.timeout_ms)
        if witness is not None:
            pipe.exists(witness)
        replies = await pipe.execute()
        if witness is not None and not replies[-1]:
            log.warning("a write was lost by a failover (%s is not on the primary): applying it again", witness)
            return False
        acked = int(replies[-2] if witness is not None else replies[-1])
        if acked >= acks.replicas:
            return True
        waited = time.monotonic() - started
        if waited >= budget_s:
            raise ReplicaAckTimeout(
                f"a write was not confirmed by {acks.replicas} replica(s) in {waited:.0f}s ({acked} did; "
                f"the budget is ${ENV_OUTAGE_S}): check the replicas' links to the primary"
            )
        log.warning("%d of %d replica(s) confirmed a write after %.1fs; waiting on", acked, acks.replicas, waited)


def new_op_id() -> str:
    return uuid.uuid4().hex


T = TypeVar("T")
ALREADY = object()  # run_once: the writes were applied by an earlier attempt whose reply was lost
REFUSED = object()  # run_once: the guard refused the writes


async def run_once(
    redis: aioredis.Redis,
    op_key: str,
    stage: Callable[[Pipeline], None],
    *,
    watch: Iterable[str] = (),
    guard: Callable[[Pipeline], Awaitable[bool]] | None = None,
    ttl_s: int = OP_TTL_S,
) -> Any:
    """Apply the writes `stage(pipe)` queues exactly once, whatever replies are lost.

    WATCH `op_key` (and `watch`), and if it is absent: MULTI, the writes, SET op_key, EXEC.
    A connection lost while watching, or a watched key changed, raises WatchError: look
    again. Returns the EXEC replies (after the SET's, dropped), `ALREADY` when an earlier
    attempt applied them, or `REFUSED` when `guard(pipe)` (run between WATCH and MULTI,
    immediate commands) says no. `op_key` must name one logical operation (a fresh
    `new_op_id()`, or a natural id such as a stream id). With replica acks on, the writes are
    confirmed by `confirm_replicated` (witness `op_key`), and applied again if a failover lost them.
    """
    while True:
        result = await _apply_once(redis, op_key, stage, watch=watch, guard=guard, ttl_s=ttl_s)
        if result is REFUSED or await confirm_replicated(redis, witness=op_key):
            return result


async def _apply_once(
    redis: aioredis.Redis, op_key: str, stage: Callable[[Pipeline], None], *, watch: Iterable[str],
    guard: Callable[[Pipeline], Awaitable[bool]] | None, ttl_s: int,
) -> Any:
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(op_key, *watch)
                if await pipe.exists(op_key):
                    await pipe.unwatch()
                    return ALREADY
                if guard is not None and not await guard(pipe):
                    await pipe.unwatch()
                    return REFUSED
                pipe.multi()
                stage(pipe)
                pipe.set(op_key, b"1", ex=ttl_s)
                replies = await pipe.execute()
                return replies[:-1]
            except WatchError:
                await pipe.reset()
                continue
