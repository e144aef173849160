"""Trajectory upload to OpenReward's rollout viewer, off the episode's path.

An environment with `options.upload` (docs/environments.md) hands each finished episode to
a `TrajectoryUploader`: `submit` puts it on a bounded queue and returns at once; one daemon
thread owns the SDK's `RolloutAPI` (`openreward.api.rollouts`) and, per episode, creates
the rollout (`RolloutAPI.create`: a blocking POST /v1/rollouts with no timeout, plus
GET /v1/environments/... lookups when the environment is `owner/name`) and logs every
message (`Rollout.log`), which the SDK's own background thread batches to POST /v1/rollouts.

Never on the critical path: the event loop only does `queue.put_nowait`; a full queue (a
slow or dead API) drops the episode and counts it. A rollout the API refused, or a batch of
messages the SDK's sender gave up on, is counted as failed; a message the SDK's own ring
buffer evicted (its "ring buffer full, evicted oldest event" line) is counted as evicted.
Drops, failures and evictions are logged once a minute at most, with counts and the last
cause; nothing is raised to the episode, and the sample is never changed. The API key is
read from the environment by name and given to the SDK alone; it is in no log line of ours,
and the SDK's own failure lines (which carry the server's answer) are counted instead of
printed, by the uploader whose threads logged them (its upload thread, its `RolloutAPI`'s
sender thread), not by every uploader of the process.

At shutdown (`close`, from the environment's `aclose`) the uploader takes no more episodes,
uploads what is queued and flushes the SDK's sender for at most `CLOSE_TIMEOUT_S`; the
episodes still queued then are dropped, counted (`dropped`, `dropped_at_close`) and named in
one log line with their number. Messages handed to the SDK that its sender has not yet
delivered then (still in its buffer, or in a POST that has not answered: lost when the process
ends, its sender being a daemon thread) are counted too (`unsent_at_close`, in one log line):
the uploader counts the messages it logs and those each of the sender's POSTs delivered or
lost (it wraps the SDK's `make_request` in `openreward.api.rollouts.background`, attributed
by thread as the failure lines are), so the SDK's own stdout line ("shutdown timed out, some
rollout data may not have been uploaded") is no longer the only word.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from typing import Any, Union

import msgspec

log = logging.getLogger(__name__)

REPORT_EVERY_S = 60.0
CLOSE_TIMEOUT_S = 10.0


class UploadOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """`options.upload` of an environment."""

    run_name: Union[str, None] = None  # OpenReward run; None = the pipeline's run (Redis namespace)
    every: int = msgspec.field(default=1)  # upload the episodes of one task in `every` (whole groups)
    api_url: Union[str, None] = None  # OpenReward API; None = the SDK's ($OPENREWARD_API_URL, api.openreward.ai)
    queue_size: int = 256  # episodes waiting for the upload thread; beyond it they are dropped (counted)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")


@dataclasses.dataclass(frozen=True)
class Event:
    """One message event of a trajectory: the SDK upload type's name and fields, its reward."""

    kind: str  # SystemMessage, UserMessage, AssistantMessage, ReasoningItem, ToolCall, ToolResult
    fields: dict[str, Any]
    reward: Union[float, None] = None
    finished: bool = False


@dataclasses.dataclass(frozen=True)
class Trajectory:
    run_name: str
    rollout_name: str
    environment: Union[str, None]
    variant: Union[str, None]
    split: Union[str, None]
    task_spec: Union[dict[str, Any], None]
    metadata: dict[str, Any]
    events: list[Event]


def chosen(task_id: str, every: int) -> bool:
    """Whether the episodes of `task_id` are uploaded: one task in `every`, by a stable hash,
    so that a group goes whole and every worker makes the same choice."""
    if every <= 1:
        return True
    import zlib

    return zlib.crc32(task_id.encode()) % every == 0


