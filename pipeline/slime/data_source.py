"""The slime side: a data source for `--data-source-path` and a rollout function for
`--rollout-function-path`.

    --data-source-path pipeline.slime.data_source.RedisDataSource
    --rollout-function-path pipeline.slime.data_source.generate_rollout
    --custom-reward-post-process-path pipeline.slime.data_source.post_process_rewards  (recommended)

slime is imported lazily: without it, samples are `LocalSample` (same field names as
`slime.utils.types.Sample`) and the rollout function returns `LocalRolloutOutput`
(same fields as `RolloutFnTrainOutput`), so local runs and tests need no slime.

Checkpoint-aligned delivery: the stream ids handed to rollout step `rid` are
recorded in `{ns}:consumed:{rid}` before they are returned; `save(rid)` acknowledges
(and deletes) everything recorded up to `rid`; after a crash, `load(rid)` makes
every later step `r` replay exactly the groups recorded for `r`, in order.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pipeline.aio import LoopThread
from pipeline.config import ConfigError, EvalMode, TrainerSettings
from pipeline.keys import Counter, Keys, attempts_field
from pipeline.schema import MEASUREMENT_FAILED, Requeue, RequeueReason, SampleGroup, Status, encode
from pipeline.slime.advantages import post_process_rewards  # noqa: F401  (slime loads it by this path)
from pipeline.slime.samples import (  # noqa: F401  (re-exported: slime and tests name them here)
    LocalRolloutOutput,
    LocalSample,
    SampleClass,
    _DataSourceBase,
    _OutputClass,
    from_trainer_group,
    mask_list,
    to_trainer_group,
)
from pipeline.slime.trained_log import record_step
from pipeline.slime.wait_cause import wait_cause
from pipeline.staleness import (
    ConsumeOrder,
    StalePolicy,
    due_clock,
    engine_policy_version,
    label_versions,
    lag_floor,
    places_to_keep,
    staleness,
)
from pipeline.state import PipelineState, TrainerInfo
from pipeline.store.buffer import Entry, GroupBuffer
from pipeline.store.redis_conn import connect, new_op_id, redact, run_once

# the trainer-side log users grep in slime's output, and that the quickstart records: its name stays
# "pipeline.slime" (the module moved into the package: issue 48)
log = logging.getLogger("pipeline.slime")

READ_BLOCK_MS = 1000
READ_ALL = 256  # due-first reads up to this many groups at a time to choose from
TRAINED_MEMORY = 100_000  # group ids remembered as trained by this process (~10 MB)
# slime binds only train/*, rollout/*, multi_turn/*, passrate/*, eval/* and perf/* to its step
# axis in wandb (slime/utils/wandb_utils.py): ours live under rollout/ to land on it.
METRIC_PREFIX = "rollout/pipeline"


# ------------------------------------------------------------- batch stats

@dataclass
class BatchStats:
    wait_s: float = 0.0
    replayed: bool = False
    staleness: list[int] = field(default_factory=list)
    token_lags: dict[int, int] = field(default_factory=dict)  # lag -> trained tokens generated at that lag
    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # env -> rewards of samples not failed
    # env -> samples whose measurement failed (the verifier could not measure: removed, their 0 no reward)
    measurements_failed: Tally[str] = field(default_factory=Tally)
    undecided: Tally[str] = field(default_factory=Tally)  # env -> answers the verifier gave up on, scored 0
    stale: int = 0
    requeued: int = 0
    dropped: int = 0
    kept_stale: int = 0
    filtered: int = 0
    samples_failed: int = 0  # handed over with remove_sample=True
    due: int = 0  # groups due at this step (due-first), the most seen at once
    # an environment's own batch metrics, carried as namespaced reward components ("nemo_rl/success_rate"):
    # env -> name -> values over the step's samples
    env_metrics: dict[str, dict[str, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def add_group(self, group: SampleGroup) -> None:
        # a failed sample's 0 is no reward (it gets no loss): the mean is over the measured ones
        self.rewards[group.env].extend(s.reward for s in group.samples if s.status is not Status.FAILED)
        self.samples_failed += sum(s.status is Status.FAILED for s in group.samples)
        for sample in group.samples:
            if sample.status is Status.FAILED and sample.reward_components.get(MEASUREMENT_FAILED):
                self.measurements_failed[group.env] += 1
            if sample.reward_components.get("undecided") is True:
                self.undecided[group.env] += 1
            for name, value in sample.reward_components.items():
                if "/" in name and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.env_metrics[group.env][name].append(float(value))

    def add_token_lags(self, group: SampleGroup, version: int, run_starts: dict[int, int], current_run: int) -> None:
        """Count the group's trained tokens by their lag at `version` (`SampleGroup.token_version_counts`)."""
        for token_version, tokens in group.token_version_counts(run_starts, current_run).items():
            lag = staleness(version, token_version)
            self.token_lags[lag] = self.token_lags.get(lag, 0) + tokens

    def metrics(self, ready: int, pending: int, counters: dict[str, int]) -> dict[str, float]:
        m: dict[str, float] = {
            f"{METRIC_PREFIX}/buffer_ready": ready,
            f"{METRIC_PREFIX}/buffer_pending": pending,
            f"{METRIC_PREFIX}/wait_s": self.wait_s,
            f"{METRIC_PREFIX}/replayed": float(self.replayed),
            f"{METRIC_PREFIX}/groups_stale": self.stale,
            f"{METRIC_PREFIX}/groups_requeued": self.requeued,
            f"{METRIC_PREFIX}/groups_dropped": self.dropped,
            f"{METRIC_PREFIX}/groups_kept_stale": self.kept_stale,
            f"{METRIC_PREFIX}/groups_filtered": self.filtered,
            f"{METRIC_PREFIX}/samples_failed": self.samples_failed,
            f"{METRIC_PREFIX}/groups_due": self.due,
        }
        if self.staleness:
            m[f"{METRIC_PREFIX}/staleness_mean"] = sum(self.staleness) / len(self.staleness)
            m[f"{METRIC_PREFIX}/staleness_max"] = max(self.staleness)
            for k, count in sorted(Tally(self.staleness).items()):
                m[f"{METRIC_PREFIX}/staleness_hist/{k}"] = count
        if self.token_lags:  # per token: a call that lived through a weight update has tokens of two versions
            tokens = sum(self.token_lags.values())
            m[f"{METRIC_PREFIX}/token_staleness_mean"] = sum(lag * n for lag, n in self.token_lags.items()) / tokens
            m[f"{METRIC_PREFIX}/token_staleness_max"] = max(self.token_lags)
        for env, rewards in self.rewards.items():
            if rewards:
                m[f"{METRIC_PREFIX}/reward_mean/{env}"] = sum(rewards) / len(rewards)
        for env, count in self.measurements_failed.items():
            m[f"{METRIC_PREFIX}/measurements_failed/{env}"] = count
        for env, count in self.undecided.items():
            m[f"{METRIC_PREFIX}/undecided/{env}"] = count
        for env, named in self.env_metrics.items():
            for name, values in named.items():
                m[f"{METRIC_PREFIX}/env/{env}/{name}"] = sum(values) / len(values)
        for name, value in counters.items():
            m[f"{METRIC_PREFIX}/counters/{name}"] = value
        return m


