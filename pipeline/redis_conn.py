"""Redis connections: one place that builds clients and keeps passwords out of text."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
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


def connect(url: str, *, retries: int = 20) -> aioredis.Redis:
    """An asyncio client that reconnects across a Redis restart (bounded backoff, ~30 s)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url {redact(url)!r}: scheme must be redis://, rediss:// or unix://")
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        health_check_interval=15,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
