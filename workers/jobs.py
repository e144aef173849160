"""The arq job: one PromptJob = one GRPO group = n concurrent episodes, pushed once.

`run_group(ctx, payload)`:
1. decode the PromptJob (poison -> dead-letter stream, counted failed + discarded, no retry);
2. `running` +1, record the job in this worker's job set (for the reaper), in one script: under a
   RolloutWorker its take did that already, in the script that marked the job in progress
   (`start_job`), so the job is never in progress without its owner;
3. run the n episodes concurrently under a soft deadline (`soft_deadline_s`, below arq's
   `job_timeout` with a margin), build the SampleGroup (group_id = job id);
4. push it with the buffer's atomic dedup transaction, which applies the
   episodes/episodes_failed/tokens counters only when the group is stored; `running` -1
   when the job leaves the worker's job set (once, whatever happened);
5. only then return. A group past its soft deadline, or aborted (`Job.abort()`), is
   dead-lettered with the reason and handed back (arq's own timeout stays a backstop that
   the defaults never reach). A bug (TypeError, KeyError, ... : `workers.errors.is_bug`) is
   dead-lettered once with its traceback and not retried or handed back.
   A transient failure is retried by arq (`Retry`, jittered) up to
   `workers.max_tries`; the last try's failure goes to the dead-letter stream with
   the error. A job arq re-runs after a crash of its worker past the last try is
   dead-lettered with the last recorded error (e.g. "worker X stopped heart-beating").
   Such transient failures (engine unreachable, env budget spent, worker deaths) also
   hand the task back in the same transaction: its next attempt of the same epoch is
   enqueued there, at the current admission clock, in the slot the failed one held (no
   producer needs to be running), and past `rollout.max_requeues` it is dead-lettered for good. Poison (undecodable payload, unknown environment) is not
   handed back: it can never succeed. Every hand-back also writes the group's dedup marker
   as a tombstone in its transaction (WATCHing the marker): a zombie worker's late push of
   the group is refused, and a push that landed first turns the hand-back into a no-op.

`ctx["job_id"]` is arq's id, `Keys.arq_job_id(group id)`; it names the job in the
dead-letter `ref`, the reaper's records and `{ns}:job_errors`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec
from arq.constants import job_key_prefix, result_key_prefix
from arq.worker import Retry

from pipeline.config import ConfigError, PipelineConfig
from pipeline.keys import Counter, Keys, attempts_field
from pipeline.schema import (
    PromptJob,
    Sample,
    SampleGroup,
    SchemaError,
    Status,
    decode_job,
    job_id_for,
)
from pipeline.store.buffer import GroupBuffer
from pipeline.store.jobqueue import JOB_EXPIRES_MS, job_envelope
from pipeline.store.redis_conn import REFUSED, run_once
from workers.chat import ChatTokens
from workers.engine import EngineClient
from workers.envs.base import Environment
from workers.envs.registry import UnknownEnvironmentKind, build_environment
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.errors import is_bug
from workers.liveness import Liveness

log = logging.getLogger(__name__)

CTX_KEY = "rollout"  # where the WorkerContext lives in arq's ctx
ARQ_WORKER_KEY = "arq_worker"  # the arq Worker itself (to tell Job.abort() from other cancellations)


def soft_deadline_s(workers: Any) -> float:
    """How long a group may run before it is handed back: `workers.job_timeout_s` minus a margin
    (5 %, at least 60 s, at most half) that covers the hand-back's Redis writes, so arq's hard
    timeout (which drops the job) is never reached."""
    hard = float(workers.job_timeout_s)
    return hard - min(hard / 2, max(60.0, hard * 0.05))


class SoftDeadline(Exception):
    """The group ran past its soft deadline."""


class PoisonJob(Exception):
    """A job that can never succeed (undecodable, unknown environment): dead-letter it at once."""


@dataclass
class WorkerContext:
    """Everything one worker process shares between its jobs."""

    config: PipelineConfig
    keys: Keys
    buffer: GroupBuffer
    engine: EngineClient
    chat: ChatTokens
    liveness: Liveness
    worker_id: str
    environments: dict[str, Environment] = field(default_factory=dict)
    # eval episodes at the engine at once in this process (`workers.eval_share`, workers/eval_jobs.py)
    eval_gate: asyncio.Semaphore | None = None

    def environment(self, name: str) -> Environment:
        env = self.environments.get(name)
        if env is None:
            try:
                env = build_environment(name, self.config.env(name))
            except (ConfigError, UnknownEnvironmentKind, ValueError) as exc:
                raise PoisonJob(str(exc)) from exc
            self.environments[name] = env
        return env

    async def aclose(self) -> None:
        for env in self.environments.values():
            await env.aclose()
        await self.engine.close()


def _recorded_by_its_take(arq_worker: Any) -> bool:
    """Whether the worker running the job recorded it as its own in the take that marked it in
    progress, and ends it after arq's finish (`RolloutWorker.records_jobs_in_take`)."""
    return bool(getattr(arq_worker, "records_jobs_in_take", False))


