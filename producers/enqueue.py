"""`rollout enqueue`: stream tasks.jsonl into arq as PromptJobs under the staleness bound.

    rollout enqueue --tasks tasks.jsonl --config pipeline.yaml [--epochs 3] [--follow]

- Admission: only while `(eta + v + 1) * B - (enqueued - discarded) > 0` (docs/architecture.md),
  checked and applied atomically in Redis (producers/admission.py). With no headroom
  it waits for the trainer's next version (pub/sub on `{ns}:version_events`, woken the moment
  it is published) or `--poll` seconds, whichever comes first, then looks again (never spins).
- Order: seeded shuffle per epoch and per environment, environments interleaved by
  their configured weights (producers/task_index.py). Every task once per epoch.
- Resume: `{ns}:cursor` holds the position per epoch, moved in the same script as the
  enqueue; a restarted producer continues right after the last admitted task.
- Requeue: groups that left without training (`{ns}:requeue` entries `Requeue(task,
  epoch, attempt, reason)`: stale-rejected by the trainer side, or failed out of tries
  in a worker) are admitted first, in *their own* epoch as the next attempt, under the
  fresh id `{task}:{epoch}r{attempt+1}`; after `--max-requeues` re-admissions of one
  (task, epoch) the entry goes to the dead-letter stream instead.
- A plain run exits once every epoch is admitted and the requeue list is empty, and, when the
  trainer hands stale groups back (arrival order: `{ns}:trainer` hands_back), no group it
  admitted is still open; `--follow` keeps going with further epochs and keeps draining requeues.
- Nothing is admitted before the trainer has published its settings (`{ns}:trainer`: B,
  eta, n): admitting `(eta + 1) * B` on this config's own numbers could overshoot the
  trainer's bound. It logs that it waits every few seconds; `--without-trainer`
  (`ProducerOptions(wait_for_trainer=False)`) admits on the config's numbers instead.
- Redis unreachable past `$ROLLOUT_REDIS_OUTAGE_S` (30 s): exits with one line.
- The CLI checks the environments (kinds, options) and every task (what its kind needs, e.g. a
  math task's label) before connecting (`workers/validate.py`); logs progress every `--progress`
  seconds and, when blocked, which policy version it waits for; ends with a summary (`--json`).
  Exit codes: 0 done, 2 usage or configuration, 3 Redis unreachable.

`run_producer(...)` is the programmatic entry point (used by the demo).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python producers/enqueue.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.keys import Counter, Keys, attempts_field
from pipeline.schema import PromptJob, SchemaError, Task, decode_requeue, job_id_for
from pipeline.sizing import SizingAdvice, below_advice, load_advice
from pipeline.staleness import admission_headroom
from pipeline.state import PipelineState, TrainerInfo, VersionWake
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import connect, redact
from pipeline.usage import usage_error
from producers.admission import Admission, CursorMoved, Limits, job_envelope, resolve_limits
from producers.task_index import TaskIndex, TaskReader
from workers.validate import check_environments, check_tasks

log = logging.getLogger("rollout.enqueue")

FINGERPRINT_FIELD = "fingerprint"


@dataclass
class ProducerStats:
    admitted: int = 0  # fresh tasks admitted
    requeued: int = 0  # requeued tasks re-admitted
    refused: int = 0  # id already queued or finished (duplicate task id, second producer, repeated hand-back)
    dead: int = 0  # requeue entries given up on (max requeues, undecodable)
    epochs_done: int = 0
    waits: int = 0  # waits for headroom or the trainer
    woken: int = 0  # of those, ended by a published version (the rest: the poll interval or a stop)
    wait_s: float = 0.0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProducerOptions:
    epochs: int = 1
    follow: bool = False
    seed: int = 0
    batch: int = 64  # jobs offered per admission script call
    # the longest wait between looks at the version/counters: a published version wakes the producer
    # at once (VersionWake), so this only bounds what the wake-up cannot see (a discard freeing
    # headroom, a lost message, a Redis without pub/sub); a stop ends any wait at once
    poll_s: float = 0.1
    max_requeues: int | None = None  # re-admissions per (task, epoch) before it is dead-lettered (None: rollout.max_requeues)
    reset_cursor: bool = False  # forget positions (not counters) when tasks/seed/weights changed
    wait_for_trainer: bool = True  # admit nothing until the trainer has published {ns}:trainer
    wait_log_s: float = 5.0  # how often to say that it waits for the trainer
    progress_s: float = 10.0  # how often to log progress (admitted so far; what it waits for)


def _sizing_advice(path: str) -> SizingAdvice | None:
    """`rollout.sizing_advice`, read once at start (a bad file is a configuration error)."""
    if not path:
        return None
    try:
        return load_advice(path)
    except ValueError as exc:
        raise ConfigError(f"rollout.sizing_advice: {exc}") from exc


class Producer:
    def __init__(self, redis: aioredis.Redis, config: PipelineConfig, index: TaskIndex, options: ProducerOptions):
        self.redis = redis
        self.config = config
        self.keys = Keys(config.redis.namespace)
        self.index = index
        self.options = options
        self.weights = {name: env.weight for name, env in config.environments.items()}
        self.state = PipelineState(redis, self.keys)
        self.admission = Admission(redis, self.keys)
        self.buffer = GroupBuffer(redis, self.keys)
        self.reader = TaskReader(index.path)
        self.wake = VersionWake(redis, self.keys.version_events)
        self.stats = ProducerStats()
        self.limits = Limits(1, 0, 1)
        self.epoch = 0
        self._started = time.monotonic()
        self._last_progress = time.monotonic()
        self._position_now = 0
        self._blocked = False  # the last batch found no headroom (logged at once when it starts)
        self._trainer: TrainerInfo | None = None  # {ns}:trainer as last read
        self.advice = _sizing_advice(config.rollout.sizing_advice)

    # ------------------------------------------------------------ main loop
    async def run(self, stop: asyncio.Event) -> ProducerStats:
        try:
            await self._check_cursor()
            if not await self._await_trainer(stop):
                return self.stats
            self.epoch = await self._first_open_epoch()
            order = self._order_from_cursor(await self._position())
            while not stop.is_set():
                await self._refresh_limits()
                if await self._drain_requeue() == "blocked":
                    await self._wait(stop)
                    continue
                if not self._epoch_wanted():
                    if await self._handed_back_work_may_come():
                        await self._wait(stop)
                        continue
                    break
                progress = await self._admit_batch(order)
                self._position_now = order.position
                await self._log_progress(blocked=progress == "blocked")
                if progress == "epoch-done":
                    self.stats.epochs_done += 1
                    self.epoch += 1
                    order = self._order_from_cursor(0)
                elif progress == "blocked":
                    await self._wait(stop)
        finally:
            self.reader.close()
            await self.wake.close()
        return self.stats

    async def _log_progress(self, *, blocked: bool) -> None:
        """Every `progress_s`: what was admitted, and when blocked, which policy version it waits for."""
        now = time.monotonic()
        first_block = blocked and not self._blocked
        self._blocked = blocked
        if now - self._last_progress < self.options.progress_s and not first_block:
            return
        self._last_progress = now
        size = self.index.epoch_size(self.weights)
        line = (f"admitted {self.stats.admitted} fresh + {self.stats.requeued} requeued in {now - self._started:.0f}s; "
                f"epoch {self.epoch}: {self._position_now}/{size}")
        if blocked:
            counters = await self.state.counters()
            live = counters.get(Counter.ENQUEUED, 0) - counters.get(Counter.DISCARDED, 0)
            version = await self.state.get_version()
            B, eta = self.limits.batch_size, self.limits.eta
            needed = max(version + 1, live // max(1, B) - eta)
            line += (f"; waiting for the trainer to reach policy version {needed} (now {version}): "
                     f"{live} groups admitted and not discarded = (eta {eta} + v {version} + 1) x B {B} or more")
        log.info(line)

    async def _await_trainer(self, stop: asyncio.Event) -> bool:
        """Wait until the trainer has published its settings (False: stopped while waiting)."""
        if not self.options.wait_for_trainer:
            return True
        started = time.monotonic()
        last_log: float | None = None
        while await self.state.get_trainer_info() is None:
            now = time.monotonic()
            if last_log is None or now - last_log >= self.options.wait_log_s:
                log.info("waiting for the trainer to publish %s (B, eta, n) before admitting anything (%.0fs); "
                         "--without-trainer admits on this config's numbers", self.keys.trainer, now - started)
                last_log = now
            await self._wait(stop)
            if stop.is_set():
                return False
        return True

    def _epoch_wanted(self) -> bool:
        return self.options.follow or self.epoch < self.options.epochs

    async def _wait(self, stop: asyncio.Event) -> None:
        """Until the trainer publishes a version, or one poll interval; the next loop re-reads v and
        counters. A cancel while waiting always propagates."""
        self.stats.waits += 1
        started = time.monotonic()
        await self.wake.wait(stop, self.options.poll_s)
        self.stats.woken = self.wake.wakes
        self.stats.wait_s += time.monotonic() - started

    async def _handed_back_work_may_come(self) -> bool:
        """A plain run has admitted its epochs; in arrival order the trainer hands stale groups back
        to `{ns}:requeue` for this producer to re-admit, so it stays while any group it admitted is
        still open (not trained, not given up) or handed back and not re-admitted yet. Both are read
        in one transaction: the trainer's hand-back moves a group from `{ns}:open` to `{ns}:requeue`
        in one, so two reads apart (the requeue found empty before it, `open` after it) saw neither
        and the run exited with the task left in the requeue for nobody."""
        if self._trainer is None or not self._trainer.hands_back:
            return False
        pipe = self.redis.pipeline(transaction=True)
        pipe.zcard(self.keys.open)
        pipe.llen(self.keys.requeue)
        open_groups, handed_back = (int(n) for n in await pipe.execute())
        if handed_back:
            return True  # the next loop re-admits it
        now = time.monotonic()
        if open_groups and now - self._last_progress >= self.options.progress_s:
            self._last_progress = now
            log.info("all epochs admitted; %d admitted group(s) not trained yet: staying to re-admit what the trainer "
                     "hands back (it consumes in arrival order, stale_policy requeue); Ctrl-C to stop", open_groups)
        return open_groups > 0

    async def _refresh_limits(self) -> None:
        self._trainer = await self.state.get_trainer_info()
        limits, warnings = resolve_limits(self.config.rollout, self._trainer)
        if self.advice is not None:
            below = below_advice(self.advice, batch=limits.batch_size, eta=limits.eta, n=limits.n_samples)
            warnings += [below] if below else []
        for warning in warnings:
            if warning not in self.stats.warnings:
                self.stats.warnings.append(warning)
                log.warning(warning)
        self.limits = limits

    async def headroom(self) -> int:
        counters = await self.state.counters()
        return admission_headroom(
            eta=self.limits.eta, version=await self.state.get_version(), batch_size=self.limits.batch_size,
            admitted=counters.get(Counter.ENQUEUED, 0), discarded=counters.get(Counter.DISCARDED, 0),
        )

    # ------------------------------------------------------------ fresh tasks
    def _cursor_field(self, epoch: int) -> str:
        return f"e{epoch}"

    async def _position(self) -> int:
        raw = await self.redis.hget(self.keys.cursor, self._cursor_field(self.epoch))  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        return int(raw) if raw is not None else 0

    def _order_from_cursor(self, position: int) -> _EpochStream:
        order = self.index.epoch_order(self.epoch, self.options.seed, self.weights)
        for _ in range(position):  # deterministic order: skipping replays it exactly
            next(order)
        return _EpochStream(order, position)

    async def _admit_batch(self, stream: _EpochStream) -> str:
        batch = stream.peek(self.options.batch)
        if not batch:
            return "epoch-done"
        room = await self.headroom()
        if room <= 0:
            return "blocked"
        batch = batch[:room]  # don't build jobs that cannot be admitted now; the script re-checks
        version = await self.state.get_version()
        now = time.time()
        jobs = []
        for _env, offset in batch:
            job = self._job(self.reader.read(offset), self.epoch, version, now)
            jobs.append((job.job_id, job_envelope(job, enqueue_time_ms=int(now * 1000))))
        try:
            result = await self.admission.admit_fresh(
                self.limits, jobs, cursor_field=self._cursor_field(self.epoch), position=stream.position,
                score_ms=int(now * 1000), version=version,
            )
        except CursorMoved as exc:
            if exc.position >= stream.position:
                raise  # ahead of us: another producer
            # behind us: Redis lost its last writes (the admissions with them): admit from there again
            log.warning("the cursor of epoch %d went back from %d to %d (Redis lost writes?); admitting from %d again",
                        self.epoch, stream.position, exc.position, exc.position)
            stream.rewind(self._order_from_cursor(exc.position))
            return "admitted"
        if result.requeue_first:
            return "requeue-first"  # the loop drains the requeue list next, without waiting
        if result.version_moved:
            return "version-moved"  # the loop builds the batch again at the new version
        stream.advance(result.consumed)
        self.stats.admitted += result.admitted
        self.stats.refused += result.consumed - result.admitted
        if result.consumed > result.admitted:
            log.warning("%d job id(s) were already queued or finished; skipped", result.consumed - result.admitted)
        return "admitted" if result.consumed else "blocked"

    def _job(self, task: Task, epoch: int, version: int, now: float, attempt: int = 0) -> PromptJob:
        return PromptJob(
            task=task, epoch=epoch, n_samples=self.limits.n_samples, sampling=self.config.rollout.sampling,
            admission_version=version, enqueued_at=now, attempt=attempt,
        )

    # ------------------------------------------------------------ requeued tasks
    async def _drain_requeue(self) -> str:
        """Admit requeued tasks first. Returns "empty" or "blocked" (no headroom)."""
        while True:
            head = await self.redis.lindex(self.keys.requeue, 0)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
            if head is None:
                return "empty"
            outcome = await self._admit_requeued(head)
            if outcome == 0:
                return "blocked"

    async def _admit_requeued(self, head: bytes) -> int:
        """-1 look again (head or count moved), 0 no headroom, 1 admitted, 2 entry used up otherwise."""
        try:
            entry = decode_requeue(head)
        except SchemaError as exc:
            return await self._give_up(head, "?", f"undecodable requeue entry: {exc}")
        # the attempt count is per (task, epoch): another epoch's hand-backs are another budget
        attempts_field = job_id_for(entry.task.id, entry.epoch)
        raw = await self.redis.hget(self.admission.attempts_key, attempts_field)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        admitted = int(raw) if raw is not None else 0  # highest attempt admitted so far
        if entry.attempt < admitted:  # a repeated hand-back (replayed discard): its successor is admitted
            log.info("requeue entry for %s: attempt %d is already admitted; dropped", entry.group_id, admitted)
            return await self._drop(head, refused=True)
        attempt = entry.attempt + 1
        limit = self.options.max_requeues if self.options.max_requeues is not None else self.config.rollout.max_requeues
        if attempt > limit:
            reason = (
                f"task {entry.task.id!r} epoch {entry.epoch} was handed back {attempt} times, last {entry.reason.value} "
                f"(max_requeues {limit})"
            )
            return await self._give_up(head, entry.group_id, reason)
        now = time.time()
        job = self._job(entry.task, entry.epoch, await self.state.get_version(), now, attempt=attempt)
        outcome = await self.admission.admit_requeued(
            self.limits, head, attempts_field=attempts_field, attempts_seen=admitted, job=job, score_ms=int(now * 1000)
        )
        self.stats.requeued += outcome == 1
        self.stats.refused += outcome == 2
        return outcome

    async def _give_up(self, head: bytes, ref: str, reason: str) -> int:
        # Dead-letter first, then pop: a crash in between repeats this, never loses the task; keyed
        # by the entry's bytes, so a repeat within the op key's TTL writes nothing twice.
        op_id = "requeue-dead:" + hashlib.blake2b(head, digest_size=16).hexdigest()
        await self.buffer.dead_letter(source="requeue", reason=reason, payload=head, ref=ref, op_id=op_id)
        return await self._drop(head, dead=True, forget=attempts_field(ref) if ref != "?" else "")

    async def _drop(self, head: bytes, *, dead: bool = False, refused: bool = False, forget: str = "") -> int:
        if not await self.admission.drop_requeued(head, forget_attempts=forget):
            return -1
        self.stats.dead += dead
        self.stats.refused += refused
        return 2

    # ------------------------------------------------------------ cursor
    async def _check_cursor(self) -> None:
        mine = self.index.fingerprint(self.options.seed, self.weights)
        if self.options.reset_cursor:
            await self.redis.delete(self.keys.cursor)
        stored = await self.redis.hget(self.keys.cursor, FINGERPRINT_FIELD)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        if stored is None:
            await self.redis.hset(self.keys.cursor, FINGERPRINT_FIELD, mine)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        elif stored.decode() != mine:
            raise ConfigError(
                f"{self.keys.cursor} was written for other tasks, seed or weights ({stored.decode()[:60]}...) than "
                f"{self.index.path} now ({mine[:60]}...): resuming would skip or repeat tasks. "
                "Pass --reset-cursor to start the epochs over (counters and the bound are kept)."
            )

    async def _first_open_epoch(self) -> int:
        size = self.index.epoch_size(self.weights)
        epoch = 0
        while True:
            raw = await self.redis.hget(self.keys.cursor, self._cursor_field(epoch))  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
            if raw is None or int(raw) < size:
                return epoch
            epoch += 1


class _EpochStream:
    """The epoch's order from `position` on, with look-ahead for one admission batch."""

    def __init__(self, order: Iterator[tuple[str, int]], position: int):
        self._order = order
        self._ahead: list[tuple[str, int]] = []
        self.position = position

    def peek(self, n: int) -> list[tuple[str, int]]:
        while len(self._ahead) < n:
            item = next(self._order, None)
            if item is None:
                break
            self._ahead.append(item)
        return self._ahead[:n]

    def advance(self, n: int) -> None:
        del self._ahead[:n]
        self.position += n

    def rewind(self, other: _EpochStream) -> None:
        """Continue from `other`'s (earlier) position."""
        self._order, self._ahead, self.position = other._order, other._ahead, other.position


