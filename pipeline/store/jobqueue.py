"""The arq side of prompt jobs, shared by producers (enqueue) and workers (run): no pickle.

arq stores a job as `{'t': try, 'f': function, 'a': args, 'k': kwargs, 'et': ms}` and a
result as the same plus `'r'` (the return value or the exception), `'s'` (success) and
timings. Both are msgpack here. The job's single argument is the msgpack `PromptJob`
bytes, decoded inside the job function, so a poison payload reaches our code and
goes to the dead-letter stream instead of failing inside arq.

Exceptions in results are encoded by `enc_hook` as `{"__exception__": name, "message"}`
and rebuilt on decode (`asyncio.CancelledError` as itself, so `Job.abort()` works;
others as `RemoteJobError`). This module imports nothing heavy: producers use it.
"""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import msgspec
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.jobs import serialize_job

from pipeline.keys import Keys
from pipeline.schema import PromptJob, encode

JOB_EXPIRES_MS = 7 * 24 * 3600 * 1000  # a queued job must outlive any wait for headroom
JOB_FUNCTION = "run_group"  # the arq function workers register (workers/settings.py)
_EXC = "__exception__"


class RemoteJobError(RuntimeError):
    """An exception a job raised in a worker, rebuilt from its name and message."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, BaseException):
        return {_EXC: type(obj).__name__, "message": str(obj)[:2000]}
    raise TypeError(f"cannot encode {type(obj).__name__} in an arq job or result")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder()


def job_serializer(obj: dict[str, Any]) -> bytes:
    return _encoder.encode(obj)


def job_envelope(job: PromptJob, *, enqueue_time_ms: int) -> bytes:
    """The bytes arq's `enqueue_job(JOB_FUNCTION, encode(job))` stores, with this serializer."""
    return serialize_job(JOB_FUNCTION, (encode(job),), {}, None, enqueue_time_ms, serializer=job_serializer)


def job_deserializer(data: bytes) -> dict[str, Any]:
    obj = _decoder.decode(data)
    result = obj.get("r") if isinstance(obj, dict) else None
    if isinstance(result, dict) and _EXC in result:
        obj["r"] = _rebuild_exception(result[_EXC], str(result.get("message", "")))
    return obj


def _rebuild_exception(name: str, message: str) -> BaseException:
    if name == "CancelledError":
        return asyncio.CancelledError(message)
    return RemoteJobError(name, message)


def redis_settings(url: str, *, outage_s: float | None = None) -> RedisSettings:
    """arq's connection with the pipeline's reconnect policy (`pipeline.store.redis_conn`): retried
    across a Redis restart of up to the outage budget, socket timeouts set. arq's own writes
    replayed after a lost reply are safe: finishing a job is SET/DELETE/ZREM; taking a job is
    one script (`workers.settings._CLAIM_LUA`: a replay takes other jobs, and those whose reply
    was lost are in progress with no owner, which `workers.liveness` releases as orphans); a
    replayed INCR of the retry counter can skip one try number (the job's tries are bounded
    either way).

    A `redis+sentinel://` URL gives arq's Sentinel mode (`RedisSettings(host=[sentinels],
    sentinel=True, sentinel_master=service)`). arq builds that pool with none of the settings
    above (arq 0.28 passes only ssl, db, username and password to `Sentinel`), and retries its
    first PING `conn_retries` times a second apart: that count is the outage budget here, and
    `fit_arq_pool` gives the pool the rest once it exists."""
    from pipeline.store.redis_conn import (
        CONNECT_TIMEOUT_S,
        RETRY_ERRORS,
        OutageRetry,
        outage_budget_s,
        parse_redis_url,
        redact,
    )

    budget_s = outage_budget_s() if outage_s is None else outage_s
    target = parse_redis_url(url)
    if target.is_sentinel:
        settings = RedisSettings(
            host=list(target.sentinels), sentinel=True, sentinel_master=target.service, database=target.db,
            username=target.username, password=target.password, ssl=target.ssl,
        )
        settings.conn_retries = max(1, math.ceil(budget_s))
    else:
        settings = RedisSettings.from_dsn(target.url)
        settings.conn_retries = 0  # the first ping already retries for the whole outage budget
    settings.conn_timeout = int(CONNECT_TIMEOUT_S)
    settings.retry_on_timeout = True
    settings.retry_on_error = list(RETRY_ERRORS)
    settings.retry = OutageRetry(budget_s, redact(url))
    return settings


def fit_arq_pool(client: Any, url: str) -> None:
    """Give the pool arq built the pipeline's policy (`redis_settings`): our read timeout (arq's
    RedisSettings has none), so a half-open connection fails over instead of hanging the worker;
    a `get_connection` that reconnects under the outage budget; and in Sentinel mode, where arq
    passes no retry, the outage retry itself. Open connections get the timeout too."""
    from pipeline.store.redis_conn import RETRY_ERRORS, SOCKET_TIMEOUT_S, OutageRetry, make_pool_retrying

    if client is None:
        return
    make_pool_retrying(client)
    pool = client.connection_pool
    pool.connection_kwargs["socket_timeout"] = SOCKET_TIMEOUT_S
    retry = pool.connection_kwargs.get("retry")
    if not isinstance(retry, OutageRetry):
        settings = redis_settings(url)
        retry = settings.retry
        pool.connection_kwargs.update(retry=retry, retry_on_error=list(RETRY_ERRORS),
                                      socket_connect_timeout=settings.conn_timeout)
    for conn in [*getattr(pool, "_available_connections", []), *getattr(pool, "_in_use_connections", [])]:
        conn.socket_timeout = SOCKET_TIMEOUT_S
        if not isinstance(conn.retry, OutageRetry):
            conn.retry = copy.deepcopy(retry)
            conn.retry.update_supported_errors(list(RETRY_ERRORS))


async def create_arq_pool(url: str, keys: Keys) -> ArqRedis:
    """An ArqRedis client with our serializer and `{ns}:queue` as its default queue."""
    return await create_pool(
        redis_settings(url),
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=keys.queue,
    )


async def enqueue_prompt_job(arq: ArqRedis, job: PromptJob, keys: Keys) -> bool:
    """Enqueue `job` under its deterministic arq id (`keys.arq_job_id`); False when arq already
    has that id (live or result kept)."""
    arq_id = keys.arq_job_id(job.job_id)
    handle = await arq.enqueue_job(JOB_FUNCTION, encode(job), _job_id=arq_id, _queue_name=keys.queue)
    return handle is not None