# ---------------------------------------------------------------- data source

class RedisDataSource(_DataSourceBase):
    """slime data source reading whole scored groups from the Redis buffer."""

    def __init__(self, args: Any):
        self.args = args
        self.settings = TrainerSettings.from_args(args)
        self.keys = Keys(self.settings.namespace)
        self._loop = LoopThread()
        self._redis = connect(self.settings.redis_url)
        self.buffer = GroupBuffer(self._redis, self.keys)
        self.state = PipelineState(self._redis, self.keys)
        self.current_rollout_id: int | None = None  # set by generate_rollout
        self._next_rollout_id = 0
        self.last_stats = BatchStats()
        self.update_interval = 1 if getattr(args, "release_train", False) else int(
            getattr(args, "update_weights_interval", None) or 1
        )
        floor = lag_floor(interval=self.update_interval, loop=self.settings.trainer_loop)
        if self.settings.eta < floor:
            raise ConfigError(
                f"pipeline eta {self.settings.eta} is below the lag slime's {self.settings.trainer_loop.value} loop "
                f"imposes with --update-weights-interval {self.update_interval} ({floor}): the engines are always "
                f"{floor} version(s) behind the step being trained, so nothing could be admitted; set eta >= {floor}"
            )
        self.first_rollout_id: int | None = None  # this process's start_rollout_id, once generate_rollout runs
        # slime labels the k-th weight push of a trainer process str(start_version + k)
        self.first_label = int(getattr(args, "update_weight_start_version", None) or 0) + 1
        self._run_starts: dict[int, int] = {}
        self._warned_stale = False
        self._wrong_sized: list[str] = []  # groups of the wrong size met in this read
        # due-first: groups read (pending for our consumer) and not yet taken by a step
        self._held: dict[str, Entry] = {}
        # group ids this process handed to a step (the newest TRAINED_MEMORY): a Redis that lost
        # its last second of writes (AOF everysec, machine crash) delivers acked entries again
        self._trained: dict[str, int] = {}
        self._kept_stale: set[str] = set()  # stream ids kept though stale (StalePolicy.KEEP), counted once
        self._engine_version: int | None = None  # last published
        self._published: dict[str, Any] = {}  # the last publish_policy arguments
        self.ledger = _open_ledger(self.settings.ledger_dir)  # None unless pipeline_ledger_dir is set
        try:
            self._run(self.buffer.ensure_group())
            self._recorded: dict[int, list[str]] = self._run(self._load_recorded())
            # A new trainer process: workers stop stamping with the previous run's versions and
            # wait for this run's first rollout; producers learn B, n and eta now, not minutes later.
            self.run_id: int = self._run(self.state.begin_run())
            self._publish_settings()
        except Exception as exc:
            raise ConnectionError(f"pipeline redis {redact(self.settings.redis_url)}: {type(exc).__name__}: {exc}") from None
        log.info(
            "RedisDataSource on %s ns=%s consumer=%s (%d recorded steps)",
            redact(self.settings.redis_url), self.keys.ns, self.settings.consumer, len(self._recorded),
        )

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro)

    # slime's DataSource interface ------------------------------------------
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        rid = self.current_rollout_id if self.current_rollout_id is not None else self._next_rollout_id
        self.current_rollout_id = None
        self._next_rollout_id = rid + 1
        entries, self.last_stats = self._run(self._take(rid, num_samples))
        base = rid * num_samples
        return [to_trainer_group(entry, base + i) for i, entry in enumerate(entries)]

    def add_samples(self, samples: list[list[Any]]) -> None:
        for group in samples:
            if group:
                wire = from_trainer_group(group)
                self._trained.pop(wire.group_id, None)  # handed back to be trained later: not a duplicate then
                self._run(self.buffer.requeue(wire))

    def save(self, rollout_id: int) -> None:
        """Checkpoint: acknowledge every recorded step <= `rollout_id` (each written to the
        ledger first, when one is configured)."""
        self._run(self._release_through(rollout_id))

    def load(self, rollout_id: int | None = None) -> None:
        """Resume after checkpoint `rollout_id`: steps after it replay their recorded groups."""
        self._recorded = self._run(self._load_recorded())
        if rollout_id is None or rollout_id < 0:
            self._next_rollout_id = 0
            return
        self._run(self._release_through(rollout_id))
        self._next_rollout_id = rollout_id + 1

    def __len__(self) -> int:
        return self._depth()[0]

    def _depth(self) -> tuple[int, int]:
        """(ready, pending): groups held here (read to choose from, not yet taken by a step) count
        as ready, as they did before they were read."""
        ready, pending = self._run(self.buffer.depth())
        return ready + len(self._held), max(0, pending - len(self._held))

    def close(self) -> None:
        try:
            self._run(self._redis.aclose())
        finally:
            self._loop.close()

    # internals -----------------------------------------------------------------
    async def _load_recorded(self) -> dict[int, list[str]]:
        """The recorded, unacknowledged steps, from the `{ns}:steps` index (no keyspace SCAN)."""
        recorded: dict[int, list[str]] = {}
        for member in await self._redis.zrange(self.keys.recorded_steps, 0, -1):
            rid = int(member)
            ids = [i.decode() for i in await self._redis.lrange(self.keys.consumed(rid), 0, -1)]  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
            if ids:
                recorded[rid] = ids
        return dict(sorted(recorded.items()))

    async def _release_through(self, rollout_id: int) -> None:
        for rid in [r for r in self._recorded if r <= rollout_id]:
            if self.ledger is not None:  # the ledger before the ack: a crash in between rewrites it identically
                self._run_starts = await self.state.run_starts()
                ids = self._recorded[rid]
                self.ledger.record_step(rid, ids, await self.buffer.fetch(ids), oldest=self._oldest)
            await self.buffer.ack(self._recorded.pop(rid))
            async with self._redis.pipeline(transaction=True) as pipe:  # both idempotent: safe to repeat
                pipe.delete(self.keys.consumed(rid))
                pipe.zrem(self.keys.recorded_steps, rid)
                await pipe.execute()

    def _claimed_ids(self) -> frozenset[str]:
        return frozenset(i for ids in self._recorded.values() for i in ids)

    async def _take(self, rid: int, n: int) -> tuple[list[Entry], BatchStats]:
        stats = BatchStats()
        started = time.monotonic()
        recorded = self._recorded.setdefault(rid, [])
        entries = await self.buffer.fetch(recorded) if recorded else []
        stats.replayed = bool(entries)
        self._remember_trained(rid, entries)
        version = rid  # the policy that trains this batch has taken `rid` steps
        self._run_starts = await self.state.run_starts()
        due_first = self.settings.consume_order is ConsumeOrder.DUE_FIRST
        last_log, block = started, False
        while len(entries) < n:
            want = n - len(entries)
            # due-first reads everything there is (to choose); arrival reads what it needs
            batch = await self.buffer.read(
                self.settings.consumer, max(want, READ_ALL) if due_first else want,
                block_ms=READ_BLOCK_MS if block or not due_first else None,
                exclude=self._claimed_ids() | frozenset(self._held),
            )
            accepted = [e for e in batch if await self._admit(e, version, stats)]
            if self._wrong_sized:
                await self._drain_wrong_sized(version, stats)
            if due_first:
                await self._hold(accepted)
                accepted = await self._choose_due_first(rid, want, n, started, stats)
            block = not accepted
            if accepted:
                await self._record(rid, accepted)
                recorded.extend(e.stream_id for e in accepted)
                entries.extend(accepted)
            now = time.monotonic()
            if block:
                await self._republish_if_lost()
            self._warn_stale_storm(rid, version, stats, len(entries), n)  # while it waits: no batch fills in a storm
            if block and now - last_log >= self.settings.wait_log_s:
                last_log = now
                await self._log_wait(rid, len(entries), n, stats)
            if self.settings.wait_timeout_s and now - started > self.settings.wait_timeout_s:
                raise TimeoutError(f"rollout {rid}: only {len(entries)}/{n} groups after {self.settings.wait_timeout_s:.0f}s")
        for entry in entries:
            stats.staleness.append(staleness(version, self._oldest(entry.group)))
            stats.add_token_lags(entry.group, version, self._run_starts, self.run_id)
            stats.add_group(entry.group)
        stats.wait_s = time.monotonic() - started
        await record_step(self._redis, self.keys, rid, stats.staleness)  # the monitor's "trained" staleness
        return entries, stats

    async def _hold(self, arrived: list[Entry]) -> None:
        """Keep what arrived to choose from; a second entry of a group already held (a re-run's
        push after Redis lost the first one's dedup marker) is a duplicate."""
        held_groups = {e.group.group_id for e in self._held.values()}
        for entry in arrived:
            if entry.group.group_id in held_groups:
                await self._refuse_duplicate(entry, "another entry of it is already held for training", trained=False)
                continue
            held_groups.add(entry.group.group_id)
            self._held[entry.stream_id] = entry

    async def _record(self, rid: int, taken: list[Entry]) -> None:
        """The step's record, once whatever replies are lost (a replayed RPUSH would record every
        id twice); the groups leave `{ns}:open` in the same transaction."""
        ids = [e.stream_id for e in taken]
        group_ids = [e.group.group_id for e in taken]

        def record(pipe: Any) -> None:
            pipe.rpush(self.keys.consumed(rid), *ids)
            pipe.zadd(self.keys.recorded_steps, {rid: rid})
            pipe.hincrby(self.keys.counters, Counter.ACCEPTED, len(ids))
            pipe.zrem(self.keys.open, *group_ids)
            pipe.hdel(self.keys.requeue_attempts, *{attempts_field(g) for g in group_ids})  # trained: done

        await run_once(self._redis, self.keys.op(new_op_id()), record)
        self._remember_trained(rid, taken)

    def _remember_trained(self, rid: int, taken: list[Entry]) -> None:
        for entry in taken:
            self._trained[entry.group.group_id] = rid
        while len(self._trained) > TRAINED_MEMORY:
            del self._trained[next(iter(self._trained))]

    async def _choose_due_first(self, rid: int, want: int, n: int, started: float, stats: BatchStats) -> list[Entry]:
        """The oldest groups held (by admission clock, then arrival), as many as can be taken now
        without leaving a group past its deadline: a group of clock t must be trained by step
        t + eta, and the steps after this one take n each, so of the R(t) groups still open with
        clock <= t at least R(t) - (t + eta - rid) * n must come from this step. Places for
        those still generating are kept (the step waits for them). By the admission bound this
        is always feasible, so no group is ever left past eta (docs/architecture.md)."""
        clock_of = await self._open_clocks()
        by_group = {e.group.group_id: e for e in self._held.values()}
        for gid, entry in by_group.items():  # groups pushed without admission (tests, benchmarks)
            clock_of.setdefault(gid, entry.group.admission_version)
        eta = self.settings.eta
        stats.due = max(stats.due, sum(c <= due_clock(rid, eta) for c in clock_of.values()))
        waited_out = time.monotonic() - started > self.settings.due_wait_s
        if waited_out:
            await self._give_up_waiting(rid, [g for g, c in clock_of.items()
                                              if g not in by_group and c <= due_clock(rid, eta)])
        reserve = 0 if waited_out else places_to_keep(clock_of, set(by_group), rollout_id=rid, batch_size=n, eta=eta)

        def age(e: Entry) -> tuple[int, tuple[int, ...]]:
            return clock_of[e.group.group_id], tuple(int(x) for x in e.stream_id.split("-"))

        taken = sorted(self._held.values(), key=age)[: max(0, want - reserve)]
        for entry in taken:
            del self._held[entry.stream_id]
        fresh = [e for e in taken if await self._still_fresh(e, rid, stats)]
        self._kept_stale.difference_update(e.stream_id for e in taken)
        return fresh

    async def _open_clocks(self) -> dict[str, int]:
        """`{ns}:open` as group id -> admission clock, without groups this process trained (a
        record whose ZREM Redis lost)."""
        rows = await self._redis.zrange(self.keys.open, 0, -1, withscores=True)
        clock_of = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in rows}
        if trained := [gid for gid in clock_of if gid in self._trained]:
            await self._redis.zrem(self.keys.open, *trained)
            for gid in trained:
                del clock_of[gid]
        return clock_of

    async def _still_fresh(self, entry: Entry, rid: int, stats: BatchStats) -> bool:
        """A group read at an earlier step is checked again at the step that takes it."""
        if staleness(rid, self._oldest(entry.group)) <= self.settings.eta:
            return True
        return await self._admit(entry, rid, stats)  # the stale policy, as at read time

    async def _give_up_waiting(self, rid: int, missing: list[str]) -> None:
        """A due group still not here after `due_wait_s`: stop keeping a place for it (it is
        trained if it arrives within eta, else `stale_policy` applies)."""
        log.warning(
            "rollout %d: %d due group(s) still not pushed after %.1fs (e.g. %s); not waiting for them any more "
            "(pipeline_due_wait_s): a worker may be stuck, or the job was lost", rid, len(missing),
            self.settings.due_wait_s, ", ".join(missing[:3]),
        )
        await self._redis.zrem(self.keys.open, *missing)

    async def _log_wait(self, rid: int, have: int, n: int, stats: BatchStats) -> None:
        """The counts and what holds the step (pipeline/slime/wait_cause.py)."""
        ready, pending = await self.buffer.depth()
        cause = await wait_cause(self._redis, self.keys, due_missing=await self._due_missing(rid))
        log.info("rollout %d: waiting for groups (%d/%d, ready=%d pending=%d held=%d): %s",
                 rid, have, n, ready, pending, len(self._held), cause)

    async def _due_missing(self, rid: int) -> int:
        """Due-first: groups due at this step (admission clock <= rid - eta) not pushed yet."""
        if self.settings.consume_order is not ConsumeOrder.DUE_FIRST:
            return 0
        due = await self._redis.zrangebyscore(self.keys.open, "-inf", due_clock(rid, self.settings.eta))
        held = {e.group.group_id for e in self._held.values()}
        return sum((g.decode() if isinstance(g, bytes) else g) not in held for g in due)

    def _warn_stale_storm(self, rid: int, version: int, stats: BatchStats, taken: int, n: int) -> None:
        """Once per process, as soon as more groups were rejected as stale than a whole batch
        holds and than were taken: checked while the step waits, since in a storm none fills."""
        if stats.stale > max(taken, n) and not self._warned_stale:
            self._warned_stale = True  # once: a storm would otherwise log every step
            log.warning(
                "rollout %d: %d of %d groups read were stale (eta %d): the policy is at version %d, the engines at "
                "%s per the trainer loop law; likely cause: eta below what this loop and --update-weights-interval "
                "need, workers too slow for eta, or a trainer loop that never moves the engines' weights "
                "(pipeline_trainer_loop=%s, see docs/architecture.md 'Off-policy control')",
                rid, stats.stale, stats.stale + taken, self.settings.eta, version,
                self._engine_version, self.settings.trainer_loop.value,
            )

    async def _drain_wrong_sized(self, version: int, stats: BatchStats) -> None:
        """Workers and trainer disagree on n: move every wrong-sized group now in the stream to
        the dead letters in one go (the right-sized ones stay pending for the restarted
        trainer), then stop with one error, instead of one crash per group."""
        seen = self._claimed_ids() | frozenset(self._held)  # pending entries left for the restart are not read again here
        while batch := await self.buffer.read(self.settings.consumer, 256, block_ms=None, exclude=seen):
            for entry in batch:
                seen |= {entry.stream_id}
                if entry.group.n_samples != self.settings.n_samples_per_prompt:
                    await self._admit(entry, version, stats)
        wrong, self._wrong_sized = self._wrong_sized, []
        raise ConfigError(
            f"{len(wrong)} group(s) have a size other than n_samples_per_prompt {self.settings.n_samples_per_prompt}"
            f" (e.g. {wrong[0]}): workers and trainer disagree on n; all were moved to the dead-letter stream"
        )

    def _oldest(self, group: SampleGroup) -> int:
        """The group's oldest token version, seen from this run's branch (after resumes)."""
        return group.oldest_version(self._run_starts, self.run_id)

    async def _admit(self, entry: Entry, version: int, stats: BatchStats) -> bool:
        """Apply the group-size contract, the staleness policy and the zero-variance filter."""
        group = entry.group
        if group.group_id in self._trained:
            return await self._refuse_duplicate(entry, f"it was already trained at rollout {self._trained[group.group_id]}")
        expected = self.settings.n_samples_per_prompt
        if group.n_samples != expected:
            def stage(pipe: Any) -> None:
                self.buffer.stage_dead_letter(
                    pipe, source="groups", reason=f"group has {group.n_samples} samples, trainer expects {expected}",
                    payload=encode(group), ref=entry.stream_id,
                )
                self.buffer.stage_ack(pipe, [entry.stream_id])
                pipe.zrem(self.keys.open, group.group_id)

            # once, whatever replies are lost (the key the buffer's own dead letters use)
            await run_once(self._redis, self.keys.op(f"dead:{self.keys.groups}:{entry.stream_id}"), stage)
            self._wrong_sized.append(f"{group.group_id!r} ({group.n_samples} samples)")
            return False
        if staleness(version, self._oldest(group)) > self.settings.eta:
            stats.stale += 1
            policy = self.settings.stale_policy
            if policy is StalePolicy.KEEP:
                if entry.stream_id in self._kept_stale:  # counted when it was read
                    return True
                self._kept_stale.add(entry.stream_id)
                stats.kept_stale += 1
                stale_count: dict[str, Any] = {Counter.STALE: 1}  # Any: mypy would match it against op_id
                await self.state.incr(**stale_count)
                return True
            if policy is StalePolicy.REQUEUE and self.settings.consume_order is ConsumeOrder.DUE_FIRST:
                # due-first hands nothing back (hands_back 0: a plain `rollout enqueue` may have
                # exited and a requeued task would be lost for the run); only a resume or a due
                # group given up after due_wait_s gets here: dead-lettered with the reason
                why = (f"stale under due-first: lag {staleness(version, self._oldest(group))} > eta {self.settings.eta} "
                       f"at rollout {version} (a resume, or a due group that came after pipeline_due_wait_s); "
                       "due-first hands nothing back to the producer")
                return await self._discard(entry, Counter.STALE, requeue=False, stats=stats, dead_letter=why)
            return await self._discard(entry, Counter.STALE, requeue=policy is StalePolicy.REQUEUE, stats=stats)
        rewards = group.rewards()
        if self.settings.filter_zero_variance and len(set(rewards)) == 1:
            stats.filtered += 1
            return await self._discard(entry, Counter.FILTERED, requeue=False, stats=stats)
        return True

    async def _refuse_duplicate(self, entry: Entry, why: str, *, trained: bool = True) -> bool:
        """A group this process already has (trained at a step, or held) is back: Redis lost the
        ack, or the dedup marker of a re-run's push. Acknowledge it, count it a duplicate."""
        log.warning("group %s (entry %s) not taken: %s (Redis lost writes?); acknowledged as a duplicate",
                    entry.group.group_id, entry.stream_id, why)

        def stage(pipe: Any) -> None:
            pipe.hincrby(self.keys.counters, Counter.DUPLICATES, 1)
            if trained:  # (a held one is still open: due-first keeps counting it)
                pipe.zrem(self.keys.open, entry.group.group_id)
            self.buffer.stage_ack(pipe, [entry.stream_id])

        await run_once(self._redis, self.keys.op(f"duplicate:{self.keys.groups}:{entry.stream_id}"), stage)
        return False

    async def _discard(self, entry: Entry, reason: str, *, requeue: bool, stats: BatchStats,
                       dead_letter: str = "") -> bool:
        """Counters, the optional requeue entry (or dead letter, with its reason) and the ack in
        one transaction: a crash cannot leave the entry pending after it was counted (it would be
        counted twice). Keyed by the stream id (`run_once`): a retry after a lost reply applies
        nothing twice."""
        back = None
        if requeue:
            group = entry.group  # back into its own epoch, as the next attempt (producers/enqueue.py)
            back = encode(Requeue(task=group.task, epoch=group.epoch, attempt=group.attempt, reason=RequeueReason.STALE))
            stats.requeued += 1
        elif reason == Counter.STALE:
            stats.dropped += 1

        def stage(pipe: Any) -> None:
            if back is not None:
                pipe.rpush(self.keys.requeue, back)
                pipe.hincrby(self.keys.counters, Counter.REQUEUED, 1)
            else:  # dropped untrained for good (filter, stale drop, due-first's dead letter): its
                # (task, epoch) ends here, and with it a handed-back task's attempts field
                pipe.hdel(self.keys.requeue_attempts, attempts_field(entry.group.group_id))
            if dead_letter:
                self.buffer.stage_dead_letter(pipe, source="groups", reason=dead_letter, payload=encode(entry.group),
                                              ref=entry.stream_id)
            pipe.hincrby(self.keys.counters, reason, 1)
            pipe.hincrby(self.keys.counters, Counter.DISCARDED, 1)
            pipe.zrem(self.keys.open, entry.group.group_id)
            self.buffer.stage_ack(pipe, [entry.stream_id])

        await run_once(self._redis, self.keys.op(f"discard:{self.keys.groups}:{entry.stream_id}"), stage)
        return False

    # called by generate_rollout ---------------------------------------------------
    def publish(self, rollout_id: int) -> None:
        """At each rollout: the policy version the engines hold (the admission clock and the
        workers' stamp), from slime's loop law (pipeline/staleness.py), and the settings."""
        if self.first_rollout_id is None:
            self.first_rollout_id = rollout_id
        law: dict[str, Any] = {"start": self.first_rollout_id, "interval": self.update_interval,
                               "loop": self.settings.trainer_loop}
        labels = label_versions(rollout_id, **law, first_label=self.first_label)
        self._engine_version = engine_policy_version(rollout_id, **law)
        self._publish_settings()
        self._published = {
            "run": self.run_id, "start": self.first_rollout_id, "engine_version": self._engine_version,
            "rollout_id": rollout_id, "labels": dict(list(labels.items())[-2:]),  # the current and the next push
        }
        self._run(self.state.publish_policy(**self._published))

    async def _republish_if_lost(self) -> None:
        """While a step waits: the trainer is the source of the policy version. If Redis lost it
        (restarted from an AOF missing its tail), producers would wait for a version the trainer
        will only publish after this step, which waits for their groups: publish it again."""
        if self._published and await self.state.get_version() != self._published["engine_version"]:
            log.warning("%s went back to %s (Redis lost writes?); publishing version %d again",
                        self.keys.version, await self.state.get_version(), self._published["engine_version"])
            await self.state.publish_policy(**self._published)

    def _publish_settings(self) -> None:
        s = self.settings
        self._run(self.state.set_trainer_info(
            TrainerInfo(rollout_batch_size=s.rollout_batch_size, n_samples_per_prompt=s.n_samples_per_prompt, eta=s.eta,
                        hands_back=int(s.consume_order is ConsumeOrder.ARRIVAL and s.stale_policy is StalePolicy.REQUEUE))
        ))
        ip, port = getattr(self.args, "sglang_router_ip", None), getattr(self.args, "sglang_router_port", None)
        if s.publish_engine and ip and port:
            self._run(self.state.set_engine(f"http://{ip}:{port}"))

    def batch_metrics(self) -> dict[str, float]:
        ready, pending = self._depth()
        counters = self._run(self.state.counters())
        return self.last_stats.metrics(ready, pending, counters)


