"""arq Worker for prompt jobs, configured for rollouts (not arq's defaults).

- `max_jobs` = groups per process (`--concurrency`), `poll_delay` small (a freed slot
  must not wait half a second), explicit `job_timeout`;
- the poll (`RolloutWorker`, issue 33): one script takes up to the free slots and moves what it
  looks at out of the due range, so a poll costs O(free slots), not O(jobs in progress); a poll
  that takes nothing backs off to IDLE_POLL_MAX_S; no burst mode (arq's `burst` is not used here);
  with a free slot the worker also waits on the admission's `{ns}:queued_events` message and takes
  what was admitted at once (`workers.wake_on_admission`): the backed-off poll left the engine
  without the next cohort for up to a second after each policy version's publish (issue 46);
  the same script records each job it takes as this worker's (liveness job set, owner, `running`),
  so no orphan sweep ever sees a job in progress without its owner (issue 47);
  eval jobs (queued ahead of training, scores below EVAL_SCORE_MAX) take at most
  `workers.eval_share` of the slots (`eval_slots`): the rest go to training jobs (issue 40);
- arq's `max_tries` is ours + 1, so a job that comes back after its last try (its
  worker crashed) reaches `run_group`, which dead-letters it with its last error
  instead of arq failing it silently;
- msgspec serializer both ways; abortable jobs;
- SIGTERM/SIGINT drain: stop taking jobs, let running groups finish for
  `drain_grace_s`, then cancel the rest, which arq hands back for re-run at once;
- heartbeats + reaper (`workers.liveness`) started with the worker;
- arq's Redis connection has the pipeline's reconnect policy (`pipeline.store.jobqueue.redis_settings`:
  a Redis restart of up to `$ROLLOUT_REDIS_OUTAGE_S` is ridden out, socket timeouts set);
  past it the worker exits with one line naming the cause.

In-process (tests, demo, bench):
    worker = build_worker(config, handle_signals=False)
    task = asyncio.create_task(worker.async_run()); ...; await stop_worker(worker, task)
As a process: `run_worker(config)` (blocks; used by `rollout workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

import aiohttp
from arq.worker import Worker, func
from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.config import PipelineConfig
from pipeline.eval.evaluation import EVAL_FUNCTION, EVAL_SCORE_MAX
from pipeline.keys import Keys
from pipeline.state import ChannelWake, PipelineState, PolicyClock
from pipeline.store.jobqueue import JOB_FUNCTION, fit_arq_pool, job_deserializer, job_serializer, redis_settings
from pipeline.store.redis_conn import RedisUnavailable, connect, redact
from workers.chat import ChatTokens
from workers.engine import EngineClient, EngineLocator
from workers.envs.options import check_tool_parsers
from workers.eval_jobs import run_eval_group
from workers.jobs import ARQ_WORKER_KEY, CTX_KEY, WorkerContext, run_group
from workers.liveness import PLACE_PREFIX, RECORD_OWNER_LUA, Liveness
from workers.worker_log import LoggingBuffer, hide_job_args, wait_for_redis

log = logging.getLogger(__name__)

# arq refuses to enqueue a job id again while its result key exists (arq 0.28 `enqueue_job`:
# EXISTS job key, result key), and so do our admission scripts. That existence is all anyone
# reads: results are stored without the job's arguments (`result_serializer`: ~150 B each, not
# the whole job), for ROLLOUT_KEEP_RESULT_S seconds. A re-run after that is still stored once:
# the group's dedup marker (pipeline/store/buffer.py, ROLLOUT_DEDUP_TTL_S) refuses its push.
KEEP_RESULT_S = int(os.environ.get("ROLLOUT_KEEP_RESULT_S", "3600"))


def result_serializer(obj: dict[str, Any]) -> bytes:
    """The worker's serializer: jobs as `job_serializer` writes them; a result (arq's dict with
    `s`, success) without the job's arguments (`a`, `k`: the whole task and prompt)."""
    if "s" in obj and "a" in obj:
        obj = {**obj, "a": (), "k": {}}
    return job_serializer(obj)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def build_worker(
    config: PipelineConfig,
    *,
    concurrency: int | None = None,
    worker_id: str | None = None,
    handle_signals: bool = True,
) -> Worker:
    check_tool_parsers(config)  # a typo'd parser fails here, not in every episode
    hide_job_args()  # --verbose: arq's per-job lines name the job id, never its msgpack payload
    keys = Keys(config.redis.namespace)
    wcfg = config.workers
    worker_id = worker_id or new_worker_id()

    async def on_startup(ctx: dict[str, Any]) -> None:
        _set_socket_timeout(ctx.get("redis"), config.redis.resolved_url())
        ctx[CTX_KEY] = await _build_context(config, keys, worker_id)
        ctx[CTX_KEY].liveness.start()
        _quiet_garbage_collector()
        log.info("worker %s ready: queue %s, %d groups at once", worker_id, keys.queue, concurrency or wcfg.concurrency)

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        w: WorkerContext | None = ctx.get(CTX_KEY)
        if w is not None:
            await w.liveness.stop()
            await w.aclose()
            await w.buffer.redis.aclose()

    worker = RolloutWorker(
        functions=[
            func(run_group, name=JOB_FUNCTION, max_tries=wcfg.max_tries + 1, timeout=wcfg.job_timeout_s),
            # evaluation rounds (pipeline/eval/evaluation.py): queued ahead of training jobs
            func(run_eval_group, name=EVAL_FUNCTION, max_tries=wcfg.max_tries + 1, timeout=wcfg.job_timeout_s),
        ],
        queue_name=keys.queue,
        redis_settings=redis_settings(config.redis.resolved_url()),
        max_jobs=concurrency or wcfg.concurrency,
        eval_slots=eval_slots(wcfg.eval_share, concurrency or wcfg.concurrency),
        eval_prefix=keys.arq_job_id("eval:"),  # eval group ids begin "eval:" (pipeline/eval/evaluation.py)
        poll_delay=wcfg.poll_delay_s,
        wake_channel=keys.queued_events if wcfg.wake_on_admission else "",
        job_timeout=wcfg.job_timeout_s,
        max_tries=wcfg.max_tries + 1,
        keep_result=KEEP_RESULT_S,
        on_startup=on_startup,
        on_shutdown=on_shutdown,
        handle_signals=handle_signals,
        job_completion_wait=wcfg.drain_grace_s,  # type: ignore[arg-type]  # arq accepts float seconds
        allow_abort_jobs=True,
        job_serializer=result_serializer,
        job_deserializer=job_deserializer,
        health_check_interval=max(wcfg.heartbeat_s, 1.0),
        log_results=False,
    )
    worker.ctx[ARQ_WORKER_KEY] = worker  # run_group tells Job.abort() from a drain by it
    return worker


