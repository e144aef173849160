"""SGLang client: native `POST /generate`, token ids in, token ids + log-probs out.

Wire facts (PROTOCOLS.md): the body is `input_ids`, `sampling_params` (only the keys
the router forwards: `SamplingParams.to_dict()`), `return_logprob`, `rid` and
`routing_key`; the router also reads the `X-SMG-Routing-Key` header, which keeps
every turn of one episode on one engine's prefix cache. Output ids and log-probs
come from `meta_info.output_token_logprobs`; the text is for display only.

Failure policy:
- connection errors, 5xx/429 and a 200 whose body is not a /generate answer (garbage
  or truncated JSON, e.g. from a broken proxy): retried with jittered exponential
  backoff, bounded;
- 400: never retried. Context overflow -> `ContextOverflow` (the episode ends as
  truncated), anything else -> `BadRequest` (failed), both carrying the server's message;
- a request running past its timeout -> `EngineError` (failed) and a best-effort
  `/abort_request` so the engine stops spending slots on it.

One `aiohttp.ClientSession` per client; build one client per worker process.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Sequence, Union

import aiohttp
import msgspec

from pipeline.schema import SamplingParams
from pipeline.state import PipelineState

log = logging.getLogger(__name__)

ROUTING_HEADER = "X-SMG-Routing-Key"
AUTO = "auto"
_CONTEXT_OVERFLOW = re.compile(r"context|longer than|too long|exceed", re.IGNORECASE)
_MAX_BACKOFF_S = 10.0


class EngineError(RuntimeError):
    """The engine could not serve a request (after retries); the episode is failed."""


class BadRequest(EngineError):
    """HTTP 400 other than context overflow (e.g. bad sampling params): not retried."""


class ContextOverflow(EngineError):
    """HTTP 400: the input does not fit the context; the episode ends as truncated."""


# ---------------------------------------------------------------- response shape


class _FinishReason(msgspec.Struct):
    type: str
    message: Union[str, None] = None
    matched: Any = None
    length: Union[int, None] = None


class _MetaInfo(msgspec.Struct):
    finish_reason: Union[_FinishReason, None] = None
    output_token_logprobs: list[tuple[Union[float, None], int, Any]] = []
    weight_version: str = "default"
    prompt_tokens: Union[int, None] = None
    completion_tokens: Union[int, None] = None
    cached_tokens: Union[int, None] = None
    e2e_latency: Union[float, None] = None


class _GenerateResponse(msgspec.Struct):
    meta_info: _MetaInfo
    text: str = ""
    output_ids: Union[list[int], None] = None


_response_decoder = msgspec.json.Decoder(_GenerateResponse)
_json_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Generation:
    """One `/generate` answer."""

    output_ids: list[int]
    log_probs: list[float]
    finish: str  # "stop" | "length" | "abort"
    finish_message: str
    weight_version: str
    text: str
    cached_tokens: int
    latency_s: float


def parse_generation(body: bytes, latency_s: float) -> Generation:
    reply = _response_decoder.decode(body)
    meta = reply.meta_info
    pairs = meta.output_token_logprobs
    if pairs:
        ids = [tok for _lp, tok, _ in pairs]
        log_probs = [lp if lp is not None else 0.0 for lp, _tok, _ in pairs]
    else:  # no tokens, or an engine that omits log-probs on abort
        ids = list(reply.output_ids or [])
        if ids:
            raise EngineError(f"engine returned {len(ids)} output ids without output_token_logprobs")
        log_probs = []
    finish = meta.finish_reason
    return Generation(
        output_ids=ids,
        log_probs=log_probs,
        finish=finish.type if finish else "stop",
        finish_message=(finish.message or "") if finish else "",
        weight_version=str(meta.weight_version),
        text=reply.text,
        cached_tokens=meta.cached_tokens or 0,
        latency_s=latency_s,
    )


def _error_message(body: bytes) -> str:
    """The server's message from `{"error": {"message"}}`, `{"error": "..."}` or `{"message"}`."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode(errors="replace")[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err if "error" in data else data.get("message", data))[:500]
    return str(data)[:500]


# ---------------------------------------------------------------- engine URL


