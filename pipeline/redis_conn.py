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
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import EqualJitterBackoff
from redis.exceptions import AuthenticationError, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ENV_REDIS_URL = "ROLLOUT_REDIS_URL"


def redact(url: str) -> str:
    """`rediss://user:secret@host:6380/0` -> `rediss://user:***@host:6380/0`."""
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
    url: str, *, outage_s: float | None = None, retries: int | None = None, socket_timeout_s: float = SOCKET_TIMEOUT_S
) -> aioredis.Redis:
    """An asyncio client that rides out a Redis restart of up to `outage_s` seconds
    (default `$ROLLOUT_REDIS_OUTAGE_S`, 30 s), then raises `RedisUnavailable`.
    `retries` (older callers, e.g. the monitor's quick look) = a budget of `retries` seconds."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url {redact(url)!r}: scheme must be redis://, rediss:// or unix://")
    if outage_s is None:
        outage_s = float(retries) if retries is not None else outage_budget_s()
    budget = outage_s
    pool = RetryingConnectionPool.from_url(
        url,
        decode_responses=False,
        health_check_interval=15,
        socket_keepalive=True,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout_s,
        retry=OutageRetry(budget, redact(url)),
        retry_on_error=list(RETRY_ERRORS),
    )
    return aioredis.Redis.from_pool(pool)


class RetryingConnectionPool(aioredis.ConnectionPool):
    """A pool whose `get_connection` (which reconnects a dead pooled connection, outside any
    command's retry in redis-py 5.x; a handshake cut or refused there raised at once) retries
    under the client's outage budget."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        retry = self.connection_kwargs.get("retry")
        get = super().get_connection
        if not isinstance(retry, OutageRetry):
            return await get(*args, **kwargs)

        async def nothing(_error: Any) -> None:
            return None

        return await retry.call_with_retry(lambda: get(*args, **kwargs), nothing)


def make_pool_retrying(client: aioredis.Redis) -> None:
    """Give a client built elsewhere (arq's) the retrying `get_connection`."""
    pool = client.connection_pool
    if type(pool) is aioredis.ConnectionPool:
        pool.__class__ = RetryingConnectionPool


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
    `new_op_id()`, or a natural id such as a stream id).
    """
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