def eval_slots(share: float, slots: int) -> int:
    """Slots of one worker process eval jobs may hold at once: max(1, floor(share x slots))."""
    return max(1, math.floor(share * slots + 1e-9))


# The poll (issue 33). arq 0.28 reads up to `queue_read_limit` (5 x max_jobs) due entries every
# `poll_delay` while a slot is free, and takes each with WATCH/EXISTS/ZSCORE(/MULTI PSETEX EXEC):
# jobs in progress keep their due score at the head of the queue, so every worker with a free slot
# paid for every job in progress, 20 times a second (W x J). Here one script takes what the worker
# can start and moves each entry it looks at out of the due range: a job it takes, or one found in
# progress elsewhere, gets the score now + IN_PROGRESS_RECHECK_S. The due range then holds the jobs
# nobody runs, and a poll costs O(free slots); a job in progress is looked at again once per
# recheck interval by one poller of the cluster (J / recheck a second for all W workers), which is
# how a job whose in-progress key went away without its score coming back (arq's expiry of the
# key, one run by a worker of the version before this poll) becomes due again: within that
# interval. A release by the liveness sweeps puts the job back at its place (`PLACE_PREFIX`).
IN_PROGRESS_RECHECK_S = 5.0
CLAIM_SCAN = 64  # queue entries one poll looks at, at most (a short script under any queue)
IDLE_POLL_MAX_S = 1.0  # a poll that took nothing doubles the wait before the next, up to this
ABORT_CHECK_S = 1.0  # Job.abort() is read this often, and only while jobs run here