async def start_job(w: WorkerContext, job_id: str, arq_worker: Any) -> None:
    """Record the job as this worker's (`Liveness.job_started`: job set, owner, `running` +1)
    only when no RolloutWorker runs it (a direct call: tests, bench). A RolloutWorker's take did
    it, in the script that marked the job in progress: recorded here, the job was in progress and
    owned by nobody from the take until now, and two orphan sweeps in that window released it for
    a twin to run (issue 47)."""
    if not _recorded_by_its_take(arq_worker):
        await w.liveness.job_started(job_id)


async def end_job(w: WorkerContext, job_id: str, arq_worker: Any) -> None:
    """The job function's end of `start_job`: give the job up here only when no RolloutWorker
    runs it. A RolloutWorker ends it after arq's `finish_job`: ended here, the job would be in
    progress (arq's key and queue entry) and owned by nobody until that finish, and the orphan
    sweep could release it for a twin to run again."""
    if not _recorded_by_its_take(arq_worker):
        await w.liveness.job_ended(job_id)


async def run_group(ctx: dict[str, Any], payload: bytes) -> dict[str, Any]:
    w: WorkerContext = ctx[CTX_KEY]
    job_id, job_try = str(ctx["job_id"]), int(ctx["job_try"])
    max_tries = w.config.workers.max_tries
    try:
        job = decode_job(payload)
    except SchemaError as exc:
        await _dead_letter(w, job_id, f"job {job_id}: {exc}", payload)
        return {"status": "dead", "reason": str(exc)}
    if job_try > max_tries:
        last = await w.buffer.redis.hget(w.keys.job_errors, job_id)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        reason = f"job {job_id}: out of tries ({max_tries}); last error: {last.decode() if last else 'unknown'}"
        return await _out_of_tries(w, job, job_id, reason, payload)
    if job_try > 1 and await w.buffer.redis.exists(w.keys.dedup(job.job_id)):
        # A re-run whose earlier try stored the group (its worker died after the push):
        # don't generate n episodes only to have the push refused. The job ends here, so does the
        # reaper's note of why it was re-run.
        await w.buffer.redis.hdel(w.keys.job_errors, job_id)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        return await _duplicate(w, job)
    return await _run_counted(w, job, job_id, job_try, payload, ctx.get(ARQ_WORKER_KEY))