def events_of(messages: list[dict[str, Any]], call_results: dict[str, tuple[Union[float, None], bool]]) -> list[Event]:
    """The conversation as the SDK's upload events, in order: a tool result carries its call's
    reward and `finished` (`call_results[tool_call_id]`); the last assistant message carries
    those of the terminal tool it was graded by (`call_results[FINAL_ANSWER]`)."""
    events: list[Event] = []
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    for index, message in enumerate(messages):
        role = message.get("role")
        content = _text(message.get("content"))
        if role == "system":
            events.append(Event("SystemMessage", {"content": content}))
        elif role == "user":
            events.append(Event("UserMessage", {"content": content}))
        elif role == "tool":
            call_id = str(message.get("tool_call_id") or "")
            reward, finished = call_results.get(call_id, (None, False))
            events.append(Event("ToolResult", {"content": content, "call_id": call_id}, reward, finished))
        elif role == "assistant":
            if message.get("reasoning_content"):
                events.append(Event("ReasoningItem", {"content": _text(message["reasoning_content"])}))
            reward, finished = call_results.get(FINAL_ANSWER, (None, False)) if index == last_assistant else (None, False)
            events.append(Event("AssistantMessage", {"content": content}, reward, finished))
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                arguments = function.get("arguments")
                text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
                events.append(Event("ToolCall", {"name": str(function.get("name", "")), "content": text, "call_id": str(call.get("id", ""))}))
    return events


