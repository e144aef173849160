"""`rollout bench --sections scale`, its memory part (issue 26; scripts/bench/scale.py):

Memory: GROUPS groups pushed through the buffer (`GroupBuffer.push`) and taken by the trainer
side (`RedisDataSource.get_samples`, `save` each step: the real data source path), batch 64.
used_memory per 1,000 groups, while running (half-way, a step's groups in the stream) and after
consumption, broken down by key family (MEMORY USAGE over SCAN, by prefix), with each family's
TTL. Next to it, one arq result as the workers now store it and as arq's default would.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

from pipeline.keys import Keys, attempts_field
from pipeline.store.redis_conn import connect
from scripts.bench.report import Figure

BATCH = 64


# ------------------------------------------------------------------ memory


def _family(key: str, ns: str) -> str:
    """The key family: variable parts (ids) replaced by '*'."""
    if key.startswith("arq:"):
        return ":".join(key.split(":")[:2]) + ":*"
    rest = key[len(ns) + 1:]
    head, _, tail = rest.partition(":")
    if head in ("dedup", "op", "consumed", "eval") and tail:
        return f"{{ns}}:{head}:*"
    if head == "worker" and tail:
        return "{ns}:worker:*:jobs"
    return "{ns}:" + rest


async def _families(redis: Any, ns: str) -> dict[str, dict[str, float]]:
    """Per family: keys, bytes (MEMORY USAGE), and the TTL of one of its keys (-1: none)."""
    out: dict[str, dict[str, float]] = {}
    batch: list[str] = []

    async def flush() -> None:
        pipe = redis.pipeline(transaction=False)
        for key in batch:
            pipe.memory_usage(key, samples=0)
            pipe.ttl(key)
        replies = await pipe.execute()
        for key, size, ttl in zip(batch, replies[::2], replies[1::2]):
            if ttl == -2:  # expired between the scan and this read (the sweep lease, a short TTL): gone
                continue
            row = out.setdefault(_family(key, ns), {"keys": 0, "bytes": 0, "ttl_s": ttl})
            row["keys"] += 1
            row["bytes"] += int(size or 0)
        batch.clear()

    for pattern in (f"{ns}:*", f"arq:*{ns}:*"):
        async for raw in redis.scan_iter(match=pattern, count=1000):
            batch.append(raw.decode())
            if len(batch) >= 1000:
                await flush()
    if batch:
        await flush()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def _per_k(families: dict[str, dict[str, float]], groups: int) -> dict[str, dict[str, float]]:
    return {name: {"keys": row["keys"], "bytes_per_1000_groups": round(row["bytes"] * 1000 / groups),
                   "ttl_s": row["ttl_s"]} for name, row in families.items()}


# Per step of BATCH trained groups, the other endings, each through the real code that ends it:
HANDED_BACK_TRAINED = 4  # trained groups that are a handed-back task's attempt 1 (attempts field)
FILTERED = 4  # zero-variance groups the filter drops (half of them attempt 1)
STALE = 4  # past eta: due-first dead-letters them (half of them attempt 1)
WORKER_DEAD = 2  # jobs out of tries on a worker: dead-lettered for good, tombstoned
REAPED_RERUNS = 2  # trained groups whose worker is reaped after the push; the re-run finds the marker
EVALS = 2  # eval jobs (failed ones: no engine here) after a reaper's note
FIRST_ROLLOUT = 10  # rollout ids start here, so a stale group's admission version is >= 0


def bench_memory(url: str, *, quick: bool, groups: int | None = None) -> list[Figure]:
    """`groups` trained groups through the buffer and the data source, and beside them every other
    way a task or a job ends (see the constants above); bytes per key family after each half."""
    from pipeline.aio import LoopThread
    from pipeline.slime.data_source import RedisDataSource
    from pipeline.store.buffer import GroupBuffer

    total = groups or (10_000 if quick else 100_000)
    steps = total // BATCH
    keys = Keys(f"mem{uuid.uuid4().hex[:8]}")
    loop = LoopThread()
    redis = connect(url)
    source = None
    try:
        base = loop.run(_used_memory(redis))
        buffer = GroupBuffer(redis, keys)
        loop.run(buffer.ensure_group())
        source = RedisDataSource(SimpleNamespace(
            pipeline_redis_url=url, pipeline_namespace=keys.ns, rollout_batch_size=BATCH, n_samples_per_prompt=4,
            pipeline_eta=2, pipeline_filter_zero_variance=True, pipeline_stale_policy="requeue"))
        endings = loop.run(_Endings.create(url, keys, buffer))
        running: dict[str, Any] = {}
        after: dict[str, Any]
        started = time.monotonic()
        for step in range(steps):
            rid = FIRST_ROLLOUT + step
            loop.run(endings.step(step, rid))
            if step == steps // 2:  # while running: this step's groups wait in the stream
                running = {"used_memory": loop.run(_used_memory(redis)) - base,
                           "families": _per_k(loop.run(_families(redis, keys.ns)), step * BATCH + BATCH)}
                running["groups"] = step * BATCH + BATCH
            source.current_rollout_id = rid
            source.get_samples(BATCH)
            source.save(rid)
        seconds = time.monotonic() - started
        consumed = steps * BATCH
        loop.run(endings.close())
        after = {"used_memory": loop.run(_used_memory(redis)) - base,
                 "families": _per_k(loop.run(_families(redis, keys.ns)), consumed), "groups": consumed,
                 "counters": loop.run(_counters(redis, keys))}
        results = loop.run(_result_sizes(redis, keys))
        loop.run(redis.flushall())  # type: ignore[arg-type]  # redis-py types async replies Awaitable[T] | T
    finally:
        if source is not None:
            source.close()
        loop.run(redis.aclose())
        loop.close()
    per_k_running = running["used_memory"] * 1000 / running["groups"]
    per_k_after = after["used_memory"] * 1000 / consumed
    print(f"[scale] memory: {consumed} trained groups through buffer + RedisDataSource, and per step of {BATCH}: "
          f"{HANDED_BACK_TRAINED} of them a handed-back task's, {FILTERED} filtered, {STALE} stale (dead-lettered), "
          f"{WORKER_DEAD} dead-lettered by a worker, {REAPED_RERUNS} re-run after a reap, {EVALS} eval jobs; "
          f"{seconds:.1f} s; used_memory per 1,000 trained groups {per_k_running / 1024:.1f} KiB while running, "
          f"{per_k_after / 1024:.1f} KiB after consumption; counters {after['counters']}", flush=True)
    for label, snap in (("while running", running), ("after consumption", after)):
        for name, row in snap["families"].items():
            ttl = "no TTL" if row["ttl_s"] < 0 else f"TTL {row['ttl_s']} s"
            print(f"[scale]   {label:>17}: {name:<26} {row['keys']:>7} keys "
                  f"{row['bytes_per_1000_groups'] / 1024:8.1f} KiB per 1,000 groups ({ttl})", flush=True)
    print(f"[scale]   arq result per job: {results['slim']} B as the workers store it, {results['full']} B with "
          f"arq's default (the whole job)", flush=True)
    return [
        Figure(section="scale", name=f"memory: used_memory per 1,000 groups after consumption ({consumed} groups, "
               "every ending path)", value=per_k_after / 1024, unit="KiB", baseline="while running",
               baseline_value=per_k_running / 1024, ratio=per_k_running / max(per_k_after, 1.0),
               details={"while_running": running, "after_consumption": after, "arq_result_bytes": results,
                        "seconds": round(seconds, 1)}),
        Figure(section="scale", name="memory: one arq result as the workers store it", value=results["slim"], unit="B",
               baseline="arq's default (the whole job)", baseline_value=results["full"],
               ratio=results["full"] / max(results["slim"], 1)),
    ]


class _Endings:
    """One step's groups and jobs, each ended by the real code that ends it: the buffer's push, a
    worker's `run_group` / `_out_of_tries` / `run_eval_group` (a WorkerContext with no engine: no
    path here runs an episode), the reaper (`Liveness.reap`)."""

    def __init__(self, keys: Keys, buffer: Any, context: Any, sweeper: Any):
        from pipeline.synthetic import make_group

        self.keys, self.buffer, self.context, self.sweeper = keys, buffer, context, sweeper
        self.template = [make_group(f"tpl{i}:0", n=4, prompt_len=32, response_len=64, seed=i) for i in range(4)]
        self.flat = make_group("flat:0", n=4, prompt_len=32, response_len=64, rewards=[1.0] * 4)

    @classmethod
    async def create(cls, url: str, keys: Keys, buffer: Any) -> _Endings:
        from pipeline.config import parse_config
        from workers.jobs import WorkerContext
        from workers.liveness import Liveness

        config = parse_config({"redis": {"url": url, "namespace": keys.ns}, "rollout": {"max_requeues": 1}})
        sweeper = Liveness(buffer.redis, keys, "sweeper", heartbeat_s=1.0, dead_after_s=3.0)
        context = WorkerContext(config=config, keys=keys, buffer=buffer, engine=None, chat=None,  # type: ignore[arg-type]  # no episode runs here
                                liveness=sweeper, worker_id="sweeper")
        await sweeper.beat()
        return cls(keys, buffer, context, sweeper)

    def _group(self, task_id: str, rid: int, *, attempt: int = 0, flat: bool = False, stale: bool = False) -> Any:
        import msgspec

        from pipeline.schema import job_id_for

        group = self.flat if flat else self.template[len(task_id) % 4]
        return msgspec.structs.replace(group, group_id=job_id_for(task_id, 0, attempt), attempt=attempt, epoch=0,
                                       task=msgspec.structs.replace(group.task, id=task_id),
                                       admission_version=rid - 10 if stale else rid)

    async def step(self, step: int, rid: int) -> None:
        redis, keys = self.buffer.redis, self.keys
        name = f"s{step}"
        trained = [self._group(f"{name}t{i}", rid, attempt=int(i < HANDED_BACK_TRAINED)) for i in range(BATCH)]
        dropped = [self._group(f"{name}f{i}", rid, attempt=i % 2, flat=True) for i in range(FILTERED)]
        dropped += [self._group(f"{name}x{i}", rid, attempt=i % 2, stale=True) for i in range(STALE)]
        handed_back = [g for g in trained + dropped if g.attempt == 1]  # as the worker's hand-back wrote them
        await redis.hset(keys.requeue_attempts, mapping={attempts_field(g.group_id): 1 for g in handed_back})
        await _push_all(self.buffer, dropped + trained)
        await self._reaped_reruns(trained[-REAPED_RERUNS:], name)
        await self._worker_dead_letters(name, rid)
        await self._evals(name)

    def _job(self, group: Any) -> Any:
        from pipeline.schema import PromptJob

        return PromptJob(task=group.task, epoch=group.epoch, attempt=group.attempt, n_samples=4,
                         admission_version=group.admission_version)

    async def _reaped_reruns(self, groups: list[Any], name: str) -> None:
        """Each pushed by a worker that is then reaped (the reaper notes why in job_errors); the
        re-run finds the group's dedup marker and ends."""
        from pipeline.schema import encode
        from workers.jobs import CTX_KEY, run_group
        from workers.liveness import Liveness

        doomed = Liveness(self.buffer.redis, self.keys, f"doomed-{name}", heartbeat_s=1.0, dead_after_s=3.0)
        await doomed.beat()
        jobs = [self._job(g) for g in groups]
        for job in jobs:
            await doomed.job_started(self.keys.arq_job_id(job.job_id))
        await self.buffer.redis.zadd(self.keys.workers, {doomed.worker_id: 1.0})  # silent for long
        await self.sweeper.beat()
        await self.sweeper.reap()
        for job in jobs:
            ctx = {CTX_KEY: self.context, "job_id": self.keys.arq_job_id(job.job_id), "job_try": 2}
            await run_group(ctx, encode(job))

    async def _worker_dead_letters(self, name: str, rid: int) -> None:
        """Attempt 1 of a handed-back task, out of tries: dead-lettered for good (max_requeues 1)."""
        from pipeline.schema import encode
        from workers.jobs import _out_of_tries

        for i in range(WORKER_DEAD):
            job = self._job(self._group(f"{name}d{i}", rid, attempt=1))
            arq_id = self.keys.arq_job_id(job.job_id)
            await self.buffer.redis.hset(self.keys.requeue_attempts, attempts_field(job.job_id), 1)
            await self.buffer.redis.hset(self.keys.job_errors, arq_id, "an earlier try failed")
            await _out_of_tries(self.context, job, arq_id, "out of tries", encode(job))

    async def _evals(self, name: str) -> None:
        from workers.eval_jobs import run_eval_group
        from workers.jobs import CTX_KEY

        for i in range(EVALS):
            arq_id = self.keys.arq_job_id(f"{name}e{i}:0")
            await self.buffer.redis.hset(self.keys.job_errors, arq_id, "its worker stopped heart-beating")
            await run_eval_group({CTX_KEY: self.context, "job_id": arq_id, "job_try": 2}, f"round{name}", b"no job")

    async def close(self) -> None:
        await self.sweeper.stop()