async def _run_counted(
    w: WorkerContext, job: PromptJob, job_id: str, job_try: int, payload: bytes, arq_worker: Any = None
) -> dict[str, Any]:
    """Run with `running` held +1 while the job is in this worker's job set."""
    await start_job(w, job_id, arq_worker)  # running +1 and the reaper's record, atomically (or the take's)
    started = time.monotonic()
    soft_s = soft_deadline_s(w.config.workers)
    try:
        group = await _within(run_episodes(w, job, job_try), soft_s)
        stream_id = await w.buffer.push(group, **_push_counters(group))
        await w.buffer.redis.hdel(w.keys.job_errors, job_id)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        if stream_id is None:
            return await _duplicate(w, job)
        return {"status": "pushed", "stream_id": stream_id}
    except PoisonJob as exc:
        await _dead_letter(w, job_id, f"job {job_id}: {exc}", payload)
        return {"status": "dead", "reason": str(exc)}
    except SoftDeadline:
        reason = (f"job {job_id} try {job_try}: ran past its soft deadline of {soft_s:.0f}s "
                  f"(workers.job_timeout_s {w.config.workers.job_timeout_s:.0f}s)")
        log.warning("%s; handing the task back", reason)
        return await _out_of_tries(w, job, job_id, reason, payload)
    except asyncio.CancelledError:
        elapsed = time.monotonic() - started
        if arq_worker is not None and job_id in getattr(arq_worker, "aborting_tasks", ()):
            why = "aborted (Job.abort)"
        elif elapsed >= float(w.config.workers.job_timeout_s) - 0.5:
            why = f"cancelled by arq's job timeout ({w.config.workers.job_timeout_s:.0f}s)"
        else:
            raise  # drain on SIGTERM: arq re-runs the job
        log.warning("job %s try %d %s; handing the task back", job_id, job_try, why)
        await asyncio.shield(_out_of_tries(w, job, job_id, f"job {job_id} try {job_try}: {why}", payload))
        raise
    except Exception as exc:  # noqa: BLE001 - retried by arq, dead-lettered on the last try
        if is_bug(exc):
            return await _bug(w, job_id, job_try, exc, payload)
        return await _retry_or_give_up(w, job, job_id, job_try, exc, payload)
    finally:
        # `running` -1 once: the script gives it back only if the job was still in our set
        await asyncio.shield(end_job(w, job_id, arq_worker))


async def _duplicate(w: WorkerContext, job: PromptJob) -> dict[str, Any]:
    """The group was stored before (or handed back: a tombstone). This job adds nothing to wait
    for: out of `{ns}:open` (a job re-admitted after Redis lost writes would otherwise hold a
    place the trainer keeps for it forever; the stored entry, if any, is read as it is)."""
    await w.buffer.redis.zrem(w.keys.open, job.job_id)
    return {"status": "duplicate", "stream_id": None}


async def _within(coro: Any, seconds: float) -> Any:
    """`await coro`, cancelled and turned into SoftDeadline after `seconds` (an inner
    TimeoutError stays what it is; a cancellation of the caller cancels `coro` too)."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})
        raise SoftDeadline(f"past {seconds:.0f}s")
    return task.result()


async def _bug(w: WorkerContext, job_id: str, job_try: int, exc: Exception, payload: bytes) -> dict[str, Any]:
    """A programming error: dead-lettered once with its traceback; no retry, no hand-back."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    head = f"job {job_id} try {job_try}: a bug, not retried: {type(exc).__name__}: {exc}"
    log.error("%s\n%s", head, tb)
    await _dead_letter(w, job_id, f"{head}\n{tb[-(1900 - len(head)):]}" if len(head) < 1800 else head, payload)
    return {"status": "dead", "reason": head}


async def _retry_or_give_up(
    w: WorkerContext, job: PromptJob, job_id: str, job_try: int, exc: Exception, payload: bytes
) -> dict[str, Any]:
    reason = f"job {job_id} try {job_try}: {type(exc).__name__}: {exc}"
    log.warning("%s", reason, exc_info=not isinstance(exc, GroupFailed))
    if job_try >= w.config.workers.max_tries:
        return await _out_of_tries(w, job, job_id, reason, payload)
    await w.buffer.redis.hset(w.keys.job_errors, job_id, reason[:2000])  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
    raise Retry(defer=random.uniform(0.5, 1.5) * min(30.0, 2.0**job_try))


async def _out_of_tries(w: WorkerContext, job: PromptJob, job_id: str, reason: str, payload: bytes) -> dict[str, Any]:
    """A transient failure past the last try (or past the soft deadline, or aborted): dead-letter
    the job and hand its task back, with the group's dedup marker as a tombstone.

    The marker is WATCHed: if a group was stored first (an earlier try whose worker died, or
    whose reply was lost, after the push; a zombie's late push), the job did succeed and
    handing the task back would train it twice; if the hand-back is first, the tombstone
    refuses any later push of the group."""
    outcome = await _dead_letter(w, job_id, reason, payload, requeue=job)
    if outcome is REFUSED:
        await w.buffer.redis.hdel(w.keys.job_errors, job_id)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        return {"status": "duplicate", "stream_id": None}
    return {"status": "dead", "reason": reason}