class EngineLocator:
    """The engine URL: fixed, or "auto" = `{ns}:engine` in Redis, re-read every `refresh_s`.

    A connection error calls `invalidate()` so the next attempt re-reads Redis at
    once: when the slime side moves its router, workers follow within one retry.
    """

    def __init__(self, url: str, state: PipelineState | None = None, *, refresh_s: float = 5.0):
        if url != AUTO and not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url {url!r} must be 'auto' or start with http:// or https://")
        if url == AUTO and state is None:
            raise ValueError("engine url 'auto' needs the pipeline's Redis state")
        self._fixed = None if url == AUTO else url.rstrip("/")
        self._state = state
        self._refresh_s = refresh_s
        self._cached: str | None = None
        self._read_at = 0.0

    async def get(self) -> str:
        if self._fixed is not None:
            return self._fixed
        if self._cached is None or time.monotonic() - self._read_at > self._refresh_s:
            assert self._state is not None
            url = await self._state.get_engine()
            if url is None:
                raise EngineError(f"engine url is 'auto' but {self._state.keys.engine} is not set in Redis")
            if url.rstrip("/") != self._cached:
                log.info("engine url is now %s", url)
            self._cached, self._read_at = url.rstrip("/"), time.monotonic()
        return self._cached

    def invalidate(self) -> None:
        self._read_at = 0.0


# ---------------------------------------------------------------- client


class EngineClient:
    def __init__(
        self,
        locator: EngineLocator | str,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_connections: int = 0,
    ):
        self.locator = EngineLocator(locator) if isinstance(locator, str) else locator
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._max_connections = max_connections  # 0 = unbounded; the engine's slots are the limit
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, rid: str, routing_key: str
    ) -> Generation:
        body = _json_encoder.encode(
            {
                "input_ids": input_ids,
                "sampling_params": sampling.to_dict(),
                "return_logprob": True,
                "rid": rid,
                "routing_key": routing_key,
            }
        )
        headers = {"Content-Type": "application/json", ROUTING_HEADER: routing_key}
        for attempt in range(self.max_retries + 1):
            failure = await self._attempt(body, headers, rid)
            if isinstance(failure, Generation):
                return failure
            if attempt == self.max_retries:
                raise EngineError(f"rid {rid}: gave up after {attempt + 1} attempts: {failure}")
            delay = min(_MAX_BACKOFF_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning("rid %s: %s; retry %d/%d in %.2fs", rid, failure, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(self, body: bytes, headers: dict[str, str], rid: str) -> Generation | str:
        """One request: a Generation, or a retryable failure's description; raises on final errors."""
        url = await self.locator.get()
        started = time.monotonic()
        try:
            async with self.session.post(
                f"{url}/generate", data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                payload = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            asyncio.create_task(self.abort(rid))
            raise EngineError(f"rid {rid}: no answer from {url} within {self.timeout_s}s") from None
        except aiohttp.ClientError as exc:
            self.locator.invalidate()
            return f"connection error to {url}: {exc.__class__.__name__}: {exc}"
        if status == 200:
            try:
                return parse_generation(payload, time.monotonic() - started)
            except msgspec.DecodeError as exc:  # garbage or truncated JSON from a proxy: transient, like a 502
                return f"undecodable /generate answer: {exc}"
        message = _error_message(payload)
        if status >= 500 or status == 429:
            return f"HTTP {status}: {message}"
        if status == 400 and _CONTEXT_OVERFLOW.search(message):
            raise ContextOverflow(f"rid {rid}: HTTP 400: {message}")
        if status == 400:
            raise BadRequest(f"rid {rid}: HTTP 400: {message}")
        raise EngineError(f"rid {rid}: HTTP {status}: {message}")

    async def abort(self, rid: str) -> None:
        """Best effort `/abort_request` for one rid (never raises)."""
        try:
            url = await self.locator.get()
            async with self.session.post(
                f"{url}/abort_request", json={"rid": rid, "abort_all": False}, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                await resp.read()
        except Exception as exc:  # noqa: BLE001 - best effort by design
            log.debug("abort of %s failed: %s", rid, exc)
