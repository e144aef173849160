"""Atomic admission: bound check + arq enqueue + counter + cursor in one Lua script.

Why one script: the bound `(eta + v + 1) * B - (enqueued - discarded) > 0` must hold
at every instant, across restarts and several producers. If the enqueue and the
`enqueued` increment were separate calls, a crash between them would either leave a
job nobody counts (the bound leaks upwards) or a count with no job. The cursor (resume
position) moves in the same script, so after a crash the producer resumes exactly
after the last admitted task: nothing skipped, nothing admitted twice. That is
exactly-once admission per (task, epoch) without relying on arq's job-id check, which
forgets a job once its result expires.

The script writes the job the way arq 0.28's `enqueue_job` does (`arq:job:<id>` with
an expiry, `ZADD queue <enqueue ms> <id>`, refused when the job or result key exists),
with the envelope encoded by pipeline.store.jobqueue's msgpack serializer (the workers' own).
Callers pass group ids (`PromptJob.job_id`); the arq id is `Keys.arq_job_id(group id)`,
namespaced because arq's job keys are global.
The bound formula mirrors `pipeline.staleness.admission_headroom` (checked in tests).

Every script that writes is keyed by an operation id (`{ns}:op:<id>`, one per call): it
records its result there in the same script, and a replay (redis-py retries a command whose
reply was lost) returns that result instead of running again. Without it a replayed fresh
admission saw its own cursor move and raised CursorMoved.

After an admission that queued jobs, the number queued is published on `{ns}:queued_events`:
workers with a free slot wait on it and take the jobs at once (workers/settings.py), instead of
at a poll that backs off to a second while the queue is empty, as it is just before every
publish of a policy version. A hint only: lost, the workers' poll finds the jobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from arq.constants import job_key_prefix, result_key_prefix
from redis.exceptions import RedisError
from redis.typing import EncodableT

from pipeline.config import ConfigError, RolloutSection
from pipeline.keys import Counter, Keys
from pipeline.schema import PromptJob
from pipeline.state import TrainerInfo
from pipeline.store.jobqueue import JOB_EXPIRES_MS, job_envelope
from pipeline.store.redis_conn import OP_TTL_S, confirm_replicated, new_op_id

log = logging.getLogger(__name__)

_HEADROOM_LUA = f"""
local function headroom(eta, batch, v)
  local c = redis.call('HMGET', KEYS[2], '{Counter.ENQUEUED}', '{Counter.DISCARDED}')
  return (eta + v + 1) * batch - ((tonumber(c[1]) or 0) - (tonumber(c[2]) or 0))
end
-- The clock a job is admitted against: the version it was built with (its admission_version),
-- if the version has not gone below it since (a trainer resumed from an older checkpoint:
-- nil, build it again). A newer version only makes the bound at the job's clock stricter.
local function admission_clock(expected)
  local now = tonumber(redis.call('GET', KEYS[3]) or '0')
  if expected == '' then return now end
  if tonumber(expected) > now then return nil end
  return tonumber(expected)
end
local function replayed(op_key)
  local done = redis.call('GET', op_key)
  if done then return cjson.decode(done) end
  return nil
end
local function record(op_key, result)
  redis.call('SET', op_key, cjson.encode(result), 'EX', {OP_TTL_S})
  return result
end
local function put_job(job_key, result_key, job_id, envelope, expires, score)
  if redis.call('EXISTS', job_key, result_key) > 0 then return false end
  redis.call('SET', job_key, envelope, 'PX', expires)
  redis.call('ZADD', KEYS[1], score, job_id)
  return true