async def _dead_letter(
    w: WorkerContext, job_id: str, reason: str, payload: bytes, *, requeue: PromptJob | None = None
) -> Any:
    """Dead-letter, counted failed + discarded; `requeue`: also hand the task back in place and
    write the group's tombstone, unless its dedup marker exists (-> REFUSED).

    Handing back in place: the next attempt (`{task}:{epoch}r{k}`) is enqueued in the same
    transaction, at the current admission clock, keeping the slot (enqueued and discarded both
    +1), so no producer has to be running for a failed task to come back; past
    `rollout.max_requeues` the task is dead-lettered for good. One transaction, once per job id
    (`run_once`): the record, the counters and the hand-back exist together or not at all, and
    a lost reply, a zombie and a re-run apply them once.
    """
    marker = w.keys.dedup(requeue.job_id) if requeue is not None else None
    group_id = _group_id_of(w.keys, job_id)
    nxt = _next_attempt(w, requeue)
    watch = [marker] if marker else []
    if nxt is not None:
        watch += [w.keys.version, *nxt.job_keys]  # the clock and the next id, as read in `guard`
    note = ("" if requeue is None else f" (task handed back as attempt {requeue.attempt + 1})" if nxt else
            f" (task dead-lettered for good: {requeue.attempt} re-admissions, rollout.max_requeues "
            f"{w.config.rollout.max_requeues})")

    def stage(pipe: Any) -> None:
        w.buffer.stage_dead_letter(pipe, source="jobs", reason=reason + note, payload=payload, ref=job_id)
        if group_id:
            pipe.zrem(w.keys.open, group_id)  # it leaves without training: the trainer waits for it no more
        pipe.hincrby(w.keys.counters, Counter.FAILED, 1)
        pipe.hincrby(w.keys.counters, Counter.DISCARDED, 1)
        pipe.hdel(w.keys.job_errors, job_id)
        if requeue is not None:
            w.buffer.stage_tombstone(pipe, requeue.job_id)
        if nxt is not None and nxt.clock is not None:
            nxt.stage(pipe)
        elif nxt is None and group_id:  # dead-lettered for good: its (task, epoch) is done
            pipe.hdel(w.keys.requeue_attempts, attempts_field(group_id))

    async def guard(pipe: Any) -> bool:
        if marker is not None and await pipe.exists(marker):
            return False
        if nxt is not None:
            await nxt.prepare(pipe)
        return True

    return await run_once(w.buffer.redis, w.keys.op(f"job-dead:{job_id}"), stage, watch=watch, guard=guard)


@dataclass
class _NextAttempt:
    """The re-admission of a handed-back task, staged in the hand-back's transaction."""

    w: WorkerContext
    job: PromptJob  # the attempt that failed
    clock: int | None = None  # `{ns}:version` read under WATCH (None: the next job id is taken)

    @property
    def attempt(self) -> int:
        return self.job.attempt + 1

    @property
    def group_id(self) -> str:
        return job_id_for(self.job.task.id, self.job.epoch, self.attempt)

    @property
    def job_keys(self) -> tuple[str, str]:
        arq_id = self.w.keys.arq_job_id(self.group_id)
        return job_key_prefix + arq_id, result_key_prefix + arq_id

    async def prepare(self, pipe: Any) -> None:
        if await pipe.exists(*self.job_keys):
            self.clock = None  # already enqueued (a producer re-admitted it from an older hand-back)
            return
        self.clock = int(await pipe.get(self.w.keys.version) or 0)

    def stage(self, pipe: Any) -> None:
        keys, now = self.w.keys, time.time()
        job = msgspec.structs.replace(self.job, attempt=self.attempt, admission_version=self.clock, enqueued_at=now)
        arq_id = keys.arq_job_id(job.job_id)
        pipe.set(job_key_prefix + arq_id, job_envelope(job, enqueue_time_ms=int(now * 1000)), px=JOB_EXPIRES_MS)
        pipe.zadd(keys.queue, {arq_id: int(now * 1000)})
        pipe.zadd(keys.open, {job.job_id: self.clock})
        pipe.hset(keys.requeue_attempts, job_id_for(job.task.id, job.epoch), self.attempt)
        pipe.hincrby(keys.counters, Counter.ENQUEUED, 1)  # the slot is kept: live = enqueued - discarded
        pipe.hincrby(keys.counters, Counter.REQUEUED, 1)


