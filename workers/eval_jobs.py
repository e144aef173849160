"""The arq eval job: one eval task x n episodes, pushed into its round's own stream.

`run_eval_group(ctx, round_id, payload)` (enqueued by `pipeline/eval/evaluation.py`, name
`EVAL_FUNCTION`) runs the episodes exactly as a training group (`workers.jobs.run_episodes`:
same environments, sampling merge and policy-version stamps) and pushes the group into
`{ns}:eval:<round>` once (an operation key named by the group id, the buffer's dedup pattern),
never into `{ns}:groups`: no dedup marker, no `{ns}:open`, no buffered/episodes counters.
A job that cannot succeed (undecodable, unknown environment, a bug, out of tries, past its
soft deadline) pushes an `error` entry instead, so the trainer's round ends with the reason
rather than at its timeout; nothing is dead-lettered, counted failed or handed back.
The job is in the worker's job set from its take until arq has finished it (a RolloutWorker's
take records it, and the worker ends it once arq's `run_job` returned: `workers.jobs.start_job`,
`end_job`), as every job must be, or the reaper's orphan scan would re-run it: that holds
`running` +1 while it runs and gives it back after, as the reaper does for a dead worker's jobs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from typing import Any

from arq.worker import Retry

from pipeline.eval.evaluation import STREAM_TTL_S
from pipeline.schema import SampleGroup, SchemaError, decode_job, encode
from pipeline.store.redis_conn import ALREADY, REFUSED, run_once
from workers.errors import is_bug
from workers.jobs import (
    ARQ_WORKER_KEY,
    CTX_KEY,
    PoisonJob,
    SoftDeadline,
    WorkerContext,
    _within,
    end_job,
    run_episodes,
    soft_deadline_s,
    start_job,
)

log = logging.getLogger(__name__)


async def run_eval_group(ctx: dict[str, Any], round_id: str, payload: bytes) -> dict[str, Any]:
    """Run the eval job; on every ending (a return: pushed, duplicate or failed) the job's entry in
    `{ns}:job_errors` goes (the reaper's note of why it was re-run): nothing else deletes it."""
    w: WorkerContext = ctx[CTX_KEY]
    job_id = str(ctx["job_id"])
    outcome = await _run_eval_group(w, job_id, int(ctx["job_try"]), round_id, payload, ctx.get(ARQ_WORKER_KEY))
    await w.buffer.redis.hdel(w.keys.job_errors, job_id)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
    return outcome


async def _run_eval_group(w: WorkerContext, job_id: str, job_try: int, round_id: str, payload: bytes,
                          arq_worker: Any = None) -> dict[str, Any]:
    gid = w.keys.group_id_of(job_id)
    max_tries = w.config.workers.max_tries
    try:
        job = decode_job(payload)
    except SchemaError as exc:
        return await _give_up(w, round_id, gid, f"eval job {job_id}: {exc}")
    if job_try > max_tries:  # its worker died on the last try
        return await _give_up(w, round_id, gid, f"eval job {job_id}: out of tries ({max_tries})")
    await start_job(w, job_id, arq_worker)  # or, under a RolloutWorker, its take did
    soft_s = soft_deadline_s(w.config.workers)
    try:
        group = await _within(run_episodes(w, job, job_try, eval_gate(w, arq_worker)), soft_s)
        stored = await push_eval_group(w, round_id, gid, group)
        return {"status": "pushed" if stored else "duplicate"}
    except PoisonJob as exc:
        return await _give_up(w, round_id, gid, f"eval job {job_id}: {exc}")
    except SoftDeadline:
        return await _give_up(w, round_id, gid, f"eval job {job_id} try {job_try}: past its soft deadline {soft_s:.0f}s")
    except Exception as exc:
        reason = f"eval job {job_id} try {job_try}: {type(exc).__name__}: {exc}"
        if is_bug(exc) or job_try >= max_tries:
            log.warning("%s", reason, exc_info=is_bug(exc))
            return await _give_up(w, round_id, gid, reason)
        backoff_s = random.uniform(0.5, 1.5) * min(30.0, 2.0**job_try)
        log.warning("%s; retrying in %.1fs", reason, backoff_s)
        # the backoff here, not as arq's defer: a deferred retry is queued at now + defer, behind
        # the training jobs and outside the eval share; handed back now, it keeps its eval place
        # (workers/settings.py `back_in_queue_at`). The slot is an eval one either way.
        await asyncio.sleep(backoff_s)
        raise Retry() from exc
    finally:
        await asyncio.shield(end_job(w, job_id, arq_worker))  # here, or after arq's finish (RolloutWorker)


def eval_episode_slots(share: float, slots: int, n_samples_per_prompt: int) -> int:
    """Eval episodes one worker process may have at the engine at once: max(1, floor(share x the
    episodes its slots hold with training jobs, slots x n_samples_per_prompt)). Eval and training
    jobs differ in n (a pass@16 eval job is 16 requests), so a cap on job slots alone
    (`workers.settings.eval_slots`) is no cap on the engine's requests."""
    return max(1, math.floor(share * slots * n_samples_per_prompt + 1e-9))


def eval_gate(w: WorkerContext, arq_worker: Any = None) -> asyncio.Semaphore:
    """This process's gate on eval episodes (one permit per episode while it runs), sized from
    the worker's job slots (`--concurrency` over `workers.concurrency`) on first use."""
    if w.eval_gate is None:
        slots = int(getattr(arq_worker, "max_jobs", 0) or w.config.workers.concurrency)
        permits = eval_episode_slots(w.config.workers.eval_share, slots, w.config.rollout.n_samples_per_prompt)
        w.eval_gate = asyncio.Semaphore(permits)
        log.info("eval episodes at the engine: at most %d at once in this worker (workers.eval_share %g of %d slots "
                 "x %d samples)", permits, w.config.workers.eval_share, slots, w.config.rollout.n_samples_per_prompt)
    return w.eval_gate


async def push_eval_group(w: WorkerContext, round_id: str, gid: str, group: SampleGroup | None,
                          error: str = "") -> bool:
    """XADD the group (or its error) to the round's stream, once per group id: False when a
    group or error of that id was pushed already (a re-run, a zombie)."""
    stream = w.keys.eval_stream(round_id)
    fields: dict[str, Any] = {"id": gid, "error": error[:2000]} if group is None else {"id": gid, "g": encode(group)}

    def stage(pipe: Any) -> None:
        pipe.xadd(stream, fields)
        pipe.expire(stream, STREAM_TTL_S)  # a round the trainer gave up on does not stay behind

    result = await run_once(w.buffer.redis, w.keys.op(f"eval-push:{gid}"), stage, ttl_s=STREAM_TTL_S)
    return result is not ALREADY and result is not REFUSED


async def _give_up(w: WorkerContext, round_id: str, gid: str, reason: str) -> dict[str, Any]:
    log.warning("%s; reported to the trainer", reason)
    await push_eval_group(w, round_id, gid, None, reason)
    return {"status": "failed", "reason": reason}
