"""Shared pipeline state in Redis: counters, policy version, engine URL, trainer settings."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pipeline.aio import wait_event
from pipeline.keys import Keys
from pipeline.store.redis_conn import new_op_id, run_once

log = logging.getLogger(__name__)


class TrainerInfo(msgspec.Struct, kw_only=True):
    """What the slime side publishes in `{ns}:trainer` so producers can check their settings."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    eta: int
    # 1: the trainer hands stale groups back on `{ns}:requeue` (arrival order, stale_policy
    # requeue), so a plain producer stays until every group it admitted was trained
    hands_back: int = 0


class PipelineState:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis = redis
        self.keys = keys

    # counters -----------------------------------------------------------
    async def incr(self, *, op_id: str | None = None, **deltas: int) -> None:
        """Apply the counter deltas once (`op_id`, default one per call), whatever replies are lost."""
        if not deltas:
            return

        def stage(pipe: Any) -> None:
            for name, delta in deltas.items():
                pipe.hincrby(self.keys.counters, name, delta)

        await run_once(self.redis, self.keys.op(op_id or new_op_id()), stage)

    async def counters(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.counters)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        return {k.decode(): int(v) for k, v in raw.items()}

    # policy version -------------------------------------------------------
    async def get_version(self) -> int:
        raw = await self.redis.get(self.keys.version)
        return int(raw) if raw is not None else 0

    async def set_version(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.version, int(version))
        pipe.publish(self.keys.version_events, int(version))
        await pipe.execute()

    # engine URL -------------------------------------------------------------
    async def get_engine(self) -> str | None:
        raw = await self.redis.get(self.keys.engine)
        return raw.decode() if raw is not None else None

    async def set_engine(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url {url!r} must start with http:// or https://")
        await self.redis.set(self.keys.engine, url)

    # trainer settings ---------------------------------------------------------
    async def set_trainer_info(self, info: TrainerInfo) -> None:
        mapping: dict[str, int] = msgspec.structs.asdict(info)
        await self.redis.hset(self.keys.trainer, mapping=mapping)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T

    async def get_trainer_info(self) -> TrainerInfo | None:
        raw = await self.redis.hgetall(self.keys.trainer)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        if not raw:
            return None
        values = {k.decode(): int(v) for k, v in raw.items()}
        return msgspec.convert(values, TrainerInfo)

    # policy clock (pipeline/staleness.py "policy versions") ---------------------
    async def get_policy(self) -> PolicyStamp | None:
        raw = await self.redis.hmget(self.keys.policy, ["run", "version", "labels"])  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        if raw[0] is None or raw[1] is None:
            return None
        labels = msgspec.json.decode(raw[2], type=dict[str, int]) if raw[2] else {}
        return PolicyStamp(run=int(raw[0]), version=int(raw[1]), labels=labels)

    async def begin_run(self) -> int:
        """A new trainer process: a new run number, and no published version until its first rollout."""
        run = int(await self.redis.hincrby(self.keys.runs, "count", 1))  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.policy)
        pipe.hset(self.keys.policy, "run", str(run))
        await pipe.execute()
        return run

    async def publish_policy(
        self, *, run: int, start: int, engine_version: int, rollout_id: int, labels: dict[str, int] | None = None
    ) -> None:
        """At each rollout: the run's branch point, the engines' version, and the admission clock."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.runs, str(run), str(start))
        pipe.hset(self.keys.policy, mapping={
            "run": run, "version": engine_version, "rollout": rollout_id, "labels": msgspec.json.encode(labels or {}),
        })
        pipe.set(self.keys.version, engine_version)
        pipe.publish(self.keys.version_events, engine_version)  # wakes producers (VersionWake)
        await pipe.execute()

    async def run_starts(self) -> dict[int, int]:
        raw = await self.redis.hgetall(self.keys.runs)  # type: ignore[misc]  # redis-py types async replies Awaitable[T] | T
        return {int(k): int(v) for k, v in raw.items() if k != b"count"}


class PolicyStamp(msgspec.Struct, frozen=True):
    """What a worker reads before each generate call: the trainer run, the policy version the
    engines hold (a lower bound for the call's tokens), and slime's labels of the current and
    next weight pushes with their versions (exact, when the answer carries one of them)."""

    run: int
    version: int
    labels: dict[str, int] = {}

    def version_of(self, engine_labels: tuple[str, ...] | list[str]) -> int:
        """The oldest version behind an answer's labels: the published version, raised only for
        the label slime's law gives the next push (a push the trainer has not published yet).
        A label is never read downwards: within a run the engines are never behind the
        published version, so a label that seems older only means a trainer that labels its
        pushes otherwise (its own convention), and the published version stays right.
        Raising is exact only while the published labels follow the loop that really runs
        (`pipeline_trainer_loop`, pipeline/staleness.py): tests/conformance/test_conformance_slime.py runs
        slime's own train.py and train_async.py against it."""
        return min(
            (max(self.version, self.labels.get(label, self.version)) for label in engine_labels), default=self.version
        )


class PolicyClock:
    """The worker side of `{ns}:policy`: a stamp per generate call, read before it is sent.

    Read from Redis for every call (one HMGET beside a generate call of seconds): a cached
    stamp could only be older than the published one, which never hides staleness but makes
    a fresh group look a version older, and at eta 0 (or eta equal to slime's own lag) that
    alone rejected every group. `stamp()` waits while no trainer has published a version for
    its current run (slime is still starting, or resuming): generating then would use weights
    nobody trains.
    """

    def __init__(self, state: PipelineState, *, poll_s: float = 0.2, log_every_s: float = 10.0):
        self.state = state
        self.poll_s = poll_s  # while waiting for a trainer
        self.log_every_s = log_every_s

    async def stamp(self) -> PolicyStamp:
        waited_since = None
        while (stamp := await self.state.get_policy()) is None:
            now = time.monotonic()
            if waited_since is None or now - waited_since >= self.log_every_s:
                waited_since = now
                log.info(
                    "waiting for the trainer to publish the engines' policy version (%s)", self.state.keys.policy
                )
            await asyncio.sleep(self.poll_s)
        return stamp


class ChannelWake:
    """A wait that ends the moment a message arrives on a pub/sub `channel`, or at `timeout`. The
    message is only a hint: the caller looks again (Redis, its state) after every wait, so a lost
    message (a reconnect, a Redis restarted, a server without pub/sub) costs one poll interval and
    nothing else. The first wait after (re)subscribing ends when Redis confirms the subscription
    (redis-py hands the ignored confirmation back as None): every later publish reaches us, and the
    caller's look right after it sees what was written just before. `what` names the fallback in
    the one log line a failing subscription writes."""

    def __init__(self, redis: aioredis.Redis, channel: str, *, what: str = "admission"):
        self.redis = redis
        self.channel = channel
        self.what = what
        self._pubsub: Any = None
        self._failed_once = False
        self.wakes = 0  # waits ended by a message (the rest by timeout or stop)

    async def wait(self, stop: asyncio.Event, timeout: float) -> bool:
        """Until a message arrives (True), `stop` is set or `timeout` passes. A cancel propagates."""
        if stop.is_set():
            return False
        try:
            if self._pubsub is None:
                self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(self.channel)
            message = await self._unless_stopped(stop, timeout)
        except (RedisError, OSError) as exc:
            if not self._failed_once:
                self._failed_once = True
                log.info("no wake-up on %s (%s): %s polls every %.2fs", self.channel, exc, self.what, timeout)
            await self.close()  # subscribed again at the next wait
            await wait_event(stop, timeout)
            return False
        if message is None:
            return False
        self.wakes += 1
        return True

    async def _unless_stopped(self, stop: asyncio.Event, timeout: float) -> Any:
        receive = asyncio.ensure_future(self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({receive, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            receive.cancel()
            stopped.cancel()
        if receive.done() and not receive.cancelled():
            return receive.result()
        await self.close()  # a read cut short may leave half a reply on the connection
        return None

    async def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass  # the connection is gone already


class VersionWake(ChannelWake):
    """A producer's wait for the trainer's next policy version (`{ns}:version_events`, published in
    the same transaction as `{ns}:version`): admission follows the trainer's publish within a round
    trip instead of half a poll on average."""