def _next_attempt(w: WorkerContext, job: PromptJob | None) -> _NextAttempt | None:
    if job is None or job.attempt + 1 > w.config.rollout.max_requeues:
        return None
    return _NextAttempt(w, job)


def _group_id_of(keys: Keys, job_id: str) -> str:
    """The group id of one of our arq job ids ("" for a job id from elsewhere)."""
    try:
        return keys.group_id_of(job_id)
    except ValueError:
        return ""


class GroupFailed(RuntimeError):
    """The environment's `on_failure` policy refuses this group: any failed episode under
    `drop_group`, every episode failed under `retry_all_failed`. Retried like any failure."""


def refuses_group(on_failure: str, failed: int, total: int) -> bool:
    """Whether `on_failure` turns `failed` of `total` failed episodes into a group failure.

    An all-failed group carries no GRPO signal; pushing it during an outage only burns tasks
    at the speed of the retry budgets, so `retry_all_failed` backs off and retries instead.
    """
    if on_failure == "drop_group":
        return failed > 0
    return on_failure == "retry_all_failed" and failed == total


async def run_episodes(w: WorkerContext, job: PromptJob, job_try: int,
                       gate: asyncio.Semaphore | None = None) -> SampleGroup:
    """The job's n episodes at once; with a `gate`, each holds one of its permits while it runs
    (eval jobs: their episodes at the engine are capped, workers/eval_jobs.py)."""
    env = w.environment(job.task.env)
    settings = EpisodeSettings.from_config(w.config, env.config, job.sampling)
    runner = EpisodeRunner(w.engine, w.chat, env, settings, run=w.keys.ns,
                           due_order=job.admission_version if w.config.engine.due_priority else None)
    started = time.time()

    async def run_one(i: int) -> Sample:
        if gate is None:
            return await runner.run(job.task, f"{job.job_id}/{i}/{job_try}", sample_index=i)
        async with gate:
            return await runner.run(job.task, f"{job.job_id}/{i}/{job_try}", sample_index=i)

    episodes = [asyncio.ensure_future(run_one(i)) for i in range(job.n_samples)]
    try:
        samples = list(await asyncio.gather(*episodes))
    except BaseException:
        # one episode raised (a bug): stop its siblings instead of letting them run on unowned
        for episode in episodes:
            episode.cancel()
        await asyncio.gather(*episodes, return_exceptions=True)
        raise
    failed = [s for s in samples if s.status is Status.FAILED]
    if refuses_group(env.config.on_failure, len(failed), len(samples)):
        raise GroupFailed(f"{len(failed)}/{len(samples)} episodes failed: {failed[0].metadata.get('error', '?')}")
    finished = time.time()
    return SampleGroup(
        group_id=job.job_id,
        task=job.task,
        admission_version=job.admission_version,
        n_samples=job.n_samples,
        samples=samples,
        worker_id=w.worker_id,
        epoch=job.epoch,
        attempt=job.attempt,
        timings={
            "queued_s": max(0.0, started - job.enqueued_at) if job.enqueued_at else 0.0,
            "run_s": finished - started,
            "job_try": float(job_try),
        },
    )


def _push_counters(group: SampleGroup) -> dict[str, int]:
    return {
        Counter.EPISODES: len(group.samples),
        Counter.EPISODES_FAILED: sum(1 for s in group.samples if s.status is Status.FAILED),
        Counter.TOKENS: sum(int(s.loss_mask_array().sum()) for s in group.samples),
    }
