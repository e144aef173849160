"""SGLang client: native `POST /generate`, token ids in, token ids + log-probs out.

Wire facts (SGLang 0.5.23's; docs/architecture.md "The engine"): the body is `input_ids`,
`sampling_params` (only the keys the router forwards: `SamplingParams.to_dict()`),
`return_logprob`, `rid` and `routing_key`; the router also reads the `X-SMG-Routing-Key`
header, which keeps every turn of one episode on one engine's prefix cache. Output ids and
log-probs come from `meta_info.output_token_logprobs`; the text is for display only.

Failure policy:
- connection errors, 5xx/429 and a 200 whose body is not a /generate answer (garbage
  or truncated JSON, e.g. from a broken proxy): retried with jittered exponential
  backoff, bounded;
- 400: never retried. Context overflow (SGLang's two messages, matched exactly) ->
  `ContextOverflow` (the episode ends as truncated), anything else -> `BadRequest`
  (failed), both carrying the server's message;
- a request running past its timeout -> `EngineError` (failed); a request cancelled while it
  runs (a soft deadline, `Job.abort`, a sibling episode's failure cancelling its group) ->
  the cancellation goes on. Both send a best-effort `/abort_request` for that attempt's rid to
  every engine (`EngineDirectory`), so the one that runs it frees its slot now instead of at
  SGLang's disconnect poll or the generation's end; the abort task is held until it has finished.

Engines behind a router: slime's router answers `/generate` itself but neither `/server_info`
nor `/abort_request` (404 `unknown_url`); its `/get_server_info` is one engine's answer on smg and
the router's own `{"router_manager": true, ...}` on sglang-router 0.3.2, so neither is read here.
`EngineDirectory` reads the router's `GET /workers` (what slime's own abort reads) for the engine
URLs; a URL that answers without such a list (SGLang's front: 404) is the engine itself. The
context limit is what each engine enforces, from its `/server_info` (`/get_server_info` where
that is absent): SGLang's scheduler refuses an input of `max_req_input_len` tokens or more, its
HTTP front an input + max_new_tokens over `context_length` (null in /server_info unless
`--context-length` was passed, as slime passes none); the client's limit is the smallest of
these over the engines. What is kept, for how long, and what makes it read again:
`EngineDirectory`'s doc (docs/architecture.md "The engine").

Due first in the engine's queue: a request may carry its group's place in the order groups come
due (`due_order`: its admission clock; smaller = due sooner; not its admission time, which smg
1.13.0 refuses with a 422: the router types `priority` as an i32). Where every engine says
`enable_priority_scheduling` in its /server_info (SGLang's --enable-priority-scheduling, slime's
--sglang-enable-priority-scheduling), the body carries it as SGLang's `priority`, oriented by
`schedule_low_priority_values_first` (default: larger values first, so -due_order), so a free slot
goes to the group due soonest, and a request resumed after a weight push's abort keeps its place
instead of queueing behind newer groups. Where any engine does not, no `priority` is sent: SGLang
ignores it there, or refuses the request with --abort-on-priority-when-disabled.

Every attempt has its own rid (`{rid}~{k}` for the k-th retry): SGLang keeps a rid
registered while its request lives, and for a few seconds after a client disconnect, and
answers a reused one with 400 "Duplicate request ID detected". Before each attempt the
client reads the policy stamp (`pipeline.state.PolicyClock`), so every answer says which
policy version its tokens are at least.

One `aiohttp.ClientSession` per client; build one client per worker process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Union

import aiohttp
import msgspec

from pipeline.schema import SamplingParams
from pipeline.state import PipelineState, PolicyClock, PolicyStamp

log = logging.getLogger(__name__)

ROUTING_HEADER = "X-SMG-Routing-Key"
AUTO = "auto"
# tokenizer_manager._validate_one_request: input too long, or input + max_new_tokens too long;
# managers/utils.validate_input_length (the scheduler): input at or over max_req_input_len
_CONTEXT_OVERFLOW = re.compile(
    r"^The input \(\d+ tokens\) is longer than the model's context length \(\d+ tokens\)\."
    r"|^Requested token count exceeds the model's maximum context length of \d+ tokens\."
    r"|^Input length \(\d+ tokens\) exceeds the maximum allowed length \(\d+ tokens\)\."
)
_WAIT_LOG_S = 10.0
_MAX_BACKOFF_S = 10.0
_ENGINES_REFRESH_S = 30.0  # re-read the router's engine list this often (and after a connection error)
_LIST_RETRY_S = 2.0  # after a failed read of the list, the last one stands this long
_FACTS_RETRY_S = 2.0  # after a failed /server_info read, no new read of that engine for this long
_CONTROL_TIMEOUT_S = 10.0
_ABORT_LIST_TRIES = 3  # an abort with no engine known reads the list again this often, 0.25 s apart
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1  # smg parses a body's `priority` as an i32


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


class _VersionSpan(msgspec.Struct):
    """SGLang's `meta_info.weight_versions` item: output tokens [start, end) ran on `version`
    (a request paused in place or retracted across a weight update has several)."""

    version: str
    start: int
    end: int


class _MetaInfo(msgspec.Struct):
    finish_reason: Union[_FinishReason, None] = None
    output_token_logprobs: list[tuple[Union[float, None], int, Any]] = []
    weight_version: str = "default"
    weight_versions: Union[list[_VersionSpan], None] = None
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
    weight_versions: tuple[str, ...] = ()  # every engine label the tokens ran on, oldest first
    # (label, start, end): output tokens [start, end) ran on that label; one span unless the request
    # lived through a weight update under SGLang's in_place / retract pause (`meta_info.weight_versions`)
    version_spans: tuple[tuple[str, int, int], ...] = ()
    policy: Union[PolicyStamp, None] = None  # read before the request: its tokens are at least this version


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
    spans = tuple((span.version, span.start, span.end) for span in meta.weight_versions or ())
    if spans:
        check_version_spans(spans, len(ids))
    return Generation(
        output_ids=ids,
        log_probs=log_probs,
        finish=finish.type if finish else "stop",
        finish_message=(finish.message or "") if finish else "",
        weight_version=str(meta.weight_version),
        text=reply.text,
        cached_tokens=meta.cached_tokens or 0,
        latency_s=latency_s,
        weight_versions=tuple(span.version for span in meta.weight_versions or ()) or (str(meta.weight_version),),
        version_spans=spans or ((str(meta.weight_version), 0, len(ids)),),
    )


class BadVersionSpans(EngineError):
    """`meta_info.weight_versions` that do not tile the answer's output tokens: the episode fails
    with this reason (a version per token cannot be trusted), it is not retried."""


def check_version_spans(spans: Sequence[tuple[str, int, int]], n_tokens: int) -> None:
    """Raises `BadVersionSpans` unless the spans tile output tokens [0, n_tokens) exactly: in
    order, each starting where the last ended, none empty, the last ending at n_tokens. SGLang
    (`compute_weight_version_spans`, `add_weight_versions_to_meta_info`) makes them so; the one
    empty span it sends is `[label, 0, 0]` alone, for an answer with no token."""
    if n_tokens == 0 and len(spans) == 1 and spans[0][1:] == (0, 0):
        return
    at = 0
    for index, (label, start, end) in enumerate(spans):
        if start != at:
            _bad_spans(spans, n_tokens, f"span {index} {[label, start, end]} starts at {start}, not {at}")
        if end <= start:
            _bad_spans(spans, n_tokens, f"span {index} {[label, start, end]} is empty or reversed")
        at = end
    if at != n_tokens:
        _bad_spans(spans, n_tokens, f"they end at token {at}")


def _bad_spans(spans: Sequence[tuple[str, int, int]], n_tokens: int, why: str) -> NoReturn:
    shown = [list(span) for span in spans[:8]] + (["..."] if len(spans) > 8 else [])
    raise BadVersionSpans(f"engine's weight-version spans {shown} do not tile its {n_tokens} output tokens: {why}")


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
            url = await self._wait_for_url()
            if url.rstrip("/") != self._cached:
                log.info("engine url is now %s", url)
            self._cached, self._read_at = url.rstrip("/"), time.monotonic()
        return self._cached

    async def _wait_for_url(self) -> str:
        """`{ns}:engine`, waiting (with a log line now and then) until the slime side publishes it."""
        assert self._state is not None
        logged_at = None
        while (url := await self._state.get_engine()) is None:
            if logged_at is None or time.monotonic() - logged_at >= _WAIT_LOG_S:
                logged_at = time.monotonic()
                log.info("engine url is 'auto': waiting for the trainer to publish %s", self._state.keys.engine)
            await asyncio.sleep(min(1.0, self._refresh_s))
        return url

    def invalidate(self) -> None:
        self._read_at = 0.0


# ---------------------------------------------------------------- engines behind the URL


def _engine_urls(listing: Any) -> list[str] | None:
    """The engine URLs of a router's `GET /workers` answer (smg and sglang-router:
    `{"workers": [{"url", "worker_type", ...}]}`), None when the answer is not such a list."""
    if not isinstance(listing, dict) or not isinstance(listing.get("workers"), list):
        return None
    urls = []
    for worker in listing["workers"]:
        if isinstance(worker, dict) and isinstance(worker.get("url"), str):
            if worker.get("worker_type", "regular") in ("regular", "decode"):  # prefill engines stop at the prompt
                urls.append(worker["url"].rstrip("/"))
    return sorted(set(urls))


def context_limit(info: Any) -> int | None:
    """The tokens input + max_new_tokens may reach on one engine, from its `/server_info`: the
    smaller of `context_length` (the HTTP front's check; null unless --context-length was given)
    and `max_req_input_len` (the scheduler refuses an input of that many tokens or more, and it is
    at least 6 below the model's context); None when the answer has neither."""
    if not isinstance(info, dict):
        return None
    found = [info.get(key) for key in ("context_length", "max_req_input_len")]
    limits = [int(v) for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(limits) if limits else None


def priority_order(info: Any) -> int | None:
    """How an engine orders `priority`, from its `/server_info`: -1 larger values first (SGLang's
    default), +1 lower values first (--schedule-low-priority-values-first), None when it does not
    schedule by priority (or does not say)."""
    if not isinstance(info, dict) or info.get("enable_priority_scheduling") is not True:
        return None
    return 1 if info.get("schedule_low_priority_values_first") is True else -1


@dataclass(frozen=True)
class EngineFacts:
    """What one engine's /server_info says that requests depend on."""

    limit: int | None = None  # context_limit
    priority_order: int | None = None  # priority_order


# `GET /workers` answers that say "no such list here, I am an engine" (SGLang's front: 404); any
# other failure (no answer, a timeout, 5xx, 429, a 200 that is not a worker list: a proxy's HTML
# error page) says nothing about what the URL is
_NOT_A_ROUTER = frozenset({400, 404, 405, 422})


class EngineDirectory:
    """The engines behind the URL and what each one's /server_info says (module doc).

    What it keeps, and when it reads again:
    - the engine list: the router's `GET /workers`, kept `refresh_s`, read again after that, after
      `invalidate()`, when the URL changes and while the list is empty; a URL that answers without
      such a list (SGLang's front: 404) is one engine. A read that fails (no answer, a timeout, a
      5xx, a 200 that is not a worker list) changes nothing: the last list stands, and the list is
      read again `_LIST_RETRY_S` later (or after `invalidate()`); with no list yet there is no
      engine to name ([]), never the router itself;
    - each engine's facts (`EngineFacts`): only from a /server_info that answered 200 with a JSON
      object, kept `refresh_s` (an engine restarted at the same URL may be another model, another
      --context-length), dropped when the engine leaves the list and by `invalidate()`. A failed
      read (no answer, a timeout, an error status, a body that is not a JSON object) is no fact:
      the last good facts, if any, stand, else none is made up; that engine is not read again for
      a backoff (`_FACTS_RETRY_S`, doubling per failure up to `refresh_s`; none after the first
      error status, since a restarting engine answers 503 and then its facts), so a /server_info that
      hangs (SGLang's waits on its scheduler) costs one `control_timeout_s` per backoff, not one
      per request.
    Concurrent callers share one read per URL (single flight): a worker starting `concurrency x n`
    episodes asks each engine once, not once per episode. A read under way when `invalidate()` is
    called is not joined by later callers, and its answer is not kept (it may describe the fleet
    before the change).
    """

    def __init__(self, client: EngineClient, *, refresh_s: float = _ENGINES_REFRESH_S):
        self._client = client
        self._refresh_s = refresh_s
        self._engines: list[str] = []
        self._for_url = ""
        self._read_at = 0.0
        self._facts: dict[str, tuple[EngineFacts, float]] = {}  # engine -> (facts, monotonic time read)
        self._failed: dict[str, tuple[int, float]] = {}  # engine -> (failed reads in a row, no read before)
        self._reads: dict[str, asyncio.Future[Any]] = {}  # reads under way, by URL and epoch (single flight)
        self._epoch = 0  # `invalidate()` count: a read keeps its answer only if none came since it started
        self._list_failed: tuple[str, int] | None = None  # (URL, epoch) of the last list read, if it failed
        self._list_retry_at = 0.0  # ... and when to read it again

    def invalidate(self) -> None:
        """Read the list and every engine's facts again at the next use (a connection error, an
        overflow: the fleet may have changed); reads under way then are neither joined nor kept."""
        self._epoch += 1
        self._read_at = 0.0
        self._facts.clear()
        self._failed.clear()

    def _fresh(self, read_at: float) -> bool:
        return time.monotonic() - read_at <= self._refresh_s

    async def _once(self, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
        """`read()`, or the same read already under way for `key` since the last `invalidate()`
        (a cancelled caller leaves it running for the others)."""
        key = f"{key}#{self._epoch}"
        pending = self._reads.get(key)
        if pending is None:
            pending = self._reads[key] = asyncio.ensure_future(read())
            pending.add_done_callback(lambda done: self._reads.pop(key) if self._reads.get(key) is done else None)
        return await asyncio.shield(pending)

    async def engines(self, *, now: bool = False) -> list[str]:
        """The engine URLs behind the URL: [] for a router with no engine yet, or while nothing is known.
        `now`: read a list that failed moments ago again at once (an abort: an engine that runs a
        request for nobody costs more than one more read)."""
        url = await self._client.locator.get()
        if url == self._for_url and self._engines and self._fresh(self._read_at):
            return self._engines
        if not now and self._list_failed == (url, self._epoch) and time.monotonic() < self._list_retry_at:
            return list(self._engines) if url == self._for_url else []  # a failed read, moments ago
        return list(await self._once(f"{url}/workers", lambda: self._read_engines(url)))

    async def _read_engines(self, url: str) -> list[str]:
        epoch = self._epoch
        status, listing = await self._client.get_json(f"{url}/workers")
        urls = _engine_urls(listing) if status == 200 else None
        if urls is None and status not in _NOT_A_ROUTER:
            what = status or "no answer"
            if status == 200:
                what = "200 without a worker list"
            log.warning("GET %s/workers failed (%s): keeping the engines known so far", url, what)
            # not read again for _LIST_RETRY_S: a router that hangs costs one control_timeout_s per
            # retry, not one per request
            self._list_failed, self._list_retry_at = (url, epoch), time.monotonic() + _LIST_RETRY_S
            return list(self._engines) if url == self._for_url else []
        engines = [url] if urls is None else urls  # answered without a list: the URL is an engine
        if epoch != self._epoch:  # invalidated while reading: the answer is for the caller, not kept
            return engines
        if engines != self._engines or url != self._for_url:
            log.info("engines behind %s: %s", url, ", ".join(engines) or "none")
        for gone in set(self._facts) - set(engines):
            del self._facts[gone]
        for gone in set(self._failed) - set(engines):
            del self._failed[gone]
        self._engines, self._for_url, self._read_at = engines, url, time.monotonic()
        self._list_failed = None
        return engines

    async def facts_of(self, engine: str) -> EngineFacts:
        known = self._facts.get(engine)
        if known is not None and self._fresh(known[1]):
            return known[0]
        failed = self._failed.get(engine)
        if failed is not None and time.monotonic() < failed[1]:  # backing off after a failed read
            return known[0] if known is not None else EngineFacts()
        facts = await self._once(f"{engine}/server_info", lambda: self._read_facts(engine))
        if facts is None:  # no answer: the last good facts stand, none is made up
            return known[0] if known is not None else EngineFacts()
        return facts

    async def _read_facts(self, engine: str) -> EngineFacts | None:
        epoch = self._epoch
        what: Any = "no answer"
        for path in ("/server_info", "/get_server_info"):  # the deprecated alias where the first is absent
            status, info = await self._client.get_json(f"{engine}{path}")
            if status == 200 and isinstance(info, dict):
                facts = EngineFacts(context_limit(info), priority_order(info))
                if facts.limit is None:
                    log.warning("%s does not say its context (no context_length or max_req_input_len in %s)",
                                engine, path)
                if epoch == self._epoch:  # else invalidated while reading: for the caller, not kept
                    self._facts[engine] = (facts, time.monotonic())
                    self._failed.pop(engine, None)
                return facts
            what = "200 without a JSON object" if status == 200 else status or "no answer"
            if status != 404:
                break
        if epoch == self._epoch:
            failures = self._failed.get(engine, (0, 0.0))[0] + 1
            # An engine that answered (a 503 while it restarts) is asked again at the next use once;
            # one that did not answer (a hang costs a control timeout) backs off from the first failure.
            answered = isinstance(what, int)
            backoff = 0.0 if answered and failures == 1 else min(
                self._refresh_s, _FACTS_RETRY_S * 2 ** (failures - 1 - int(answered)))
            self._failed[engine] = (failures, time.monotonic() + backoff)
            log.warning("%s/server_info did not answer (%s): asking again in %.0f s", engine, what, backoff)
        return None

    async def limit_of(self, engine: str) -> int | None:
        return (await self.facts_of(engine)).limit

    async def context_limit(self) -> int | None:
        """The smallest limit over the engines (a request may be routed to any of them)."""
        limits = await asyncio.gather(*(self.limit_of(engine) for engine in await self.engines()))
        known = [limit for limit in limits if limit is not None]
        return min(known) if known else None

    async def priority_order(self) -> int | None:
        """The engines' common `priority` order (`priority_order`); None unless every engine
        schedules by priority the same way (a request may be routed to any of them)."""
        facts = await asyncio.gather(*(self.facts_of(engine) for engine in await self.engines()))
        orders = {f.priority_order for f in facts}
        return orders.pop() if len(orders) == 1 else None


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
        clock: PolicyClock | None = None,
        control_timeout_s: float = _CONTROL_TIMEOUT_S,
    ):
        self.locator = EngineLocator(locator) if isinstance(locator, str) else locator
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.control_timeout_s = control_timeout_s  # GET /workers, /server_info, /model_info
        self.clock = clock  # None: answers carry no policy stamp (tests, standalone use)
        self._max_connections = max_connections  # 0 = unbounded; the engine's slots are the limit
        self._session: aiohttp.ClientSession | None = None
        self.directory = EngineDirectory(self)
        self._control_tasks: set[asyncio.Task[None]] = set()  # held until done: a bare task may be collected

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        """Aborts under way get `control_timeout_s` to reach their engines; those still pending
        then are cancelled before the session closes (else one would open a new session, through
        `session`, that nobody closes)."""
        if self._control_tasks:
            await asyncio.wait(set(self._control_tasks), timeout=self.control_timeout_s)
        pending = set(self._control_tasks)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            log.warning("closed with %d abort(s) that had not reached their engines in %.0f s",
                        len(pending), self.control_timeout_s)
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def context_length(self) -> int | None:
        """The tokens input + max_new_tokens may reach on every engine behind the URL (what each
        enforces, `EngineDirectory`), or None when no engine says. The episode runner sizes each
        turn to fit, so a long episode ends truncated instead of with a 400."""
        return await self.directory.context_limit()

    async def model_info(self) -> tuple[int, Any]:
        """(status, JSON) of `/model_info` (the model and tokenizer paths) from an engine behind
        the URL: routers do not pass it on. (503, None) while a router lists no engine, (0, None)
        while nothing answers: slime starts its engines after the workers."""
        engines = await self.directory.engines()
        if not engines:
            return 503, None
        status, info = await self.get_json(f"{engines[0]}/model_info")
        if status in (0, 404):
            self.directory.invalidate()  # that engine left the list: read it again
        return status, info

    async def get_json(self, url: str) -> tuple[int, Any]:
        """(status, decoded JSON or None) of a GET; (0, None) when the server cannot be reached."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.control_timeout_s)) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("GET %s: %s", url, exc)
            return 0, None
        try:
            return status, msgspec.json.decode(body) if body else None
        except msgspec.DecodeError:
            return status, None

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, rid: str, routing_key: str,
        due_order: int | None = None,
    ) -> Generation:
        """`due_order`: the group's place in the due order (smaller = sooner), sent as SGLang
        `priority` where the engines schedule by it (module doc)."""
        headers = {"Content-Type": "application/json", ROUTING_HEADER: routing_key}
        params = sampling.to_dict()
        priority = await self.priority(due_order)
        for attempt in range(self.max_retries + 1):
            attempt_rid = rid if attempt == 0 else f"{rid}~{attempt}"
            request: dict[str, Any] = {
                "input_ids": input_ids,
                "sampling_params": params,
                "return_logprob": True,
                "rid": attempt_rid,
                "routing_key": routing_key,
            }
            if priority is not None:
                request["priority"] = priority
            body = _json_encoder.encode(request)
            policy = await self.clock.stamp() if self.clock is not None else None
            failure = await self._attempt(body, headers, attempt_rid)
            if isinstance(failure, Generation):
                return dataclasses.replace(failure, policy=policy) if policy else failure
            if attempt == self.max_retries:
                raise EngineError(f"rid {rid}: gave up after {attempt + 1} attempts: {failure}")
            delay = min(_MAX_BACKOFF_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning("rid %s: %s; retry %d/%d in %.2fs", attempt_rid, failure, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def priority(self, due_order: int | None) -> int | None:
        """SGLang `priority` for a group at this place in the due order: the smaller, the sooner."""
        if due_order is None:
            return None
        order = await self.directory.priority_order()
        if order is None:
            return None
        return max(_I32_MIN, min(_I32_MAX, order * due_order))  # the router's type (module doc)

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
            self._hold(asyncio.create_task(self.abort(rid)))
            raise EngineError(f"rid {rid}: no answer from {url} within {self.timeout_s}s") from None
        except asyncio.CancelledError:  # a soft deadline, Job.abort, a sibling's failure: nobody waits for it now
            self._hold(asyncio.create_task(self.abort(rid)))
            raise
        except aiohttp.ClientError as exc:
            self.locator.invalidate()
            self.directory.invalidate()
            return f"connection error to {url}: {exc.__class__.__name__}: {exc}"
        if status == 200:
            try:
                return parse_generation(payload, time.monotonic() - started)
            except msgspec.DecodeError as exc:  # garbage or truncated JSON from a proxy: transient, like a 502
                return f"undecodable /generate answer: {exc}"
            except BadVersionSpans as exc:  # the engine's own bookkeeping: the same again on a retry
                raise BadVersionSpans(f"rid {rid}: {exc}") from None
        message = _error_message(payload)
        if status >= 500 or status == 429:
            return f"HTTP {status}: {message}"
        if status == 400 and _CONTEXT_OVERFLOW.search(message):
            self.directory.invalidate()  # an engine with a smaller context may have joined: re-read the list
            raise ContextOverflow(f"rid {rid}: HTTP 400: {message}")
        if status == 400:
            raise BadRequest(f"rid {rid}: HTTP 400: {message}")
        raise EngineError(f"rid {rid}: HTTP {status}: {message}")

    def _hold(self, task: asyncio.Task[None]) -> None:
        self._control_tasks.add(task)
        task.add_done_callback(self._control_tasks.discard)

    async def abort(self, rid: str) -> None:
        """Best effort `/abort_request` for one rid on every engine behind the URL (never raises).

        Through a router the engine that runs the rid is not known here (the router picked it), and
        the router itself answers `/abort_request` with 404: each engine of its `GET /workers` list
        is asked, as slime's own abort does; an engine that does not hold the rid ignores it."""
        engines: list[str] = []
        for attempt in range(_ABORT_LIST_TRIES):  # no engine known yet (a router slow to list them): ask again
            if attempt:
                await asyncio.sleep(0.25)
            try:
                engines = await self.directory.engines(now=attempt > 0)
            except Exception as exc:  # noqa: BLE001 - best effort by design
                log.debug("abort of %s: no engine list: %s", rid, exc)
                return
            if engines:
                break
        await asyncio.gather(*(self._abort_on(engine, rid) for engine in engines))

    async def _abort_on(self, engine: str, rid: str) -> None:
        try:
            async with self.session.post(
                f"{engine}/abort_request", json={"rid": rid, "abort_all": False},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                await resp.read()
        except Exception as exc:  # noqa: BLE001 - best effort by design
            log.debug("abort of %s on %s failed: %s", rid, engine, exc)
