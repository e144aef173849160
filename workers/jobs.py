"""The arq job: one PromptJob = one GRPO group = n concurrent episodes, pushed once.

`run_group(ctx, payload)`:
1. decode the PromptJob (poison -> dead-letter stream, counted failed + discarded, no retry);
2. `running` +1, record the job in this worker's job set (for the reaper);
3. run the n episodes concurrently, build the SampleGroup (group_id = job id);
4. push it with the buffer's atomic dedup transaction, which applies `running` -1 and the
   episodes/episodes_failed/tokens counters only when the group is stored;
5. only then return. A failure is retried by arq (`Retry`, jittered) up to
   `workers.max_tries`; the last try's failure goes to the dead-letter stream with
   the error. A job arq re-runs after a crash of its worker past the last try is
   dead-lettered with the last recorded error (e.g. "worker X stopped heart-beating").
   Such transient failures (engine unreachable, env budget spent, worker deaths) also
   hand the task back on `{ns}:requeue` (reason "failed") in the same transaction: the
   producer re-admits it as the next attempt of the same epoch, and its attempt limit
   dead-letters it for good. Poison (undecodable payload, unknown environment) is not
   handed back: it can never succeed.

`ctx["job_id"]` is arq's id, `Keys.arq_job_id(group id)`; it names the job in the
dead-letter `ref`, the reaper's records and `{ns}:job_errors`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from arq.worker import Retry

from pipeline.buffer import GroupBuffer
from pipeline.config import ConfigError, PipelineConfig
from pipeline.keys import Counter, Keys
from pipeline.schema import (
    PromptJob, Requeue, RequeueReason, SampleGroup, SchemaError, Status, decode_job, encode,
)
from workers.chat import ChatTokens
from workers.engine import EngineClient
from workers.envs.base import Environment
from workers.envs.registry import UnknownEnvironmentKind, build_environment
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.liveness import Liveness

log = logging.getLogger(__name__)

CTX_KEY = "rollout"  # where the WorkerContext lives in arq's ctx


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
        last = await w.buffer.redis.hget(w.keys.job_errors, job_id)
        reason = f"job {job_id}: out of tries ({max_tries}); last error: {last.decode() if last else 'unknown'}"
        return await _out_of_tries(w, job, job_id, reason, payload)
    if job_try > 1 and await w.buffer.redis.exists(w.keys.dedup(job.job_id)):
        # A re-run whose earlier try stored the group (its worker died after the push):
        # don't generate n episodes only to have the push refused.
        return {"status": "duplicate", "stream_id": None}
    return await _run_counted(w, job, job_id, job_try, payload)


async def _run_counted(w: WorkerContext, job: PromptJob, job_id: str, job_try: int, payload: bytes) -> dict[str, Any]:
    """Run with `running` held +1 until the push (which releases it) or a failure (released here)."""
    await w.liveness.job_started(job_id)  # running +1 and the reaper's record, atomically
    pushed = False  # the push releases `running` only when it stores the group
    try:
        group = await run_episodes(w, job, job_try)
        stream_id = await w.buffer.push(group, **_push_counters(group))
        pushed = stream_id is not None
        await w.buffer.redis.hdel(w.keys.job_errors, job_id)
        return {"status": "pushed" if pushed else "duplicate", "stream_id": stream_id}
    except PoisonJob as exc:
        await _dead_letter(w, job_id, f"job {job_id}: {exc}", payload)
        return {"status": "dead", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - retried by arq, dead-lettered on the last try
        return await _retry_or_give_up(w, job, job_id, job_try, exc, payload)
    finally:
        # failure, hand-back (CancelledError) or duplicate: no push released `running`
        await asyncio.shield(w.liveness.job_ended(job_id, release_running=not pushed))


async def _retry_or_give_up(
    w: WorkerContext, job: PromptJob, job_id: str, job_try: int, exc: Exception, payload: bytes
) -> dict[str, Any]:
    reason = f"job {job_id} try {job_try}: {type(exc).__name__}: {exc}"
    log.warning("%s", reason, exc_info=not isinstance(exc, GroupFailed))
    if job_try >= w.config.workers.max_tries:
        return await _out_of_tries(w, job, job_id, reason, payload)
    await w.buffer.redis.hset(w.keys.job_errors, job_id, reason[:2000])
    raise Retry(defer=random.uniform(0.5, 1.5) * min(30.0, 2.0**job_try))


async def _out_of_tries(w: WorkerContext, job: PromptJob, job_id: str, reason: str, payload: bytes) -> dict[str, Any]:
    """A transient failure past the last try: dead-letter the job and hand its task back."""
    if await w.buffer.redis.exists(w.keys.dedup(job.job_id)):
        # An earlier try stored the group (its worker died, or the reply was lost, after the push):
        # the job did succeed, and handing the task back would train it twice.
        await w.buffer.redis.hdel(w.keys.job_errors, job_id)
        return {"status": "duplicate", "stream_id": None}
    await _dead_letter(w, job_id, f"{reason} (task handed back for re-admission)", payload, requeue=job)
    return {"status": "dead", "reason": reason}


async def _dead_letter(
    w: WorkerContext, job_id: str, reason: str, payload: bytes, *, requeue: PromptJob | None = None
) -> None:
    """Dead-letter, counted failed + discarded; `requeue`: also put the job's task on `{ns}:requeue`.

    One transaction: the record, the counters and the hand-back exist together or not at all.
    """
    pipe = w.buffer.redis.pipeline(transaction=True)
    w.buffer.stage_dead_letter(pipe, source="jobs", reason=reason, payload=payload, ref=job_id)
    pipe.hincrby(w.keys.counters, Counter.FAILED, 1)
    pipe.hincrby(w.keys.counters, Counter.DISCARDED, 1)
    pipe.hdel(w.keys.job_errors, job_id)
    if requeue is not None:
        back = Requeue(task=requeue.task, epoch=requeue.epoch, attempt=requeue.attempt, reason=RequeueReason.FAILED)
        pipe.rpush(w.keys.requeue, encode(back))
        pipe.hincrby(w.keys.counters, Counter.REQUEUED, 1)
    await pipe.execute()


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


async def run_episodes(w: WorkerContext, job: PromptJob, job_try: int) -> SampleGroup:
    env = w.environment(job.task.env)
    settings = EpisodeSettings.from_config(w.config, env.config, job.sampling)
    runner = EpisodeRunner(w.engine, w.chat, env, settings)
    started = time.time()
    episodes = [runner.run(job.task, f"{job.job_id}/{i}/{job_try}") for i in range(job.n_samples)]
    samples = list(await asyncio.gather(*episodes))
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
        Counter.RUNNING: -1,
        Counter.EPISODES: len(group.samples),
        Counter.EPISODES_FAILED: sum(1 for s in group.samples if s.status is Status.FAILED),
        Counter.TOKENS: sum(int(s.loss_mask_array().sum()) for s in group.samples),
    }