async def _counters(redis: Any, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}


def _renamed(group: Any, group_id: str) -> Any:
    import msgspec

    return msgspec.structs.replace(group, group_id=group_id, task=msgspec.structs.replace(group.task, id=group_id[:-2]))


async def _push_all(buffer: Any, groups: list[Any]) -> None:
    await asyncio.gather(*(buffer.push(g) for g in groups))


async def _used_memory(redis: Any) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def _result_sizes(redis: Any, keys: Keys) -> dict[str, int]:
    """MEMORY USAGE of one arq result key (a task with a 2,000-character prompt) as the workers
    write it (`workers.settings.result_serializer`) and as arq's default would (the whole job)."""
    from arq.jobs import serialize_result

    from pipeline.schema import PromptJob, Task, encode
    from pipeline.store.jobqueue import JOB_FUNCTION, job_serializer
    from workers.settings import result_serializer

    job = PromptJob(task=Task(id="t", env="math", prompt="p" * 2000, label="1"), epoch=0, n_samples=8)
    sizes = {}
    for name, serializer in (("slim", result_serializer), ("full", job_serializer)):
        data = serialize_result(JOB_FUNCTION, (encode(job),), {}, 1, 1, True, None, 1, 2, "ref", keys.queue,
                                job_id=keys.arq_job_id(job.job_id), serializer=serializer)
        key = f"arq:result:{keys.ns}:{name}"
        await redis.set(key, data or b"", px=60_000)
        sizes[name] = int(await redis.memory_usage(key, samples=0) or 0)
    return sizes