FINAL_ANSWER = "\x00final-answer"  # call_results key of the terminal tool the last answer went to


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class _Counts:
    """Counters shared by the event loop (drops) and the upload thread (the rest)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.uploaded = 0
        self.dropped = 0
        self.failed = 0  # episodes whose rollout the API did not create
        self.failed_batches = 0  # message batches the SDK's sender gave up on
        self.evicted = 0  # messages the SDK's ring buffer evicted before sending them
        self.dropped_at_close = 0  # episodes still queued when close() gave up waiting
        self.messages = 0  # messages handed to the SDK (Rollout.log)
        self.messages_sent = 0  # messages in POSTs the SDK's sender completed
        self.messages_lost = 0  # messages in POSTs the sender gave up on
        self.unsent_at_close = 0  # messages neither sent, lost nor evicted when close() returned
        self.unreported_dropped = 0
        self.unreported_failed = 0
        self.unreported_evicted = 0
        self.last_error = ""
        self.last_report = 0.0


class _CountingSdkLog:
    """Stands in for the SDK's module loggers of the rollout client: its failure lines
    ("failed to start rollout", "upload failed": one per rollout or batch, with the server's
    answer) and its eviction line become counts of the uploader that sent them (the one whose
    thread logged the line), reported once a minute; other lines, and lines no uploader's
    thread logged, go to the SDK's own logger. One per process (the SDK's loggers are module
    globals)."""

    FAILURES = ("failed to start rollout", "upload failed")
    EVICTED = "ring buffer full, evicted"  # background.py: the oldest buffered message is lost

    def __init__(self, original: Any) -> None:
        self.original = original
        self.uploaders: list[TrajectoryUploader] = []

    def _line(self, level: str, event: str = "", *args: Any, **kwargs: Any) -> None:
        counted = event.startswith(self.FAILURES) or event.startswith(self.EVICTED)
        here = threading.current_thread()
        owner = next((u for u in list(self.uploaders) if u._sends_on(here)), None) if counted else None
        if owner is None:
            getattr(self.original, level)(event, *args, **kwargs)
        elif event.startswith(self.EVICTED):
            owner._count_eviction()
        else:
            owner._count_failure(f"{event}: {kwargs.get('error', '')}"[:300], rollouts=event.startswith("failed to start"))

    def debug(self, event: str = "", *args: Any, **kwargs: Any) -> None:
        self._line("debug", event, *args, **kwargs)

    def info(self, event: str = "", *args: Any, **kwargs: Any) -> None:
        self._line("info", event, *args, **kwargs)

    def warning(self, event: str = "", *args: Any, **kwargs: Any) -> None:
        self._line("warning", event, *args, **kwargs)

    def error(self, event: str = "", *args: Any, **kwargs: Any) -> None:
        self._line("error", event, *args, **kwargs)


class _CountingSend:
    """Stands in for the SDK's `make_request` in its sender (`background.do_upload`): the message
    events of each POST are counted as sent or lost by the uploader whose sender thread made it."""

    def __init__(self, original: Any, uploaders: list[TrajectoryUploader]) -> None:
        self.original = original
        self.uploaders = uploaders

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        body = kwargs.get("body")
        events = body.get("events", ()) if isinstance(body, dict) else ()
        messages = sum(isinstance(e, dict) and e.get("eventType") == "message" for e in events)
        here = threading.current_thread()
        owner = next((u for u in list(self.uploaders) if u._sends_on(here)), None) if messages else None
        try:
            answer = await self.original(*args, **kwargs)
        except Exception:  # the sender gave up on them (a CancelledError at shutdown: unsent)
            if owner is not None:
                owner._count_messages(lost=messages)
            raise
        if owner is not None:
            owner._count_messages(sent=messages)
        return answer


_SDK_LOG: Union[_CountingSdkLog, None] = None
_SDK_LOG_LOCK = threading.Lock()


def _watch_sdk_failures(uploader: TrajectoryUploader) -> None:
    global _SDK_LOG
    from openreward.api.rollouts import background, rollout

    with _SDK_LOG_LOCK:
        if _SDK_LOG is None:
            _SDK_LOG = _CountingSdkLog(rollout.logger)
            rollout.logger = _SDK_LOG  # type: ignore[assignment]
            background.log = _CountingSdkLog(background.log)  # type: ignore[assignment]
            background.log.uploaders = _SDK_LOG.uploaders  # type: ignore[attr-defined]
            background.make_request = _CountingSend(background.make_request, _SDK_LOG.uploaders)  # type: ignore[assignment]
        _SDK_LOG.uploaders.append(uploader)


def _unwatch(uploader: TrajectoryUploader) -> None:
    with _SDK_LOG_LOCK:
        if _SDK_LOG is not None and uploader in _SDK_LOG.uploaders:
            _SDK_LOG.uploaders.remove(uploader)


class TrajectoryUploader:
    """A bounded queue of trajectories and the one thread that uploads them with the SDK."""

    def __init__(self, *, api_key: str, api_url: Union[str, None], queue_size: int, what: str):
        self.what = what  # "openreward upload (env 'x')", for log lines
        self._api_key = api_key
        self._api_url = api_url
        self._queue: queue.Queue[Union[Trajectory, None]] = queue.Queue(maxsize=queue_size)
        self._counts = _Counts()
        self._thread: Union[threading.Thread, None] = None
        self._api: Any = None
        self._closed = False

    # ------------------------------------------------------------------ the event loop's side

    def submit(self, trajectory: Trajectory) -> bool:
        """Queue one episode; never blocks. False (counted as dropped) when the queue is full."""
        if self._closed:
            return False
        if self._thread is None:
            self._start()
        try:
            self._queue.put_nowait(trajectory)
        except queue.Full:
            with self._counts.lock:
                self._counts.dropped += 1
                self._counts.unreported_dropped += 1
            self._maybe_report()
            return False
        return True

    def stats(self) -> dict[str, int]:
        """uploaded: rollouts created with their messages handed to the SDK's sender; failed:
        rollouts not created; failed_batches: message batches the sender gave up on; evicted:
        messages the SDK's ring buffer evicted; dropped: episodes never uploaded because the
        queue was full or still held them at close (`dropped_at_close` of them); queued:
        waiting now; messages: handed to the SDK, `messages_sent` of them delivered;
        unsent_at_close: handed and neither delivered, lost nor evicted when `close` returned."""
        with self._queue.mutex:  # the stop sentinel is no episode
            queued = sum(item is not None for item in self._queue.queue)
        with self._counts.lock:
            c = self._counts
            return {"uploaded": c.uploaded, "dropped": c.dropped, "dropped_at_close": c.dropped_at_close,
                    "failed": c.failed, "failed_batches": c.failed_batches, "evicted": c.evicted, "queued": queued,
                    "messages": c.messages, "messages_sent": c.messages_sent, "unsent_at_close": c.unsent_at_close}

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop taking episodes, upload what is queued and flush the SDK's sender, for at most
        about `timeout_s` (blocking: call it from a thread, `asyncio.to_thread`)."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            deadline = time.monotonic() + timeout_s
            while thread.is_alive() and time.monotonic() < deadline:
                try:
                    self._queue.put(None, timeout=0.1)
                    break
                except queue.Full:
                    continue
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread is None or not thread.is_alive():
            _unwatch(self)  # else the thread does, when its last upload and the SDK's flush are over
        left = self._drop_queued()
        if left:
            log.warning("%s: closed with %d episode(s) still queued after %.1fs: dropped, not uploaded "
                        "(episodes are not affected)", self.what, left, timeout_s)
        unsent = self._count_unsent()
        if unsent:
            log.warning("%s: closed with %d message(s) still in the SDK's sender after %.1fs: not uploaded "
                        "(episodes are not affected)", self.what, unsent, timeout_s)
        self._report(force=True)

    def _count_unsent(self) -> int:
        with self._counts.lock:
            c = self._counts
            c.unsent_at_close = max(0, c.messages - c.messages_sent - c.messages_lost - c.evicted)
            return c.unsent_at_close

    def _drop_queued(self) -> int:
        """Empty the queue at close and count what it held as dropped. The stop sentinel goes back
        for a thread still busy with an upload, so it ends after that one."""
        left = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            left += item is not None
        if self._thread is not None and self._thread.is_alive():
            self._queue.put_nowait(None)
        with self._counts.lock:
            self._counts.dropped += left
            self._counts.dropped_at_close += left
        return left

    # ------------------------------------------------------------------ the upload thread

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="openreward-trajectory-upload", daemon=True)
        self._thread.start()

    def _rollout_api(self) -> Any:
        if self._api is None:
            from openreward.api.rollouts import RolloutAPI
            from openreward.client import OpenReward

            client = OpenReward(api_key=self._api_key)  # the SDK's sender settings and API URL
            config = client.config.send_loop_config
            if self._api_url:
                config = dataclasses.replace(config, base_url=self._api_url.rstrip("/"))
            self._api = RolloutAPI(send_loop_config=config, shutdown_timeout=client.config.shutdown_timeout)
        return self._api

    def _run(self) -> None:
        try:  # here, not on the event loop: the SDK's rollout client imports anthropic and google-genai types
            _watch_sdk_failures(self)
        except Exception as exc:  # noqa: BLE001 - no SDK rollout client: every upload fails below, counted
            self._count_failure(f"{type(exc).__name__}: {exc}"[:300], rollouts=True)
        while True:
            trajectory = self._queue.get()
            if trajectory is None:
                break
            try:
                self._upload(trajectory)
            except Exception as exc:  # noqa: BLE001 - an upload never reaches the episode
                self._count_failure(f"{type(exc).__name__}: {exc}"[:300], rollouts=True)
            self._maybe_report()
        if self._api is not None:
            try:
                self._api.close()  # flushes the SDK's sender (its shutdown_timeout bounds it)
            except Exception as exc:  # noqa: BLE001
                self._count_failure(f"close: {type(exc).__name__}: {exc}"[:300], rollouts=False)
        if self._closed:  # a close() that stopped waiting for this thread: what happened since, in one line
            _unwatch(self)
            self._report(force=True)

    def _upload(self, t: Trajectory) -> None:
        from openreward.api.rollouts.serializers import base as upload_types

        rollout = self._rollout_api().create(
            t.run_name, rollout_name=t.rollout_name, environment=t.environment, variant=t.variant,
            split=t.split, metadata=t.metadata, task_spec=t.task_spec,
        )
        # The SDK disables a rollout whose creation failed (its log line is counted above)
        if getattr(rollout, "_rollouts_disabled", False):
            return
        for event in t.events:
            message = getattr(upload_types, event.kind)(**event.fields)
            rollout.log(message, reward=event.reward, is_finished=event.finished)
            with self._counts.lock:
                self._counts.messages += 1
        with self._counts.lock:
            self._counts.uploaded += 1

    # ------------------------------------------------------------------ counting and reporting

    def _sends_on(self, thread: threading.Thread) -> bool:
        """Whether `thread` is this uploader's: its upload thread or its `RolloutAPI`'s sender."""
        return thread is self._thread or (self._api is not None and thread is getattr(self._api, "_thread", None))

    def _count_messages(self, *, sent: int = 0, lost: int = 0) -> None:
        with self._counts.lock:
            self._counts.messages_sent += sent
            self._counts.messages_lost += lost

    def _count_eviction(self) -> None:
        with self._counts.lock:
            self._counts.evicted += 1
            self._counts.unreported_evicted += 1

    def _count_failure(self, cause: str, *, rollouts: bool) -> None:
        """`rollouts`: an episode's rollout was not created (else: a batch of messages was lost)."""
        with self._counts.lock:
            if rollouts:
                self._counts.failed += 1
            else:
                self._counts.failed_batches += 1
            self._counts.unreported_failed += 1
            self._counts.last_error = cause

    def _maybe_report(self) -> None:
        self._report(force=False)

    def _report(self, *, force: bool) -> None:
        with self._counts.lock:
            c = self._counts
            if not (c.unreported_dropped or c.unreported_failed or c.unreported_evicted):
                return
            now = time.monotonic()
            if not force and now - c.last_report < REPORT_EVERY_S:
                return
            dropped, failed, evicted, cause = c.unreported_dropped, c.unreported_failed, c.unreported_evicted, c.last_error
            c.unreported_dropped = c.unreported_failed = c.unreported_evicted = 0
            c.last_report = now
        log.warning(
            "%s: %d upload(s) failed, %d episode(s) dropped (queue full), %d message(s) evicted by the SDK's "
            "buffer since the last report; episodes are not affected; last error: %s",
            self.what, failed, dropped, evicted, cause or "-",
        )