def _open_ledger(directory: str) -> Any:
    if not directory:
        return None
    from pipeline.ops.ledger import Ledger, LedgerError, require_pyarrow

    try:
        require_pyarrow()
    except LedgerError as exc:
        raise ConfigError(f"pipeline_ledger_dir {directory!r}: {exc}") from None
    return Ledger(directory)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime rollout function: exactly rollout_batch_size whole groups from the buffer.

    It never aborts engine requests: generation belongs to the workers. `evaluation=True`
    (slime calls the rollout function for eval when `--eval-function-path` is unset) runs
    slime's own evaluation: fixed prompts at the current policy, not the off-policy stream.
    """
    if evaluation:
        if getattr(getattr(data_source, "settings", None), "eval_datasets", ""):
            from pipeline.slime.eval_entry import evaluate  # multi-turn, through the workers (pipeline_eval_datasets)

            if not isinstance(data_source, RedisDataSource):
                raise TypeError("pipeline evaluation (pipeline_eval_datasets) needs --data-source-path "
                                "pipeline.slime.data_source.RedisDataSource")

            return evaluate(args, rollout_id, data_source)
        return _slime_eval(args, rollout_id)
    if not isinstance(data_source, RedisDataSource):
        raise TypeError(
            f"pipeline.slime.data_source.generate_rollout needs --data-source-path pipeline.slime.data_source.RedisDataSource, "
            f"got {type(data_source).__module__}.{type(data_source).__name__}"
        )
    batch_size = int(getattr(args, "rollout_batch_size", data_source.settings.rollout_batch_size))
    data_source.publish(rollout_id)
    if data_source.settings.eval_mode is EvalMode.BACKGROUND and data_source.settings.eval_datasets:
        from pipeline.eval.background import report_finished

        report_finished(args, data_source)  # background eval rounds that ended: logged now, never waited for
    data_source.current_rollout_id = rollout_id
    groups = data_source.get_samples(batch_size)
    metrics = data_source.batch_metrics()
    return _OutputClass(samples=groups, metrics=metrics)


def _slime_eval(args: Any, rollout_id: int) -> Any:
    """slime's `eval_rollout` over `--eval-prompt-data` on slime's engines, as its stock
    `sglang_rollout.generate_rollout(evaluation=True)` does, minus that function's
    `rollout_global_dataset` assertion, which concerns training data this pipeline supplies."""
    try:
        from slime.rollout.sglang_rollout import eval_rollout
        from slime.utils.async_utils import run
    except ImportError as exc:
        raise ConfigError(
            "pipeline.slime.data_source.generate_rollout(evaluation=True) runs slime's eval_rollout, but slime is not "
            f"importable here ({exc}); evaluation needs slime and --eval-prompt-data"
        ) from exc
    output, _aborted = run(eval_rollout(args, rollout_id))
    return output