_CLAIM_LUA = RECORD_OWNER_LUA + """
-- KEYS: queue zset, then (a worker with liveness) its job set, the counters, the job owners hash
-- ARGV: now (ms, the enqueuers' clock), slots, in-progress key prefix, in-progress ttl (ms),
--       the score of an entry looked at (now + recheck, ms), the place prefix, entries to look at,
--       eval slots free (of slots), the eval scores' bound (ms: eval jobs below it, training above),
--       then (with liveness) the worker id, the running counter
-- -> {1 if it stopped at the look budget (more may be due) else 0, job id, its score, ...} for
--    the jobs taken (in-progress key set to the place prefix + the job's score: its place in the
--    queue, which every release restores, workers/liveness.py), each recorded as the worker's
--    (job set, owner, `running` +1) in this script: no sweep sees it in progress without its owner
local now, slots, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[7])
local taken, looked = {0}, 0
local function scan(low, high, want)
  local got = 0
  while got < want and looked < budget do
    local due = redis.call('ZRANGEBYSCORE', KEYS[1], low, high, 'WITHSCORES', 'LIMIT', 0,
                           math.min(want - got, budget - looked))
    if #due == 0 then break end
    for i = 1, #due, 2 do
      local job = due[i]
      looked = looked + 1
      if redis.call('EXISTS', ARGV[3] .. job) == 0 then
        redis.call('SET', ARGV[3] .. job, ARGV[6] .. due[i + 1], 'PX', ARGV[4])
        if KEYS[2] then record_owner(KEYS[2], KEYS[3], KEYS[4], job, ARGV[10], ARGV[11]) end
        table.insert(taken, job)
        table.insert(taken, due[i + 1])
        got = got + 1
      end
      redis.call('ZADD', KEYS[1], 'XX', ARGV[5], job)
    end
  end
  return got
end
-- eval jobs (queued first) up to their share of the slots, then training jobs for the rest
local evals = scan('-inf', '(' .. ARGV[9], math.min(slots, tonumber(ARGV[8])))
scan(ARGV[9], now, slots - evals)
if looked >= budget then taken[1] = 1 end
return taken
"""