end
"""

# KEYS: queue, counters, version, cursor, requeue list, op key, open set, then (job key, result key) per job
# ARGV: eta, batch, expires ms, score, cursor field, expected position, expected version ("" = any),
#       then (job id, envelope, group id) per job
# -> {consumed, admitted}; consumed = -1 when the cursor moved under us (another producer),
#    -2 when requeued tasks wait: they go first, else a hand-back that lands between the
#    producer's look at the requeue list and this script would lose its slot to a fresh task
#    (and wait for the next policy version, or forever at the end of a run); -3 when the
#    version went below the one the caller built the jobs with (their admission_version is the
#    clock this script admits them against and records in `{ns}:open`: due-first relies on it).
_FRESH_LUA = _HEADROOM_LUA + f"""
local done = replayed(KEYS[6])
if done then return done end
local pos = tonumber(redis.call('HGET', KEYS[4], ARGV[5]) or '0')
if pos ~= tonumber(ARGV[6]) then return {{-1, pos}} end
if redis.call('LLEN', KEYS[5]) > 0 then return {{-2, 0}} end
local clock = admission_clock(ARGV[7])
if clock == nil then return {{-3, 0}} end
local room = headroom(tonumber(ARGV[1]), tonumber(ARGV[2]), clock)
local n = (#ARGV - 7) / 3
local consumed, admitted = 0, 0
while consumed < n and room > 0 do
  local i = consumed
  if put_job(KEYS[8 + 2 * i], KEYS[9 + 2 * i], ARGV[8 + 3 * i], ARGV[9 + 3 * i], ARGV[3], ARGV[4]) then
    redis.call('ZADD', KEYS[7], clock, ARGV[10 + 3 * i])
    admitted = admitted + 1
    room = room - 1
  end
  consumed = consumed + 1
end
if admitted > 0 then redis.call('HINCRBY', KEYS[2], '{Counter.ENQUEUED}', admitted) end
if consumed > 0 then redis.call('HSET', KEYS[4], ARGV[5], pos + consumed) end
return record(KEYS[6], {{consumed, admitted}})
"""

# KEYS: queue, counters, version, requeue list, attempts hash, job key, result key, op key, open set
# ARGV: eta, batch, expires ms, score, entry bytes (the list head we saw), attempts field,
#       attempts seen, attempt to admit, arq job id, envelope, group id, expected version ("" = any)
# -> -1 head, attempts or version changed (retry), 0 no headroom, 1 admitted, 2 popped but the id was taken
_REQUEUE_LUA = _HEADROOM_LUA + """
local done = replayed(KEYS[8])
if done then return done[1] end
if redis.call('LINDEX', KEYS[4], 0) ~= ARGV[5] then return -1 end
if tonumber(redis.call('HGET', KEYS[5], ARGV[6]) or '0') ~= tonumber(ARGV[7]) then return -1 end
local clock = admission_clock(ARGV[12])
if clock == nil then return -1 end
if headroom(tonumber(ARGV[1]), tonumber(ARGV[2]), clock) <= 0 then return 0 end
redis.call('LPOP', KEYS[4])
redis.call('HSET', KEYS[5], ARGV[6], ARGV[8])
if not put_job(KEYS[6], KEYS[7], ARGV[9], ARGV[10], ARGV[3], ARGV[4]) then return record(KEYS[8], {2})[1] end
redis.call('ZADD', KEYS[9], clock, ARGV[11])
redis.call('HINCRBY', KEYS[2], '""" + Counter.ENQUEUED + """', 1)
return record(KEYS[8], {1})[1]
"""

# KEYS: requeue list, op key, attempts hash; ARGV: the head we saw, the attempts field to forget
# ("" = keep it) -> 1 popped, 0 the head changed (another producer)
_DROP_HEAD_LUA = _HEADROOM_LUA + """
local done = replayed(KEYS[2])
if done then return done[1] end
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[1] then return 0 end
redis.call('LPOP', KEYS[1])
if ARGV[2] ~= '' then redis.call('HDEL', KEYS[3], ARGV[2]) end
return record(KEYS[2], {1})[1]
"""


class CursorMoved(RuntimeError):
    """This epoch's cursor is not where this producer left it: ahead, another producer admits
    in the namespace; behind, Redis lost writes (restarted from an AOF missing its last second)."""

    def __init__(self, message: str, *, position: int = 0):
        super().__init__(message)
        self.position = position


@dataclass(frozen=True)
class Limits:
    """The numbers admission runs with: the trainer's, once it has published them."""

    batch_size: int
    eta: int
    n_samples: int


def resolve_limits(rollout: RolloutSection, trainer: TrainerInfo | None) -> tuple[Limits, list[str]]:
    """Producer settings checked against `{ns}:trainer`.

    n_samples_per_prompt must agree (the trainer refuses groups of another size). For B
    and eta the trainer wins: v counts its steps of B groups, and it is the trainer
    that rejects groups staler than its eta. Disagreements come back as warnings.
    """
    mine = Limits(rollout.rollout_batch_size, rollout.eta, rollout.n_samples_per_prompt)
    if trainer is None:
        return mine, []
    if trainer.n_samples_per_prompt != mine.n_samples:
        raise ConfigError(
            f"rollout.n_samples_per_prompt is {mine.n_samples} but the trainer runs "
            f"n_samples_per_prompt={trainer.n_samples_per_prompt} ({{ns}}:trainer): fix the config"
        )
    warnings = [
        f"rollout.{name} is {ours} but the trainer runs {theirs}; admitting with the trainer's {theirs}"
        for name, ours, theirs in (
            ("rollout_batch_size", mine.batch_size, trainer.rollout_batch_size), ("eta", mine.eta, trainer.eta),
        )
        if ours != theirs
    ]
    return Limits(trainer.rollout_batch_size, trainer.eta, mine.n_samples), warnings


@dataclass(frozen=True)
class Admitted:
    consumed: int  # tasks the cursor moved past (admitted + refused as already queued)
    admitted: int
    requeue_first: bool = False  # nothing done: requeued tasks wait, drain them, then retry
    version_moved: bool = False  # nothing done: the policy version went back (a resume), build the jobs again


class Admission:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, expires_ms: int = JOB_EXPIRES_MS):
        self.redis = redis
        self.keys = keys
        self.expires_ms = expires_ms
        self._fresh = redis.register_script(_FRESH_LUA)
        self._requeue = redis.register_script(_REQUEUE_LUA)
        self._drop_head = redis.register_script(_DROP_HEAD_LUA)

    @property
    def attempts_key(self) -> str:
        """Hash `{task}:{epoch}` -> the highest attempt admitted for that (task, epoch)."""
        return self.keys.requeue_attempts

    def _job_keys(self, group_id: str) -> list[str]:
        arq_id = self.keys.arq_job_id(group_id)
        return [job_key_prefix + arq_id, result_key_prefix + arq_id]

    def _base_keys(self) -> list[str]:
        return [self.keys.queue, self.keys.counters, self.keys.version]

    async def admit_fresh(
        self, limits: Limits, jobs: list[tuple[str, bytes]], *, cursor_field: str, position: int, score_ms: int,
        version: int | None = None,
    ) -> Admitted:
        """Admit a prefix of `jobs` ((group id, envelope), in epoch order) from cursor `position`.

        `version`: the admission_version the jobs carry, the clock they are admitted against (the
        bound at that clock); nothing is admitted if `{ns}:version` went below it since
        (`Admitted.version_moved`: build them again)."""
        job_keys: list[str] = []
        args: list[str | int | bytes] = [
            limits.eta, limits.batch_size, self.expires_ms, score_ms, cursor_field, position,
            "" if version is None else version,
        ]
        for group_id, envelope in jobs:
            job_keys += self._job_keys(group_id)
            args += [self.keys.arq_job_id(group_id), envelope, group_id]
        op_key = self.keys.op(new_op_id())
        keys = [*self._base_keys(), self.keys.cursor, self.keys.requeue, op_key, self.keys.open]
        while True:  # replica acks on: again if a failover lost the script's writes (same op key)
            consumed, admitted = await self._fresh(keys=[*keys, *job_keys], args=args)
            if consumed < 0 or await confirm_replicated(self.redis, witness=op_key):
                break  # (< 0: nothing written, nothing recorded)
        if consumed == -2:
            return Admitted(0, 0, requeue_first=True)
        if consumed == -3:
            return Admitted(0, 0, version_moved=True)
        if consumed < 0:
            raise CursorMoved(f"cursor {self.keys.cursor}[{cursor_field}] is at {admitted}, expected {position}",
                              position=int(admitted))
        await self._announce(int(admitted))
        return Admitted(int(consumed), int(admitted))

    async def admit_requeued(
        self, limits: Limits, head: bytes, *, attempts_field: str, attempts_seen: int, job: PromptJob, score_ms: int
    ) -> int:
        """Move the requeue list's head `head` into the queue as `job`, if the head, the
        (task, epoch)'s attempt count and the policy version (`job.admission_version`) are
        still what the caller saw (-1 otherwise)."""
        op_key = self.keys.op(new_op_id())
        keys = [*self._base_keys(), self.keys.requeue, self.attempts_key, *self._job_keys(job.job_id),
                op_key, self.keys.open]
        args: list[EncodableT] = [limits.eta, limits.batch_size, self.expires_ms, score_ms, head, attempts_field, attempts_seen,
                job.attempt, self.keys.arq_job_id(job.job_id), job_envelope(job, enqueue_time_ms=score_ms),
                job.job_id, job.admission_version]
        while True:  # replica acks on: again if a failover lost the script's writes (same op key)
            result = int(await self._requeue(keys=keys, args=args))
            if result <= 0 or await confirm_replicated(self.redis, witness=op_key):
                break  # (<= 0: nothing written, nothing recorded)
        await self._announce(int(result == 1))
        return result

    async def _announce(self, queued: int) -> None:
        """Wake the workers waiting for jobs (`{ns}:queued_events`). A hint: an error is logged and
        dropped (the jobs are queued; the workers' poll finds them)."""
        if queued <= 0:
            return
        try:
            await self.redis.publish(self.keys.queued_events, queued)
        except (RedisError, OSError) as exc:
            log.debug("could not announce %d queued job(s) on %s: %s", queued, self.keys.queued_events, exc)

    async def drop_requeued(self, head: bytes, *, forget_attempts: str = "") -> bool:
        """Pop the requeue list's head if it is still `head` (False: it changed, look again).
        `forget_attempts`: the task is dead-lettered for good, its attempts field goes with it."""
        op_key = self.keys.op(new_op_id())
        while True:  # replica acks on: again if a failover lost the pop (same op key)
            popped = bool(await self._drop_head(keys=[self.keys.requeue, op_key, self.attempts_key],
                                                args=[head, forget_attempts]))
            if not popped or await confirm_replicated(self.redis, witness=op_key):
                return popped
