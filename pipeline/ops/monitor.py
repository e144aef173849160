"""One consistent picture of a running pipeline, read from Redis (`rollout monitor`,
scripts/monitor.py, shows it; pipeline/ops/metrics.py exports it).

Where each figure comes from:
- queue: arq keeps every queued job in the zset `{ns}:queue` (score = enqueue time
  or defer-until, in ms) until the job finishes; a job being run also has the key
  `arq:in-progress:<job_id>` (arq 0.28 `constants.in_progress_key_prefix`). arq's keys
  are global, but the ids in the queue are `Keys.arq_job_id(group id)` = `{ns}:...`, so
  another pipeline's jobs never count here. ready = due and not in progress, deferred =
  score in the future, running = due and in progress: counted key by key when at most
  MAX_DUE_JOBS_CHECKED jobs are due; past that, the jobs the workers record as running
  (`Counter.RUNNING`, kept by workers/liveness.py's scripts), so a refresh costs
  O(workers + a bounded sample) whatever the queue's length.
- buffer: `GroupBuffer.depth()`; dead letters: XLEN `{ns}:dead`.
- workers: zset `{ns}:workers` id -> last heartbeat (unix s); live = heard from
  within `dead_after_s`. Load = the jobs a worker records as running in
  `{ns}:worker:<id>:jobs` (workers/liveness.py; the reaper releases them).
- admission headroom: `pipeline.staleness.admission_headroom` with `{ns}:trainer`.
- throughput, rewards: the `{ns}:recent` list of `GroupSummary`; the live view and wandb
  switch to counter deltas between refreshes.
- eval rounds: `{ns}:eval_rounds` (in flight: the oldest running, the rest queued) and the
  counts in `{ns}:eval_stats` (pipeline/eval/background.py); eval results: `{ns}:eval_results`,
  per dataset the last round reported (either mode): its pass@1 and reward mean over every task
  with a result, the versions they are reported under, its tasks, failed and mixed ones.
- staleness: of what waits (the groups after the trainer's last-delivered id, seen from the
  current version) and of what was trained recently (`{ns}:trained`, the lag of each group at
  the step that trained it, pipeline/slime/trained_log.py); never of groups trained long ago seen
  from today's version (a group trained at lag 0 twenty-five steps ago is not 25 stale).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipeline.eval.background import round_counts
from pipeline.eval.evaluation import DatasetResult, read_results
from pipeline.keys import TRAINER_GROUP, Counter, Keys
from pipeline.slime.trained_log import recent_steps
from pipeline.staleness import admission_headroom
from pipeline.state import PipelineState, TrainerInfo
from pipeline.store.buffer import GroupBuffer, GroupSummary, summary_decoder

ARQ_IN_PROGRESS_PREFIX = "arq:in-progress:"  # arq 0.28 constants.in_progress_key_prefix
DEFAULT_WINDOW_S = 60.0
DEFAULT_RECENT_N = 500
DEFAULT_DEAD_AFTER_S = 20.0  # WorkersSection.dead_after_s
MAX_DUE_JOBS_CHECKED = 1000  # due jobs probed one by one per refresh; above it the workers' count


# ------------------------------------------------------------------ snapshot


class QueueDepth(msgspec.Struct, kw_only=True):
    ready: int  # due, waiting for a worker slot
    deferred: int  # scheduled for later (retries with a delay)
    running: int  # held by a worker (arq in-progress key; the workers' `running` count)


class WorkerStatus(msgspec.Struct, kw_only=True):
    id: str
    last_heartbeat: float
    age_s: float
    live: bool
    load: int  # jobs (groups) it is running now


class EnvStats(msgspec.Struct, kw_only=True):
    groups: int
    episodes: int
    failed: int
    reward_mean: float
    failure_rate: float  # failed episodes / episodes


class Throughput(msgspec.Struct, kw_only=True):
    source: str  # "recent": groups pushed within the window; "counters": deltas since the last refresh
    span_s: float
    groups_per_min: float
    episodes_per_min: float
    tokens_per_s: float


class MonitorSnapshot(msgspec.Struct, kw_only=True):
    at: float
    namespace: str
    queue: QueueDepth
    running_counter: int  # Counter.RUNNING as workers keep it (should track queue.running)
    buffer_ready: int
    buffer_pending: int
    dead_letters: int
    requeue_waiting: int  # tasks the trainer handed back, not yet re-admitted
    workers: list[WorkerStatus]
    workers_live: int
    policy_version: int
    trainer: TrainerInfo | None
    admission_headroom: int | None  # None until the trainer has published its settings
    counters: dict[str, int]
    throughput: Throughput
    recent_groups: int  # summaries the throughput and env figures are computed from
    # groups trained in the last `trained_steps` steps, by their lag at the step that trained them
    staleness_hist: dict[int, int]
    staleness_max: int | None  # the largest lag of what waits and of what was trained in those steps
    envs: dict[str, EnvStats]
    # groups the trainer rejected as older than eta, and their share of all it read (all time):
    # near 1 is a stale storm (the engines' weights behind the policy version, or eta too small)
    stale_rejected: int = 0
    stale_share: float = 0.0
    # what the trainer would see if it read now: version - admission version of the groups
    # waiting in the buffer (not yet handed out; at most MAX_WAITING_READ of them)
    waiting_staleness_hist: dict[int, int] = {}
    waiting_staleness_max: Union[int, None] = None
    trained_steps: int = 0  # the steps staleness_hist covers (the last trained ones)
    # background evaluation rounds (pipeline/eval/background.py): running (the oldest in flight),
    # queued behind it, skipped (due while pipeline_eval_max_rounds were in flight), reported, failed
    eval_rounds: dict[str, int] = {}
    # per eval dataset, the last round reported (pipeline/eval/evaluation.py `DatasetResult`)
    eval_results: dict[str, DatasetResult] = {}


async def snapshot(
    redis: aioredis.Redis,
    keys: Keys,
    *,
    now: float | None = None,
    window_s: float = DEFAULT_WINDOW_S,
    recent_n: int = DEFAULT_RECENT_N,
    dead_after_s: float = DEFAULT_DEAD_AFTER_S,
) -> MonitorSnapshot:
    """Read every figure of one pipeline from Redis (a handful of round trips)."""
    now = time.time() if now is None else now
    now_ms = int(now * 1000)
    pipe = redis.pipeline(transaction=False)
    pipe.zrangebyscore(keys.queue, "-inf", now_ms, start=0, num=MAX_DUE_JOBS_CHECKED)
    pipe.zcount(keys.queue, "-inf", now_ms)
    pipe.zcount(keys.queue, f"({now_ms}", "+inf")
    pipe.xlen(keys.dead)
    pipe.llen(keys.requeue)
    pipe.zrange(keys.workers, 0, -1, withscores=True)
    pipe.lrange(keys.recent, 0, recent_n - 1)
    due_ids, due, deferred, dead, requeue_waiting, beats, raw_recent = await pipe.execute()

    state = PipelineState(redis, keys)
    version = await state.get_version()
    trainer = await state.get_trainer_info()
    counters = await state.counters()
    ready, pending = await GroupBuffer(redis, keys).depth()
    recorded = max(0, counters.get(Counter.RUNNING, 0))
    due_running = await _count_in_progress(redis, due_ids) if due <= len(due_ids) else min(due, recorded)
    # this version's workers move a job they take out of the due range (workers/settings.py
    # `_CLAIM_LUA`: score now + a recheck interval): those are the running ones counted as deferred
    running = max(due_running, min(due + deferred, recorded))
    deferred = max(0, deferred - (running - due_running))
    workers = await _worker_statuses(redis, keys, beats, now, dead_after_s)
    recent = _decode_summaries(raw_recent)
    waiting = [version - v for v in await _waiting_admission_versions(redis, keys)]
    trained_steps = await recent_steps(redis, keys)
    trained = [lag for step in trained_steps for lag in step.staleness]
    return MonitorSnapshot(
        at=now,
        namespace=keys.ns,
        queue=QueueDepth(ready=due - due_running, deferred=deferred, running=running),
        running_counter=counters.get(Counter.RUNNING, 0),
        buffer_ready=ready,
        buffer_pending=pending,
        dead_letters=dead,
        requeue_waiting=requeue_waiting,
        workers=workers,
        workers_live=sum(w.live for w in workers),
        policy_version=version,
        trainer=trainer,
        admission_headroom=_headroom(trainer, version, counters),
        counters=counters,
        throughput=window_throughput(recent, now, window_s),
        recent_groups=len(recent),
        staleness_hist=dict(sorted(Tally(trained).items())),
        staleness_max=max(trained + waiting, default=None),
        envs=env_stats(recent),
        stale_rejected=counters.get(Counter.STALE, 0),
        stale_share=_share(counters.get(Counter.STALE, 0), counters.get(Counter.ACCEPTED, 0)),
        waiting_staleness_hist=dict(sorted(Tally(waiting).items())),
        waiting_staleness_max=max(waiting, default=None),
        trained_steps=len(trained_steps),
        eval_rounds=await round_counts(redis, keys),
        eval_results=await read_results(redis, keys),
    )


class _Admitted(msgspec.Struct):
    """The one field of a stored SampleGroup the monitor needs (the rest is skipped)."""

    admission_version: int


_admitted_decoder = msgspec.msgpack.Decoder(_Admitted)
MAX_WAITING_READ = 1000


async def _waiting_admission_versions(redis: aioredis.Redis, keys: Keys, limit: int = MAX_WAITING_READ) -> list[int]:
    """Admission versions of the groups after the trainer's last-delivered id (not handed out yet)."""
    try:
        groups = await redis.xinfo_groups(keys.groups)
    except ResponseError:  # no stream yet
        return []
    last = None
    for info in groups:
        name = info.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == TRAINER_GROUP:
            raw = info.get("last-delivered-id")
            last = raw.decode() if isinstance(raw, bytes) else raw
    start = "-" if last in (None, "0-0") else f"({last}"
    out = []
    for _id, fields in await redis.xrange(keys.groups, min=start, max="+", count=limit):
        try:
            out.append(_admitted_decoder.decode(fields[b"g"]).admission_version)
        except (KeyError, msgspec.DecodeError):
            continue  # a foreign or corrupt entry must not blind the monitor
    return out


