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
    """arq's connection with the pipeline's reconnect policy (`pipeline.redis_conn`): retried
    across a Redis restart of up to the outage budget, socket timeouts set. arq's own writes
    replayed after a lost reply are safe: finishing a job is SET/DELETE/ZREM; taking a job is
    one script (`workers.settings._CLAIM_LUA`: a replay takes other jobs, and those whose reply
    was lost are in progress with no owner, which `workers.liveness` releases as orphans); a
    replayed INCR of the retry counter can skip one try number (the job's tries are bounded
    either way)."""
    from pipeline.redis_conn import CONNECT_TIMEOUT_S, RETRY_ERRORS, OutageRetry, outage_budget_s, redact

    settings = RedisSettings.from_dsn(url)
    settings.conn_timeout = int(CONNECT_TIMEOUT_S)
    settings.conn_retries = 0  # the first ping already retries for the whole outage budget
    settings.retry_on_timeout = True
    settings.retry_on_error = list(RETRY_ERRORS)
    settings.retry = OutageRetry(outage_budget_s() if outage_s is None else outage_s, redact(url))
    return settings


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
