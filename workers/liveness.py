"""Worker liveness: heartbeats in `{ns}:workers` and one sweep per interval for the cluster.

arq re-runs a SIGKILLed worker's job only when its `arq:in-progress:<id>` key
expires (job_timeout + 10 s: an hour for rollouts). Instead each worker records the
jobs it runs in `{ns}:worker:<id>:jobs` (and each job's owner in `{ns}:job_owners`) and
heart-beats. A heartbeat costs Redis O(the worker's own jobs): the beat, and a reconcile of
its own set. The beat also tries the sweep lease (`{ns}:liveness:lease`, SET NX PX one
heartbeat): the one worker that takes it sweeps for everyone, so the cluster runs one sweep
per interval whatever its size (workers are W, the sweep costs O(dead workers' jobs +
ORPHAN_SCAN), not the O(W x W x J) of every worker walking every job set).
The sweep's reaper: a worker silent for `dead_after_s` is reaped by one Lua script that
deletes the in-progress keys of its jobs (they are still in arq's queue: due again at once, at
the place each had when it was taken, `PLACE_PREFIX`, and started with job_try + 1), notes the cause as the jobs'
last error, gives back the `running` count of every job in its set and forgets the worker.
A job that is re-run pushes its group through the dedup marker, so it is stored once.
A job enters its worker's set in the take that marks it in progress (workers/settings.py
`_CLAIM_LUA`, with `RECORD_OWNER_LUA`) and leaves it only after arq's finish (`RolloutWorker`
calls `job_ended` once `run_job` has returned): recorded later or ended earlier, it would be in
progress and owned by nobody, which the orphan check below releases for a twin to run.
The sweep's orphan check releases jobs in progress that no live worker owns (`_ORPHANS_LUA`); in a
rolling upgrade, a live worker of the version before the owners hash owns what its set holds.
Every part of the sweep costs O(its own work): cursors that do not walk, the rolling-upgrade
lookup only while one is under way, the leftovers of an old version's reaper cleaned in turns.

`running` = the number of jobs in all workers' job sets, by construction: a job counts +1
when it enters its worker's set (SADD that added it) and -1 when it leaves (SREM that
removed it, or the reaper deleting the set), in one script each. Replayed after a lost
reply, the SADD/SREM find nothing to do and the count does not move; a zombie worker's
late `job_ended` after the reaper took its set gives back nothing twice.

Clocks: heartbeats and the reaper's cutoff use Redis `TIME`, not the hosts' clocks, so
clock skew between worker nodes never makes a live worker look dead.

Job ids here are arq's (`Keys.arq_job_id`, `{ns}:{group id}`: arq's keys are global,
so the namespace in the id keeps one pipeline's reaper off another's jobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
from arq.constants import in_progress_key_prefix

from pipeline.keys import Counter, Keys

log = logging.getLogger(__name__)

# A job's place in the queue (its score when it was taken), kept where the take marks it in
# progress: the poll (workers/settings.py `_CLAIM_LUA`) sets arq's in-progress key to PLACE_PREFIX +
# the score it took the job at, in the script that moves the entry out of the due range (now + the
# recheck interval). arq reads only whether that key exists; it lives exactly as long as the take
# (arq's finish deletes it). Every release below (reaper, orphan sweep, reconcile) deletes the
# key in the same script that puts the job back at its place: an eval job (score 1 + i) or the
# oldest training group is due again ahead of every job enqueued after it, not behind them. A key
# without a place (set by a worker of the version before, or by arq itself) releases the job due now.
PLACE_PREFIX = "place:"
_RELEASE_PLACE_LUA = f"""
local function release_place(queue, in_progress_prefix, job, now)
  local held = redis.call('GET', in_progress_prefix .. job)
  redis.call('DEL', in_progress_prefix .. job)
  local place = held and string.match(held, '^{PLACE_PREFIX}(.+)$')
  if place and tonumber(place) then
    redis.call('ZADD', queue, 'XX', place, job)
    return
  end
  local score = redis.call('ZSCORE', queue, job)  -- due now, not at the poll's next recheck
  if score and tonumber(score) > tonumber(now) then redis.call('ZADD', queue, 'XX', now, job) end