class RolloutWorker(Worker):
    """arq's Worker whose poll costs what its free slots need (arq 0.28; see `_CLAIM_LUA`).

    arq's semantics are kept: the in-progress key (with arq's TTL) marks a job taken, arq's
    `run_job` runs it (tries, retry key, aborts, results), and a job handed back (cancelled by
    a drain, `Retry(defer=...)`) gets its own score back (+ the defer, as arq computes it; an eval
    job its place alone: `back_in_queue_at`), so
    it is due again at once or after its defer, as with arq. A poll that takes nothing backs off
    (doubling up to IDLE_POLL_MAX_S); Job.abort() is read every ABORT_CHECK_S while jobs run.
    A job is this worker's (its liveness job set, owner entry, `running` +1) from the take that
    marks it in progress, in the same script, until arq's `run_job` has returned (`_run_taken`:
    after arq's finish, whichever way the job ended, or failed to): no sweep sees it in progress
    and unowned at any point, so none releases it for a twin (issue 47). A lost reply of the take
    leaves its jobs recorded as ours and not run here: the next heartbeat's reconcile releases them.
    """

    # the take records the job as ours and `_run_taken` ends it: the job functions do neither
    # (workers/jobs.py `start_job`, `end_job`)
    records_jobs_in_take = True

    def __init__(self, *args: Any, eval_slots: int | None = None, eval_prefix: str = "", wake_channel: str = "",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `{ns}:queued_events` ("": none): with a free slot, the poll's interval waits on it
        self.wake_channel = wake_channel
        self._wake: ChannelWake | None = None
        self._never = asyncio.Event()  # the wake's stop: a worker's wait ends by a message, a timeout or a cancel
        # slots eval jobs may hold at once (`workers.eval_share`), told apart by arq job id
        self.eval_slots = self.max_jobs if eval_slots is None else eval_slots
        self.eval_prefix = eval_prefix or "\0"
        self._claim_script: Any = None
        self._scores: dict[str, int] = {}  # the jobs running here -> the score each was taken at
        self._idle_delay_s = self.poll_delay_s
        self._next_claim_at = 0.0
        self._next_abort_check_at = 0.0

    async def _poll_iteration(self) -> None:
        await self._claim_if_due(self.loop.time())
        now = self.loop.time()
        if self.allow_abort_jobs and self.job_tasks and now >= self._next_abort_check_at:
            self._next_abort_check_at = now + ABORT_CHECK_S
            await self._cancel_aborted_jobs()
        for job_id, t in list(self.tasks.items()):
            if t.done():
                del self.tasks[job_id]
                t.result()  # as arq: errors in run_job propagate
        await self.heart_beat()
        await self._wait_for_admission()

    async def _claim_if_due(self, now: float, *, woken: bool = False) -> None:
        """Take jobs for the free slots if the (backed-off) poll is due, or at once when `woken`."""
        free = self.max_jobs - self.job_counter
        if self.allow_pick_jobs and free > 0 and (woken or now >= self._next_claim_at):
            started, more = await self.claim_jobs(free)
            busy = started or more  # `more`: it looked at CLAIM_SCAN jobs in progress; more may be due
            self._idle_delay_s = self.poll_delay_s if busy else min(2 * self._idle_delay_s, IDLE_POLL_MAX_S)
            # arq's poll wakes every poll_delay: the next claim is on the first wake past the wait
            self._next_claim_at = now + self._idle_delay_s - self.poll_delay_s / 2

    async def _wait_for_admission(self) -> None:
        """With a free slot, the rest of the poll interval waits on `{ns}:queued_events`: a message
        (an admission queued jobs) takes them at once. arq's poll loop then sleeps only what is
        left of its interval, so without a message the cadence is arq's."""
        if not self.wake_channel or not self.allow_pick_jobs or self.job_counter >= self.max_jobs:
            return
        if self._wake is None:
            self._wake = ChannelWake(self.pool, self.wake_channel, what="the worker")
        if await self._wake.wait(self._never, self.poll_delay_s):
            await self._claim_if_due(self.loop.time(), woken=True)

    async def close(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            await wake.close()
        await super().close()

    async def claim_jobs(self, slots: int) -> tuple[int, bool]:
        """Take up to `slots` due jobs in one script and start them: (how many were started,
        whether the script stopped at its look budget with more entries perhaps due)."""
        from arq.constants import in_progress_key_prefix
        from arq.utils import timestamp_ms

        if self._claim_script is None:
            self._claim_script = self.pool.register_script(_CLAIM_LUA)
        now_ms = timestamp_ms()
        eval_free = self.eval_slots - sum(job_id.startswith(self.eval_prefix) for job_id in self._scores)
        jobs, more = await self._take([now_ms, slots, in_progress_key_prefix, int(self.in_progress_timeout_s * 1000),
                                       now_ms + int(IN_PROGRESS_RECHECK_S * 1000), PLACE_PREFIX, CLAIM_SCAN,
                                       max(0, eval_free), EVAL_SCORE_MAX])
        for job_id, score in jobs:
            await self.sem.acquire()  # free: slots <= max_jobs - job_counter
            self.job_counter = self.job_counter + 1
            self._scores[job_id] = score
            t = self.loop.create_task(self._run_taken(job_id, score))
            t.add_done_callback(functools.partial(self._job_task_done, job_id))
            self.tasks[job_id] = t
        return len(jobs), more

    async def _take(self, args: list[Any]) -> tuple[list[tuple[str, int]], bool]:
        """Run the take script: ([(job id, its score)] taken, whether it stopped at its look budget).
        With liveness, the script records each job as ours and `_running` notes it (`taking`)."""
        liveness = self._liveness()
        if liveness is None:
            return _taken_jobs(await self._claim_script(keys=[self.queue_name], args=args))
        async with liveness.taking() as ours:
            jobs, more = _taken_jobs(await self._claim_script(keys=[self.queue_name, *liveness.take_keys()],
                                                              args=[*args, *liveness.take_args()]))
            for job_id, _ in jobs:
                ours(job_id)
        return jobs, more

    def _liveness(self) -> Liveness | None:
        """This worker's liveness (None for a plain RolloutWorker: tests, benchmarks)."""
        w: WorkerContext | None = self.ctx.get(CTX_KEY)
        return None if w is None else w.liveness

    async def _run_taken(self, job_id: str, score: int) -> None:
        """arq's `run_job`, then the job leaves this worker's job set (`Liveness.job_ended`): after
        arq's finish of every ending (done, failed, retried, aborted, handed back by a drain, and
        the early ones: arq's "expired", out of tries, aborted before start), never before. Ended
        before, the job would be in progress and owned by nobody meanwhile: a stall there (GIL, a
        loaded host) past half a heartbeat and the orphan sweep released it, for a twin to run it
        again. Ended also when `run_job` failed (a Redis error before its finish): then the job,
        unowned, is released by the sweep rather than held until arq's key expires."""
        try:
            await self.run_job(job_id, score)
        finally:
            liveness = self._liveness()
            if liveness is not None and liveness.runs(job_id):
                await asyncio.shield(liveness.job_ended(job_id))

    def _job_task_done(self, job_id: str, _task: asyncio.Task[None]) -> None:
        self._scores.pop(job_id, None)
        self._release_sem_dec_counter_on_complete()

    async def finish_job(self, job_id: str, finish: bool, result_data: bytes | None, result_timeout_s: float | None,
                         keep_result_forever: bool, incr_score: int | None, keep_in_progress: float | None) -> None:
        """arq's finish of a job that ran (done, failed, retried, aborted, handed back by a drain)."""
        score = self._scores.pop(job_id, None)
        if finish or score is None:
            await super().finish_job(job_id, finish, result_data, result_timeout_s, keep_result_forever, incr_score,
                                     keep_in_progress)
            return
        # handed back: its own place in the queue (+ arq's defer), not the take's recheck score; and
        # only an entry still queued: arq's ZINCRBY (not issued) would add back an entry that is gone
        # (its eval round withdrew it, a twin finished it), a job with no key to run
        await super().finish_job(job_id, finish, result_data, result_timeout_s, keep_result_forever, None,
                                 keep_in_progress)
        await self.pool.zadd(self.queue_name, {job_id: back_in_queue_at(score, incr_score)}, xx=True)


def _taken_jobs(reply: list[Any]) -> tuple[list[tuple[str, int]], bool]:
    """The take script's reply: ([(job id, its score)], whether it stopped at its look budget)."""
    pairs = reply[1:]
    return [(job_id.decode(), int(float(score))) for job_id, score in zip(pairs[::2], pairs[1::2])], bool(int(reply[0]))


def back_in_queue_at(score: int, incr_score: int | None) -> int:
    """The queue score of a job handed back (a drain, `Retry`): its own place + what arq adds (for
    a `Retry(defer=...)`: now + defer - place). An eval job (a score below EVAL_SCORE_MAX) keeps
    its place: at now + defer it would queue behind the training jobs, and the claim would count it
    as one (outside `workers.eval_share`); its function waits out its own backoff instead
    (workers/eval_jobs.py)."""
    return score if score < EVAL_SCORE_MAX else score + (incr_score or 0)


def _set_socket_timeout(pool: Any, url: str) -> None:
    """arq's pool gets the pipeline's timeouts and reconnect policy (`pipeline.store.jobqueue.fit_arq_pool`;
    in Sentinel mode arq passes none of it)."""
    fit_arq_pool(pool, url)


def _quiet_garbage_collector() -> None:
    """Keep full GC passes off the event loop's critical path.

    After startup the heap holds ~1M long-lived objects (transformers, tokenizer,
    jinja); a generation-2 pass over them stalls the loop for 50-100 ms, which is the
    worst event-loop lag at 1,000 concurrent episodes. Freezing moves them out of the
    collector's view; a higher gen-0 threshold makes young passes rarer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


async def _build_context(config: PipelineConfig, keys: Keys, worker_id: str) -> WorkerContext:
    redis = connect(config.redis.resolved_url())
    state = PipelineState(redis, keys)
    ecfg = config.engine
    engine = EngineClient(
        EngineLocator(ecfg.url, state), timeout_s=ecfg.request_timeout_s,
        max_retries=ecfg.max_retries, backoff_s=ecfg.retry_backoff_s,
        clock=PolicyClock(state),  # stamps every call; waits until a trainer has published its run's version
    )
    tokenizer_path = ecfg.tokenizer or await _engine_tokenizer_path(engine)
    chat = ChatTokens(_load_tokenizer(tokenizer_path))
    buffer = LoggingBuffer(redis, keys)  # a rate-limited INFO line per group pushed
    await buffer.ensure_group()
    liveness = Liveness(redis, keys, worker_id, heartbeat_s=config.workers.heartbeat_s,
                        dead_after_s=config.workers.dead_after_s)
    return WorkerContext(config=config, keys=keys, buffer=buffer, engine=engine, chat=chat,
                         liveness=liveness, worker_id=worker_id)


async def _engine_tokenizer_path(engine: EngineClient) -> str:
    """`engine.tokenizer` unset: ask the engine (`/model_info` has `tokenizer_path`), waiting
    (a log line every 10 s) while it is not up yet: slime starts its engines after the workers."""
    logged_at = None
    while True:
        url = await engine.locator.get()
        status, info = await engine.model_info()  # an engine's: a router answers /model_info with 404
        if status == 200 and isinstance(info, dict):
            break
        if status not in (0, 503):
            raise RuntimeError(f"engine.tokenizer is not set and the engine behind {url} answers /model_info "
                               f"with HTTP {status}")
        if logged_at is None or time.monotonic() - logged_at >= 10.0:
            logged_at = time.monotonic()
            log.info("waiting for the engine at %s (not up yet: %s)", url, "no answer" if status == 0 else "HTTP 503")
        engine.locator.invalidate()
        await asyncio.sleep(2.0)
    path = info.get("tokenizer_path")
    if not path:
        raise RuntimeError(f"engine.tokenizer is not set and {url}/model_info has no tokenizer_path")
    log.info("tokenizer from %s/model_info: %s", url, path)
    return str(path)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def stop_worker(worker: Worker, task: asyncio.Task[None], *, timeout_s: float = 30.0) -> None:
    """Stop an in-process worker started with `asyncio.create_task(worker.async_run())`.

    The cancel is repeated until the task ends (bounded): code below arq may absorb one (a
    timeout firing together with it), and an `await task` after a lost cancel waits forever."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the worker task did not stop within {timeout_s:.0f}s of cancelling it")
    with contextlib.suppress(asyncio.CancelledError):
        await task
    try:
        await worker.close()  # gathers arq's job tasks: one cancelled with the worker raises CancelledError
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and getattr(current, "cancelling", lambda: 0)():
            raise  # we are being cancelled ourselves


def run_worker(config: PipelineConfig, *, concurrency: int | None = None) -> None:
    """Run one worker in this process until SIGTERM/SIGINT (drained)."""
    asyncio.set_event_loop(asyncio.new_event_loop())
    try:
        wait_for_redis(config.redis.resolved_url())  # says what it waits for, every few seconds
        build_worker(config, concurrency=concurrency).run()
    except RedisUnavailable as exc:
        log.error("worker stopped: %s", exc)
        raise SystemExit(3) from None
    except aiohttp.ClientError as exc:  # an OSError too: named before the Redis clause below
        log.error("worker stopped: engine %s: %s: %s", config.engine.url, type(exc).__name__, exc)
        raise SystemExit(3) from None
    except (RedisConnectionError, ConnectionError, OSError) as exc:  # e.g. arq's first connect refused
        log.error("worker stopped: redis %s: %s: %s", redact(config.redis.resolved_url()), type(exc).__name__, exc)
        raise SystemExit(3) from None