def _share(part: int, rest: int) -> float:
    return round(part / (part + rest), 4) if part + rest else 0.0


async def _count_in_progress(redis: aioredis.Redis, job_ids: Sequence[bytes]) -> int:
    if not job_ids:
        return 0
    pipe = redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.exists(ARQ_IN_PROGRESS_PREFIX + job_id.decode())
    return sum(await pipe.execute())


async def _worker_statuses(
    redis: aioredis.Redis, keys: Keys, beats: list[tuple[bytes, float]], now: float, dead_after_s: float
) -> list[WorkerStatus]:
    ids = [raw_id.decode() for raw_id, _beat in beats]
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.scard(keys.worker_jobs(worker_id))
    loads = await pipe.execute() if ids else []
    statuses = [
        WorkerStatus(id=worker_id, last_heartbeat=beat, age_s=round(max(0.0, now - beat), 3),
                     live=now - beat <= dead_after_s, load=int(load))
        for worker_id, (_raw, beat), load in zip(ids, beats, loads)
    ]
    return sorted(statuses, key=lambda w: (not w.live, w.id))


def _decode_summaries(raw: Iterable[bytes]) -> list[GroupSummary]:
    out = []
    for item in raw:
        try:
            out.append(summary_decoder.decode(item))
        except msgspec.DecodeError:
            continue  # a foreign or corrupt entry must not blind the monitor
    return out