end
"""

# Worker job-set keys are derived inside the script (their ids are only known there),
# which is fine on a single Redis; a Redis Cluster would need hash tags.
_REAP_LUA = _RELEASE_PLACE_LUA + """
-- KEYS: workers zset, counters hash, job_errors hash, job owners hash, owner recorders set, queue zset
-- ARGV: dead after (s), job-set key prefix, job-set key suffix, arq in-progress prefix, running counter,
--       now (ms, the queue's clock)
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) + tonumber(t[2]) / 1e6 - tonumber(ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local released = 0
for _, worker in ipairs(dead) do
  local set_key = ARGV[2] .. worker .. ARGV[3]
  local jobs = redis.call('SMEMBERS', set_key)
  for _, job in ipairs(jobs) do
    release_place(KEYS[6], ARGV[4], job, ARGV[6])
    redis.call('HSET', KEYS[3], job, 'worker ' .. worker .. ' stopped heart-beating')
    if redis.call('HGET', KEYS[4], job) == worker then redis.call('HDEL', KEYS[4], job) end
  end
  -- every job in the set holds one `running` count (pushed or not): give them all back
  if #jobs > 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[5], -#jobs)
  end
  released = released + #jobs
  redis.call('DEL', set_key)
  redis.call('ZREM', KEYS[1], worker)
  redis.call('SREM', KEYS[5], worker)
end
return {#dead, released}
"""


# Jobs in progress (arq's in-progress key) that no live worker owns: a take by a worker of the
# version before this one (it recorded the owner after its take, in the job function) whose
# worker died in between, a job whose end was recorded while arq's finish failed, a take by
# plain arq. This version's take records the owner in the script that marks the job in progress,
# so its jobs are never seen so. Ownership is read per job
# from the owners hash (O(1) each), never by walking every worker's set. Each sweep first
# re-checks the suspects of earlier sweeps (released once seen unowned for `min age`: the old
# version's take-to-record window is ms long), then looks at the next ORPHAN_SCAN queue entries from a
# ZSCAN cursor: O(ORPHAN_SCAN) a sweep (no offset walked), and an entry present for a whole pass
# is seen in it whatever its score does meanwhile (this version's poll moves the scores of jobs in
# progress, workers/settings.py), so a queue of any length is covered in turns.
# A rolling upgrade runs workers of the version before the owners hash beside these: they
# record their jobs in their own set only, so a live worker missing from the recorders set
# (every worker of this version is added by its first beat) owns what its set holds. The counts
# of the two sets differ then, and only then: only while they differ is the workers set read and
# are the old workers' job sets asked. An old version's reaper does not know the recorders mark or
# the owners hash: a mark of a worker that is gone is dropped (an SSCAN cursor over the marks,
# ORPHAN_SCAN a sweep, before the counts are compared), an owner entry of a worker that is gone is
# no owner (its job in progress is an orphan) and is deleted once its job is not in progress (an
# HSCAN cursor over the owners hash, ORPHAN_SCAN a sweep).
_ORPHANS_LUA = _RELEASE_PLACE_LUA + """
-- KEYS: queue zset, job owners hash, suspects hash, queue cursor, job_errors hash, workers zset,
--       owner recorders set, cursors hash (owners, recorders)
-- ARGV: entries to look at, arq in-progress prefix, min age (s) of a suspect before it is released,
--       reason, job-set key prefix, suffix, now (ms, the queue's clock)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function live(worker) return redis.call('ZSCORE', KEYS[6], worker) ~= false end
local function page(command, key, field)
  local reply = redis.call(command, key, redis.call('HGET', KEYS[8], field) or '0', 'COUNT', ARGV[1])
  redis.call('HSET', KEYS[8], field, reply[1])
  return reply[2]
end
for _, worker in ipairs(page('SSCAN', KEYS[7], 'recorders')) do
  if not live(worker) then redis.call('SREM', KEYS[7], worker) end
end
local legacy_sets = {}
if redis.call('ZCARD', KEYS[6]) ~= redis.call('SCARD', KEYS[7]) then
  for _, worker in ipairs(redis.call('ZRANGE', KEYS[6], 0, -1)) do
    if redis.call('SISMEMBER', KEYS[7], worker) == 0 then
      table.insert(legacy_sets, ARGV[5] .. worker .. ARGV[6])
    end
  end
end
local function held_by_a_legacy_worker(job)
  for _, set_key in ipairs(legacy_sets) do
    if redis.call('SISMEMBER', set_key, job) == 1 then return true end
  end
  return false
end
local function unowned(job)
  if redis.call('EXISTS', ARGV[2] .. job) == 0 then return false end
  local owner = redis.call('HGET', KEYS[2], job)
  if owner and live(owner) then return false end
  return not held_by_a_legacy_worker(job)
end
local released = {}
local suspects = redis.call('HGETALL', KEYS[3])
for i = 1, #suspects, 2 do
  local job, since = suspects[i], tonumber(suspects[i + 1])
  if not unowned(job) then
    redis.call('HDEL', KEYS[3], job)
  elseif now - since >= tonumber(ARGV[3]) then
    release_place(KEYS[1], ARGV[2], job, ARGV[7])
    redis.call('HSET', KEYS[5], job, ARGV[4])
    redis.call('HDEL', KEYS[3], job)
    redis.call('HDEL', KEYS[2], job)
    table.insert(released, job)
  end
end
local queued = redis.call('ZSCAN', KEYS[1], redis.call('GET', KEYS[4]) or '0', 'COUNT', ARGV[1])
redis.call('SET', KEYS[4], queued[1])
for i = 1, #queued[2], 2 do
  local job = queued[2][i]
  if redis.call('HEXISTS', KEYS[3], job) == 0 and unowned(job) then
    redis.call('HSET', KEYS[3], job, now)
  end
end
local owners = page('HSCAN', KEYS[2], 'owners')
for i = 1, #owners, 2 do
  local job, owner = owners[i], owners[i + 1]
  if not live(owner) and redis.call('EXISTS', ARGV[2] .. job) == 0 then redis.call('HDEL', KEYS[2], job) end
end
return released
"""
_BEAT_LUA = """
-- KEYS: workers zset, sweep lease, owner recorders set; ARGV: worker id, lease (ms).
-- The score is Redis's clock, like the reaper's cutoff. Returns 1 when this beat took the
-- lease: its worker runs this interval's sweep for the whole cluster. A first beat (the ZADD
-- added the worker) also marks it as recording its jobs' owners (no command on later beats).
local t = redis.call('TIME')
if redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1]) == 1 then
  redis.call('SADD', KEYS[3], ARGV[1])
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# A job recorded as a worker's: in its job set, its owner entry, `running` +1, all or nothing
# (SADD that added it), in the script that runs it: `_JOB_LUA` (`job_started`) and the worker's
# take (workers/settings.py `_CLAIM_LUA`, which marks the job in progress in the same script, so
# no sweep ever sees a job of this version in progress without its owner).
RECORD_OWNER_LUA = """
local function record_owner(job_set, counters, owners, job, worker, running)
  if redis.call('SADD', job_set, job) == 0 then return 0 end
  redis.call('HSET', owners, job, worker)
  redis.call('HINCRBY', counters, running, 1)
  return 1
end
"""