async def run_producer(
    config: PipelineConfig,
    tasks_path: str | Path,
    *,
    epochs: int = 1,
    follow: bool = False,
    stop_event: asyncio.Event | None = None,
    redis: aioredis.Redis | None = None,
    options: ProducerOptions | None = None,
) -> ProducerStats:
    """Admit tasks until done (or `stop_event` is set). Uses `redis` or connects to config.redis."""
    options = dataclasses.replace(options or ProducerOptions(), epochs=epochs, follow=follow)
    weights = {name: env.weight for name, env in config.environments.items()}
    index = TaskIndex.build(tasks_path, weights)
    _warn_unmixed(index, weights)
    client = redis or connect(config.redis.resolved_url())
    try:
        producer = Producer(client, config, index, options)
        return await producer.run(stop_event or asyncio.Event())
    finally:
        if redis is None:
            await client.aclose()


def _warn_unmixed(index: TaskIndex, weights: dict[str, float]) -> None:
    for env in index.envs:
        if weights.get(env, 0.0) <= 0:
            log.warning("environment %r has weight 0: its %d tasks will not be admitted", env, index.count(env))


# ------------------------------------------------------------------ CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout enqueue", description=__doc__.split("\n\n")[0],
                                     epilog="Exit codes: 0 done, 2 usage or configuration, 3 Redis unreachable.")
    parser.add_argument("--tasks", required=True, help="tasks.jsonl written by `rollout prepare`")
    parser.add_argument("--config", default=None, help="pipeline YAML (default: embedded defaults)")
    parser.add_argument("--redis-url", default=None,
                        help="overrides $ROLLOUT_REDIS_URL and redis.url (keep passwords in the env var)")
    parser.add_argument("--namespace", default=None, help="overrides $ROLLOUT_NAMESPACE and redis.namespace")
    parser.add_argument("--epochs", type=_positive_int, default=1)
    parser.add_argument("--follow", action="store_true", help="keep running: more epochs, keep draining requeues")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (part of the cursor's fingerprint)")
    parser.add_argument("--batch", type=_positive_int, default=64, help="jobs offered per admission call")
    parser.add_argument("--poll", type=_positive_float, default=0.1,
                        help="longest wait between looks at the version and counters while blocked "
                             "(a published version wakes it at once)")
    parser.add_argument("--max-requeues", type=_non_negative_int, default=None,
                        help="re-admissions of one (task, epoch) before it is dead-lettered (default: rollout.max_requeues)")
    parser.add_argument("--reset-cursor", action="store_true", help="start the epochs over (counters are kept)")
    parser.add_argument("--without-trainer", action="store_true",
                        help="admit on this config's B and eta without waiting for the trainer to publish {ns}:trainer")
    parser.add_argument("--progress", type=_positive_float, default=10.0, metavar="SECONDS",
                        help="log progress (and what it waits for) this often (default 10)")
    parser.add_argument("--json", action="store_true", help="print the final summary as one JSON object on stdout")
    parser.add_argument("--quiet", "-q", action="store_true", help="log warnings only (the summary is still printed)")
    return parser


def _number(kind: type, low: float, inclusive: bool) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < low or (not inclusive and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>=' if inclusive else '>'} {low:g}")
        return value
    return parse


_positive_int = _number(int, 1, True)
_non_negative_int = _number(int, 0, True)
_positive_float = _number(float, 0.0, False)


def summary_dict(stats: ProducerStats, elapsed_s: float, *, tasks: str, namespace: str) -> dict[str, Any]:
    data = dataclasses.asdict(stats)
    data["wait_s"] = round(stats.wait_s, 3)
    return {"tasks": tasks, "namespace": namespace, "elapsed_s": round(elapsed_s, 3), **data}


def format_summary(stats: ProducerStats, elapsed_s: float, *, tasks: str, namespace: str) -> str:
    """What a person reads at the end of `rollout enqueue`."""
    lines = [
        f"rollout enqueue: {tasks} -> namespace {namespace}, {elapsed_s:.1f}s",
        f"  admitted      {stats.admitted} fresh task(s), {stats.requeued} requeued; epochs finished: {stats.epochs_done}",
        f"  refused       {stats.refused} (already queued or finished: duplicate id, another producer, repeated hand-back)",
        f"  dead-lettered {stats.dead} requeue entries (past --max-requeues or undecodable)",
        f"  waited        {stats.wait_s:.1f}s for admission headroom or the trainer ({stats.waits} waits, "
        f"{stats.woken} ended by a published version)",
    ]
    lines += [f"  warning       {w}" for w in stats.warnings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = ProducerOptions(
        seed=args.seed, batch=args.batch, poll_s=args.poll, max_requeues=args.max_requeues,
        reset_cursor=args.reset_cursor, wait_for_trainer=not args.without_trainer, progress_s=args.progress,
    )
    overrides = {k: v for k, v in (("redis.url", args.redis_url), ("redis.namespace", args.namespace)) if v}
    started = time.monotonic()
    try:
        config = load_config(args.config, overrides)
        check_environments(config)  # kinds and options, before anything is admitted
        check_tasks(args.tasks, config)  # every task runnable by its environment (a math row's label)
        log.info("enqueue %s -> %s ns=%s", args.tasks, redact(config.redis.resolved_url()), config.redis.namespace)
        stats = asyncio.run(_run_until_signal(config, args.tasks, args.epochs, args.follow, options))
    except ConfigError as exc:  # exit 2: usage/config (scripts/cli.py); the traceback too under --debug
        return usage_error("enqueue", exc)
    except RedisConnectionError as exc:  # RedisUnavailable: past the outage budget
        print(f"rollout enqueue: redis unreachable: {exc}", file=sys.stderr)
        return 3
    except CursorMoved as exc:  # exit 2: a usage error (one producer per namespace)
        print(f"rollout enqueue: another producer is admitting in namespace {config.redis.namespace} ({exc}); "
              "run one producer per namespace", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps(summary_dict(stats, elapsed, tasks=args.tasks, namespace=config.redis.namespace)))
    else:
        print(format_summary(stats, elapsed, tasks=args.tasks, namespace=config.redis.namespace))
    return 0


async def _run_until_signal(
    config: PipelineConfig, tasks: str, epochs: int, follow: bool, options: ProducerOptions
) -> ProducerStats:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await run_producer(config, tasks, epochs=epochs, follow=follow, stop_event=stop, options=options)


if __name__ == "__main__":
    sys.exit(main())