def _headroom(trainer: TrainerInfo | None, version: int, counters: dict[str, int]) -> int | None:
    if trainer is None:
        return None
    return admission_headroom(
        eta=trainer.eta, version=version, batch_size=trainer.rollout_batch_size,
        admitted=counters.get(Counter.ENQUEUED, 0), discarded=counters.get(Counter.DISCARDED, 0),
    )


def window_throughput(recent: list[GroupSummary], now: float, window_s: float) -> Throughput:
    """Rates over the groups pushed in the last `window_s` seconds.

    The recent list is capped: when even its oldest entry is inside the window, the
    span shrinks to what the list covers, so a fast pipeline is not under-reported.
    """
    inside = [s for s in recent if now - s.pushed_at <= window_s]
    span = window_s
    if recent and len(inside) == len(recent) and len(recent) >= DEFAULT_RECENT_N:
        span = max(1e-3, now - min(s.pushed_at for s in recent))
    return Throughput(
        source="recent", span_s=round(span, 3),
        groups_per_min=60.0 * len(inside) / span,
        episodes_per_min=60.0 * sum(s.episodes for s in inside) / span,
        tokens_per_s=sum(s.tokens for s in inside) / span,
    )


def counter_throughput(previous: MonitorSnapshot, current: MonitorSnapshot) -> Throughput:
    """Rates from counter deltas between two snapshots (exact, whatever the recent cap)."""
    span = max(1e-3, current.at - previous.at)

    def delta(name: str) -> int:
        return max(0, current.counters.get(name, 0) - previous.counters.get(name, 0))

    return Throughput(
        source="counters", span_s=round(span, 3),
        groups_per_min=60.0 * delta(Counter.BUFFERED) / span,
        episodes_per_min=60.0 * delta(Counter.EPISODES) / span,
        tokens_per_s=delta(Counter.TOKENS) / span,
    )


def env_stats(recent: list[GroupSummary]) -> dict[str, EnvStats]:
    by_env: dict[str, list[GroupSummary]] = {}
    for s in recent:
        by_env.setdefault(s.env, []).append(s)
    stats = {}
    for env, groups in sorted(by_env.items()):
        episodes = sum(g.episodes for g in groups)
        failed = sum(g.failed for g in groups)
        stats[env] = EnvStats(
            groups=len(groups), episodes=episodes, failed=failed,
            reward_mean=sum(g.reward_mean for g in groups) / len(groups),
            failure_rate=failed / episodes if episodes else 0.0,
        )
    return stats


_json_encoder = msgspec.json.Encoder()


def to_json(snap: MonitorSnapshot) -> str:
    return _json_encoder.encode(snap).decode()


# ------------------------------------------------------------------ target


@dataclass(frozen=True)
class Target:
    """Where to read from and how to judge liveness, resolved from flags, config and env."""

    redis_url: str
    keys: Keys
    dead_after_s: float
    window_s: float
    recent_n: int

    async def snapshot(self, redis: aioredis.Redis) -> MonitorSnapshot:
        return await snapshot(
            redis, self.keys, window_s=self.window_s, recent_n=self.recent_n, dead_after_s=self.dead_after_s
        )