# KEYS: worker job set, counters hash, job owners hash
# ARGV: job id, running counter, +1 (start) or -1 (end), worker id
_JOB_LUA = RECORD_OWNER_LUA + """
if tonumber(ARGV[3]) > 0 then return record_owner(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[4], ARGV[2]) end
local changed = redis.call('SREM', KEYS[1], ARGV[1])
if changed == 1 then
  if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[4] then redis.call('HDEL', KEYS[3], ARGV[1]) end
  redis.call('HINCRBY', KEYS[2], ARGV[2], -1)
end
return changed
"""

# KEYS: workers zset, our job set, counters hash, job owners hash, owner recorders set
# ARGV: worker id, running counter
_LEAVE_LUA = """
local jobs = redis.call('SMEMBERS', KEYS[2])
for _, job in ipairs(jobs) do
  if redis.call('HGET', KEYS[4], job) == ARGV[1] then redis.call('HDEL', KEYS[4], job) end
end
if #jobs > 0 then redis.call('HINCRBY', KEYS[3], ARGV[2], -#jobs) end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
return #jobs
"""

# KEYS: our job set, counters hash, job_errors hash, job owners hash, queue zset; ARGV: running
# counter, arq in-progress prefix, reason, worker id, now (ms, the queue's clock), then job ids in our
# Redis set that this process does not run (each put back at its place, due at once). Each is
# released only if it is still there (SREM == 1): a job that ended meanwhile was removed by its
# own job_ended.
_RECONCILE_LUA = _RELEASE_PLACE_LUA + """
local released = 0
for i = 6, #ARGV do
  if redis.call('SREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
    release_place(KEYS[5], ARGV[2], ARGV[i], ARGV[5])
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[3])
    if redis.call('HGET', KEYS[4], ARGV[i]) == ARGV[4] then redis.call('HDEL', KEYS[4], ARGV[i]) end
    released = released + 1
  end
end
return released
"""

