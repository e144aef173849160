"""What a worker process says while it runs (issue 27: the first hour without silences).

- `wait_for_redis`: before arq connects, say every few seconds what the worker waits for
  (arq's own first connect retries silently for the whole outage budget).
- `GroupLog` / `LoggingBuffer`: one INFO line per finished group (task, env, reward mean,
  tokens, seconds), at most one per `every_s`; the groups in between are counted on the next
  line, so a pool finishing thousands of groups a minute logs about one line a second.
- `HideJobArgs`: arq's per-job line (`--verbose`) names the job id, never the job's arguments:
  arq 0.28 logs `'%6.2fs → %s(%s)%s'` with `args_to_string(args, kwargs)` (arq/worker.py,
  `run_job`), which for a prompt job is the repr of the msgpack payload, prompts included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.keys import Counter
from pipeline.schema import SampleGroup, Status
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import ENV_OUTAGE_S, RedisUnavailable, outage_budget_s, redact, sync_client

log = logging.getLogger("workers.groups")
wait_log = logging.getLogger("workers.settings")

WAIT_LOG_S = 5.0  # how often a worker waiting for Redis says so
GROUP_LOG_EVERY_S = 1.0  # at most one per-group line this often
ARQ_JOB_START = "%6.2fs → %s(%s)%s"  # arq 0.28 worker.py run_job: (seconds, job ref, args, extra)
HIDDEN = "…"


# ------------------------------------------------------------------ waiting for Redis


def wait_for_redis(url: str, *, budget_s: float | None = None, every_s: float = WAIT_LOG_S,
                   poll_s: float = 0.5) -> None:
    """Return once Redis at `url` answers PING; log what it waits for every `every_s` meanwhile;
    raise RedisUnavailable past the outage budget ($ROLLOUT_REDIS_OUTAGE_S). A refused password
    is raised at once (waiting does not fix it)."""
    budget = outage_budget_s() if budget_s is None else budget_s
    started = time.monotonic()
    logged_at: float | None = None
    client = sync_client(url, timeout_s=2.0)
    try:
        while True:
            try:
                client.ping()
            except AuthenticationError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                waited = time.monotonic() - started
                if waited >= budget:
                    raise RedisUnavailable(
                        f"redis {redact(url)} unreachable for {budget:.0f}s (last error: {type(exc).__name__}: "
                        f"{exc}); the budget is ${ENV_OUTAGE_S}") from None
                if logged_at is None or time.monotonic() - logged_at >= every_s:
                    logged_at = time.monotonic()
                    wait_log.info("waiting for Redis at %s (%s: %s); giving up in %.0fs ($%s)", redact(url),
                                  type(exc).__name__, exc, budget - waited, ENV_OUTAGE_S)
                time.sleep(min(poll_s, max(0.0, budget - waited)))
                continue
            if logged_at is not None:
                wait_log.info("Redis at %s is up after %.1fs", redact(url), time.monotonic() - started)
            return
    finally:
        client.close()


# ------------------------------------------------------------------ one line per finished group


class GroupLog:
    """Rate-limited INFO lines, one per finished group."""

    def __init__(self, every_s: float = GROUP_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None
        self._skipped = 0

    def finished(self, group: SampleGroup, tokens: int) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self._skipped += 1
            return
        rewards = group.rewards()
        failed = sum(s.status is Status.FAILED for s in group.samples)
        more = f"; {self._skipped} more group(s) since the last line" if self._skipped else ""
        log.info("group done: task %s, env %s, reward mean %.3f, %d tokens, %.1fs (%d episodes, %d failed)%s",
                 group.task.id, group.env, sum(rewards) / len(rewards) if rewards else 0.0, tokens,
                 group.timings.get("run_s", 0.0), len(group.samples), failed, more)
        self._last, self._skipped = now, 0


class LoggingBuffer(GroupBuffer):
    """The worker's buffer: every group it stores (not a refused duplicate) gets its line."""

    def __init__(self, *args: Any, group_log: GroupLog | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group_log = group_log or GroupLog()

    async def push(self, group: SampleGroup, **counter_deltas: int) -> str | None:
        stream_id = await super().push(group, **counter_deltas)
        if stream_id is not None:
            self.group_log.finished(group, counter_deltas.get(Counter.TOKENS, 0))
        return stream_id


# ------------------------------------------------------------------ arq's per-job lines


class HideJobArgs(logging.Filter):
    """Blank the job's arguments in arq's lines (a prompt job's argument is its msgpack
    payload); the job id (`ref` = `<job id>:<function>`) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == ARQ_JOB_START and isinstance(record.args, tuple) and len(record.args) == 4:
            record.args = (record.args[0], record.args[1], HIDDEN, record.args[3])
        elif isinstance(record.args, tuple) and any(_looks_like_payload(a) for a in record.args):
            # a line of another arq version that carries arguments: never the payload
            record.args = tuple(HIDDEN if _looks_like_payload(a) else a for a in record.args)
        return True


def _looks_like_payload(value: object) -> bool:
    return isinstance(value, bytes) or (isinstance(value, str) and value.startswith(("b'", 'b"')))


HIDE_JOB_ARGS = HideJobArgs()


def hide_job_args() -> None:
    """Install the filter on arq's worker logger (idempotent)."""
    logger = logging.getLogger("arq.worker")
    if HIDE_JOB_ARGS not in logger.filters:
        logger.addFilter(HIDE_JOB_ARGS)