# Queue entries (and owner entries) one sweep looks at (the next ones, from cursors that wrap):
# ~1 ms of Redis per interval. A queue of Q jobs is covered in about Q / ORPHAN_SCAN intervals;
# arq's own in-progress expiry (job_timeout + 10 s) is the backstop for an orphan not reached by then.
ORPHAN_SCAN = 250


def _now_ms() -> int:
    """The queue's clock (arq scores jobs by the enqueuer's time, ms)."""
    return int(time.time() * 1000)


class Liveness:
    def __init__(self, redis: aioredis.Redis, keys: Keys, worker_id: str, *, heartbeat_s: float, dead_after_s: float):
        if dead_after_s <= 2 * heartbeat_s:
            raise ValueError(f"dead_after_s ({dead_after_s}) must exceed two heartbeats ({heartbeat_s}s each)")
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._reap = redis.register_script(_REAP_LUA)
        self._orphans = redis.register_script(_ORPHANS_LUA)
        self._beat = redis.register_script(_BEAT_LUA)
        self._job = redis.register_script(_JOB_LUA)
        self._leave = redis.register_script(_LEAVE_LUA)
        self._reconcile = redis.register_script(_RECONCILE_LUA)
        # the arq job ids this process really runs: added before the job's SADD (`job_started`) or
        # by the take that recorded it (under `_taking`), removed after its SREM, so our Redis set is
        # a subset of it outside a take unless Redis lost writes or the reply of a take was lost
        self._running: set[str] = set()
        # held by a take while its script records jobs in our Redis set that `_running` does not
        # hold yet; a reconcile that read the set then would release them (`reconcile`)
        self._taking = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        prefix, _, suffix = keys.worker_jobs("\x00").partition("\x00")
        self._set_prefix, self._set_suffix = prefix, suffix

    async def beat(self) -> bool:
        """Heart-beat; True when this beat took the sweep lease (this interval's sweep is ours)."""
        return bool(await self._beat(keys=[self.keys.workers, self.keys.liveness_lease, self.keys.owner_recorders],
                                     args=[self.worker_id, max(1, int(self.heartbeat_s * 1000))]))

    async def reap(self) -> tuple[int, int]:
        """(dead workers forgotten, jobs released)."""
        dead, released = await self._reap(
            keys=[self.keys.workers, self.keys.counters, self.keys.job_errors, self.keys.job_owners,
                  self.keys.owner_recorders, self.keys.queue],
            args=[self.dead_after_s, self._set_prefix, self._set_suffix, in_progress_key_prefix, Counter.RUNNING,
                  _now_ms()],
        )
        if dead:
            log.warning("reaped %d silent worker(s); released %d job(s) for re-run", dead, released)
        return int(dead), int(released)

    async def release_orphans(self) -> int:
        """Release in-progress jobs no live worker owns, seen unowned in two sweeps half a heartbeat
        apart or more; each sweep looks at the next ORPHAN_SCAN queue entries (and owner entries)."""
        found = await self._orphans(
            keys=[self.keys.queue, self.keys.job_owners, self.keys.orphan_suspects, self.keys.orphan_cursor,
                  self.keys.job_errors, self.keys.workers, self.keys.owner_recorders, self.keys.sweep_cursors],
            args=[ORPHAN_SCAN, in_progress_key_prefix, self.heartbeat_s / 2,
                  "its worker died before recording it", self._set_prefix, self._set_suffix, _now_ms()],
        )
        if found:
            log.warning("released %d orphaned in-progress job(s) for re-run", len(found))
        return len(found)

    async def job_started(self, job_id: str) -> bool:
        """Record the job as ours and count it running, in one script (a crash leaves neither;
        replayed after a lost reply it counts nothing twice). False: it was recorded already."""
        self._running.add(job_id)
        return bool(await self._job(keys=self._job_keys(), args=[job_id, Counter.RUNNING, 1, self.worker_id]))

    async def job_ended(self, job_id: str) -> bool:
        """Forget the job and give back its `running` count, once: False when it was not in our
        set any more (the reaper took it, or this is a replay)."""
        try:
            return bool(await self._job(keys=self._job_keys(), args=[job_id, Counter.RUNNING, -1, self.worker_id]))
        finally:
            self._running.discard(job_id)

    def runs(self, job_id: str) -> bool:
        """Whether this process recorded the job (`job_started`, or its take: `taking`) and has not
        ended it yet."""
        return job_id in self._running

    def take_keys(self) -> list[str]:
        """KEYS a take script passes to `RECORD_OWNER_LUA`'s `record_owner`: our job set, the
        counters, the owners hash."""
        return self._job_keys()

    def take_args(self) -> list[str]:
        """ARGV a take script passes to `record_owner`: our worker id, the `running` counter."""
        return [self.worker_id, Counter.RUNNING]

    @contextlib.asynccontextmanager
    async def taking(self) -> AsyncIterator[Callable[[str], None]]:
        """Hold while a take script records jobs as ours (`RECORD_OWNER_LUA`); call what it
        yields with each job id the take returned. A reconcile does not read our set meanwhile:
        it would see the jobs recorded and not yet run here, and release them for a twin. A take
        whose reply is lost leaves jobs recorded and never run: the next reconcile releases them."""
        async with self._taking:
            yield self._running.add

    async def reconcile(self) -> int:
        """Release the jobs our Redis set holds that this process does not run.

        Two things get there. A Redis that lost acknowledged writes (restarted from an AOF missing
        its last second after a machine crash): a job that ended in the lost second is back in
        our set (its SREM lost) and in arq's queue with its in-progress key, so neither arq nor
        the reaper (we are alive) would ever re-run it, and its admission slot stays held. And a
        take whose reply was lost: its jobs are recorded as ours (owned by a live worker, so the
        orphan sweep leaves them) and never run here. The re-run pushes through the dedup marker:
        stored once.

        Not while a take is recording jobs (`taking`): this beat's reconcile is skipped then and
        the next one reads the set; a take waits at most for a reconcile's one read of it."""
        if self._taking.locked():
            return 0
        async with self._taking:
            recorded = {job.decode() for job in await self.redis.smembers(self.keys.worker_jobs(self.worker_id))}  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
            ghosts = sorted(recorded - self._running)
        if not ghosts:
            return 0
        released = int(await self._reconcile(
            keys=[*self._job_keys()[:2], self.keys.job_errors, self.keys.job_owners, self.keys.queue],
            args=[Counter.RUNNING, in_progress_key_prefix,
                  "its worker no longer ran it (Redis lost writes, or the reply of its take was lost)",
                  self.worker_id, _now_ms(), *ghosts],
        ))
        if released:
            log.warning("released %d job(s) recorded as ours that this worker does not run (Redis lost writes, "
                        "or a take's lost reply?)", released)
        return released

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"liveness-{self.worker_id}")

    def _job_keys(self) -> list[str]:
        return [self.keys.worker_jobs(self.worker_id), self.keys.counters, self.keys.job_owners]

    async def heartbeat(self) -> bool:
        """One round: beat and reconcile our own jobs (O(our jobs)); the worker whose beat took
        the lease also sweeps for the cluster (O(dead workers' jobs + ORPHAN_SCAN)), so the
        cluster pays for one sweep per interval, not one per worker. True: we swept."""
        swept = await self.beat()
        await self.reconcile()
        if swept:
            await self.reap()
            await self.release_orphans()
        return swept

    async def _run(self) -> None:
        while True:
            try:
                await self.heartbeat()
            except Exception as exc:  # noqa: BLE001 - a Redis blip must not stop heart-beating
                log.warning("heartbeat/reaper round failed: %r", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def stop(self) -> None:
        """Stop beating and leave cleanly: no live worker reaps us later."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # jobs still in our set (none after a clean drain) give back their `running` count
        await self._leave(keys=[self.keys.workers, *self._job_keys(), self.keys.owner_recorders],
                          args=[self.worker_id, Counter.RUNNING])
