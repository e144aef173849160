"""Multi-turn evaluation through the pipeline, pinned to a policy version.

`generate_rollout(args, rid, ds, evaluation=True)` with `pipeline_eval_datasets` set (a YAML
or JSONL list of `EvalDataset`) runs `evaluate`: every eval task becomes one arq job of
`EVAL_FUNCTION` (`workers/eval_jobs.py`) carrying the policy version published in
`{ns}:policy`, enqueued with arq's own `enqueue_job` at a score below any training job's
(arq runs the lowest score first), so free worker slots take eval jobs first. Workers run
n episodes with the task's environment (the training episode runner) and push the scored
group into this round's own stream `{ns}:eval:<round>`: never the training buffer, never
`{ns}:open` or the admission counters. The trainer waits for every group of the round
(`pipeline_eval_timeout_s`, then an error naming what is missing, with the round's queued
jobs withdrawn) and returns slime's `RolloutFnEvalOutput`: `data[name] = {rewards,
truncated, samples}` as slime's `eval_rollout` builds it, and per-dataset metrics
(`eval/<name>/pass@1` and its standard error over the tasks `pass@1_stderr`, `pass@<n>`, `reward_mean` (over the samples that did not fail),
`samples_failed`, `failure_rate`, `turns_mean`, `response_tokens_mean`); each dataset's result
also goes to `{ns}:eval_results` for the monitor (`DatasetResult`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

from pipeline.config import ConfigError
from pipeline.keys import Keys
from pipeline.sampling import seed_errors
from pipeline.schema import (
    PromptJob,
    SampleGroup,
    SamplingParams,
    SchemaError,
    Status,
    Task,
    decode_group,
    decode_task_json,
    encode,
)
from pipeline.store.buffer import Entry

log = logging.getLogger(__name__)

EVAL_FUNCTION = "run_eval_group"  # the arq function workers register (workers/eval_jobs.py)
EVAL_SCORE = 1  # arq queue score of the first eval job (ms since 1970): below every training job's
# every eval job's queue score is below this (ms since 1970: 1970-01-12), every training job's above
# it: the workers' claim tells them apart by score to hold eval jobs to `workers.eval_share`
EVAL_SCORE_MAX = 10**9
PASS_REWARD = 1.0  # a sample with reward >= this passes (pass@k); slime's own pass rate counts reward == 1
STREAM_TTL_S = 24 * 3600  # an abandoned round's stream expires
READ_BLOCK_MS = 1000
SHOW = 5  # missing / failed groups named in an error


class EvalDataset(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One entry of the `pipeline_eval_datasets` file."""

    env: str  # the environment that runs and scores the tasks (a name in the workers' pipeline.yaml)
    tasks: str  # tasks file (`rollout prepare` output, JSONL); relative to the datasets file
    name: str = ""  # key in slime's eval data and the metrics; "" = env
    n_samples: Annotated[int, msgspec.Meta(ge=1)] = 1  # episodes per task (pass@n)
    max_tasks: Annotated[int, msgspec.Meta(ge=1)] | None = None  # the first N tasks of env in the file
    sampling: SamplingParams = SamplingParams()  # over the workers' rollout.sampling

    @property
    def key(self) -> str:
        return self.name or self.env


class DatasetResult(msgspec.Struct, kw_only=True, frozen=True):
    """One dataset's figures of the last round reported (`{ns}:eval_results`, the monitor)."""

    rollout_id: int  # slime's eval call that started the round
    round_id: str
    versions: list[int]  # the versions its results are reported under (one, unless the round spanned pushes)
    tasks: int  # the dataset's tasks in the round
    failed: int  # tasks with no result (the job failed for good, every episode failed, or timed out)
    mixed: int = 0  # tasks whose tokens came from several versions (background mode; counted in `versions`)
    samples_failed: int = 0  # failed episodes of the tasks with a result (left out of reward_mean)
    pass_at_1: float | None = None  # over the tasks with a result; None: none has one
    reward_mean: float | None = None  # over the measured (not failed) samples
    reported_at: float = 0.0  # time.time()


def dataset_result(rollout_id: int, round_id: str, tasks: int, groups: list[SampleGroup], versions: set[int],
                   mixed: int = 0) -> DatasetResult:
    """A dataset's `DatasetResult` from the groups of the round that have a result."""
    m = dataset_metrics("d", groups)
    pass_at_1 = m.get("eval/d/pass@1")
    reward_mean = m.get("eval/d/reward_mean")
    return DatasetResult(rollout_id=rollout_id, round_id=round_id, versions=sorted(versions), tasks=tasks,
                         failed=tasks - len(groups), mixed=mixed, samples_failed=int(m.get("eval/d/samples_failed", 0)),
                         pass_at_1=None if pass_at_1 is None else float(pass_at_1),
                         reward_mean=None if reward_mean is None else float(reward_mean), reported_at=time.time())


def stage_results(pipe: Any, keys: Keys, results: dict[str, DatasetResult]) -> None:
    """Queue the datasets' last results into `{ns}:eval_results` on a Redis pipeline."""
    if results:
        pipe.hset(keys.eval_results, mapping={name: msgspec.json.encode(r) for name, r in results.items()})


async def read_results(redis: Any, keys: Keys) -> dict[str, DatasetResult]:
    """The last reported result of every dataset (the monitor's eval view)."""
    raw = await redis.hgetall(keys.eval_results)
    return {k.decode(): msgspec.json.decode(v, type=DatasetResult) for k, v in sorted(raw.items())}


@dataclass
class LocalEvalOutput:
    """No-slime fallback with the fields of `slime.rollout.base_types.RolloutFnEvalOutput`."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def load_eval_datasets(path: str | Path, *, deterministic: bool = False) -> list[tuple[EvalDataset, list[Task]]]:
    """The datasets file (a YAML list, or JSONL: one object a line) and each dataset's tasks.

    A dataset's `sampling.sampling_seed` follows the training seed's rules (pipeline/sampling.py):
    `deterministic` says the engines run --enable-deterministic-inference (slime's
    --sglang-enable-deterministic-inference), without which a seed does nothing, and seed +
    sample index must stay within 2**63 - 1 for each of its `n_samples` episodes."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix == ".jsonl":
            raw = [msgspec.json.decode(line) for line in text.splitlines() if line.strip()]
        else:
            raw = yaml.safe_load(text)
        entries = msgspec.convert(raw, list[EvalDataset])
    except (OSError, yaml.YAMLError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"pipeline_eval_datasets {str(path)!r}: {exc}") from exc
    out: list[tuple[EvalDataset, list[Task]]] = []
    for i, ds in enumerate(entries):
        where = f"pipeline_eval_datasets {str(path)!r} entry {i} ({ds.key!r})"
        if any(ds.key == seen.key for seen, _ in out):
            raise ConfigError(f"{where}: the name is used twice (set `name`)")
        if ds.sampling.sampling_seed is not None:  # None: the workers' rollout.sampling seed, checked there
            for error in seed_errors(ds.sampling.sampling_seed, n_samples=ds.n_samples, deterministic=deterministic,
                                     key="sampling.sampling_seed", switch="run slime with that flag"):
                raise ConfigError(f"{where}: {error}")
        tasks_path = path.parent / ds.tasks
        tasks: list[Task] = []
        n = 0
        try:
            with open(tasks_path, "rb") as fh:
                for n, line in enumerate(fh, 1):  # noqa: B007  (n names the line in the error below)
                    if line.strip() and (task := decode_task_json(line)).env == ds.env:
                        tasks.append(task)
                        if ds.max_tasks is not None and len(tasks) >= ds.max_tasks:
                            break
        except (OSError, SchemaError) as exc:
            raise ConfigError(f"{where}: {tasks_path}:{n}: {exc}") from exc
        if not tasks:
            raise ConfigError(f"{where}: {tasks_path} has no task of env {ds.env!r}")
        out.append((ds, tasks))
    if not out:
        raise ConfigError(f"pipeline_eval_datasets {str(path)!r} lists no dataset")
    return out


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate of one task: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - correct < k else 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def dataset_metrics(name: str, groups: list[SampleGroup], failed_groups: int = 0) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    m: dict[str, float] = {f"eval/{name}/groups_failed": failed_groups}
    if not samples:
        return m
    n = groups[0].n_samples
    passes = [sum(s.reward >= PASS_REWARD and s.status is not Status.FAILED for s in g.samples) for g in groups]
    per_task = [pass_at_k(n, c, 1) for c in passes]
    m[f"eval/{name}/pass@1"] = sum(per_task) / len(groups)
    # its standard error over the tasks (the sampling noise of the round: a task's samples share
    # its difficulty, so the tasks, not the samples, are the independent draws); 0 with one task
    m[f"eval/{name}/pass@1_stderr"] = statistics.stdev(per_task) / math.sqrt(len(per_task)) if len(per_task) > 1 else 0.0
    m[f"eval/{name}/pass@{n}"] = sum(pass_at_k(n, c, n) for c in passes) / len(groups)
    # a failed sample's 0 is no measurement (the trainer gives it no loss, pipeline/slime/data_source.py): the
    # mean is over the measured samples, their failed ones counted beside it
    measured = [s.reward for s in samples if s.status is not Status.FAILED]
    if measured:
        m[f"eval/{name}/reward_mean"] = sum(measured) / len(measured)
    m[f"eval/{name}/samples_failed"] = len(samples) - len(measured)
    m[f"eval/{name}/failure_rate"] = (len(samples) - len(measured)) / len(samples)
    m[f"eval/{name}/turns_mean"] = sum(int(s.metadata.get("turns", 1)) for s in samples) / len(samples)
    m[f"eval/{name}/response_tokens_mean"] = sum(s.response_length for s in samples) / len(samples)
    return m


def eval_output(data: dict[str, dict[str, Any]], metrics: dict[str, Any]) -> Any:
    """slime's `RolloutFnEvalOutput`, or its local stand-in without slime."""
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput
    except ImportError:
        return LocalEvalOutput(data=data, metrics=metrics)
    return RolloutFnEvalOutput(data=data, metrics=metrics)


async def run_round(ds: Any, rollout_id: int, datasets: list[tuple[EvalDataset, list[Task]]]) -> tuple[dict, dict]:
    """Enqueue every eval job of one round, collect every group, build slime's eval data."""
    redis, keys, timeout_s = ds._redis, ds.keys, ds.settings.eval_timeout_s
    stamp = await ds.state.get_policy()
    version = stamp.version if stamp is not None else await ds.state.get_version()
    round_id = f"{rollout_id}-{uuid.uuid4().hex[:8]}"
    stream = keys.eval_stream(round_id)
    started = time.monotonic()
    wanted: dict[str, tuple[str, int, str]] = {}  # group id -> (dataset, position, task id)
    got: dict[str, tuple[str, SampleGroup]] = {}
    failed: dict[str, str] = {}
    last = "0-0"
    try:
        await _enqueue(redis, keys, round_id, datasets, version, timeout_s, wanted)
        while len(got) + len(failed) < len(wanted):
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(_missing(rollout_id, round_id, wanted, got, failed, timeout_s, stream))
            for _stream, entries in await redis.xread({stream: last}, count=256, block=READ_BLOCK_MS) or []:
                for stream_id, fields in entries:
                    last = stream_id = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
                    gid = fields[b"id"].decode()
                    if gid not in wanted or gid in got or gid in failed:
                        continue
                    if b"error" in fields:
                        failed[gid] = fields[b"error"].decode()
                    else:
                        got[gid] = (stream_id, decode_group(fields[b"g"]))
    finally:
        # every job of the round, on every ending: one whose group is in the stream is not finished in
        # arq until its worker's finish, and a worker stopped (or killed) before that hands it back to
        # the queue (arq: "cancelled, will be run again"), where it would run again for a round that
        # is gone. Withdrawn, a hand-back finds no entry to return to (`RolloutWorker.finish_job`).
        await _withdraw(redis, keys, list(wanted), unfinished=[g for g in wanted if g not in got and g not in failed])
        await redis.delete(stream)
    data, metrics, results = _output(rollout_id, round_id, datasets, wanted, got, failed, version,
                                     time.monotonic() - started)
    async with redis.pipeline(transaction=True) as pipe:
        stage_results(pipe, keys, results)
        await pipe.execute()
    return data, metrics


async def _enqueue(
    redis: Any, keys: Keys, round_id: str, datasets: list[tuple[EvalDataset, list[Task]]], version: int,
    timeout_s: float, wanted: dict[str, tuple[str, int, str]], score_base: int = 0,
) -> None:
    """arq's own enqueue (pipeline.store.jobqueue's serializer), the round's jobs at scores
    EVAL_SCORE + score_base + i: ahead of every training job (scored by enqueue time), in dataset
    order (a background round's base follows the jobs of the rounds before it: they queue in
    order). Fills `wanted` as it goes (what to withdraw if it fails half-way)."""
    from arq.connections import ArqRedis

    from pipeline.store.jobqueue import job_deserializer, job_serializer

    arq = ArqRedis(redis.connection_pool, job_serializer=job_serializer, job_deserializer=job_deserializer,
                   default_queue_name=keys.queue)
    now = time.time()
    for d, (ds, tasks) in enumerate(datasets):
        for i, task in enumerate(tasks):
            # epoch -1 - d: training epochs are >= 0, so episode request ids never meet a training job's
            job = PromptJob(task=task, epoch=-1 - d, n_samples=ds.n_samples, sampling=ds.sampling,
                            admission_version=version, enqueued_at=now)
            gid = eval_group_id(round_id, ds.key, task.id)
            score = datetime.fromtimestamp((EVAL_SCORE + score_base + len(wanted)) / 1000, tz=timezone.utc)
            handle = await arq.enqueue_job(EVAL_FUNCTION, round_id, encode(job), _job_id=keys.arq_job_id(gid),
                                           _queue_name=keys.queue, _defer_until=score,
                                           _expires=timedelta(seconds=timeout_s + 3600))
            if handle is None:
                raise RuntimeError(f"eval job {keys.arq_job_id(gid)} already exists in arq")
            wanted[gid] = (ds.key, i, task.id)
    log.info("eval round %s: %d jobs enqueued ahead of training, pinned to policy version %d",
             round_id, len(wanted), version)


def eval_group_id(round_id: str, dataset: str, task_id: str) -> str:
    """An eval group's id (its arq job id is `Keys.arq_job_id` of it)."""
    return f"eval:{round_id}:{dataset}:{task_id}"


async def _withdraw(redis: Any, keys: Keys, gids: list[str], *, unfinished: list[str] | tuple[str, ...] = ()) -> None:
    """Take a round's jobs out of arq's queue: their entries and job keys (a worker that took one
    before this and starts it after reads no key: arq's "expired"), and arq's try counts.
    A finished job has nothing left to take: harmless. A job of `unfinished` (no group or error
    back yet) that a worker is running now is aborted as arq's `Job.abort` does (the worker
    cancels it within `ABORT_CHECK_S`, its engine requests get `/abort_request`): no engine time
    goes on for a round that is gone. Its hand-back, if any, finds no entry to return to."""
    from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix

    if not gids:
        return
    ids = [keys.arq_job_id(g) for g in gids]
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(keys.queue, *ids)
        pipe.delete(*(job_key_prefix + i for i in ids), *(retry_key_prefix + i for i in ids))
        await pipe.execute()
    if unfinished:
        running = [keys.arq_job_id(g) for g in unfinished]
        # one script: a job whose arq finish comes after this has its abort entry removed by that
        # finish (arq's finish_job ZREMs it); one finished before has no in-progress key to match
        await redis.eval(_ABORT_RUNNING_LUA, 1 + len(running), abort_jobs_ss,
                         *(in_progress_key_prefix + i for i in running), int(time.time() * 1000), *running)


# KEYS: arq's abort set, then the jobs' in-progress keys; ARGV: now (ms), then the job ids (in KEYS' order)
_ABORT_RUNNING_LUA = """
local n = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
    n = n + 1
  end
end
return n
"""


def _missing(rid: int, round_id: str, wanted: dict, got: dict, failed: dict, timeout_s: float, stream: str) -> str:
    missing: dict[str, list[str]] = {}
    for gid, (name, _i, task_id) in wanted.items():
        if gid not in got and gid not in failed:
            missing.setdefault(name, []).append(task_id)
    per = "; ".join(f"{name}: {len(ids)} missing (e.g. {', '.join(ids[:SHOW])})" for name, ids in missing.items())
    return (f"evaluation at rollout {rid}: {len(got) + len(failed)}/{len(wanted)} eval groups in {stream} after "
            f"{timeout_s:.0f}s (pipeline_eval_timeout_s); {per}. Are workers running on this namespace, with these "
            f"environments, and registering {EVAL_FUNCTION!r}? The round's queued jobs were withdrawn.")


def _output(rid: int, round_id: str, datasets: list, wanted: dict, got: dict, failed: dict, version: int,
            wait_s: float) -> tuple[dict, dict, dict[str, DatasetResult]]:
    from pipeline.slime.samples import to_trainer_group

    data: dict[str, dict[str, Any]] = {}
    metrics: dict[str, Any] = {"eval/pipeline/policy_version": version, "eval/pipeline/wait_s": wait_s}
    results: dict[str, DatasetResult] = {}
    stamps: list[int] = []
    for ds, _tasks in datasets:
        gids = sorted((g for g, (name, *_) in wanted.items() if name == ds.key), key=lambda g: wanted[g][1])
        entries = [Entry(*got[g]) for g in gids if g in got]
        lost = [g for g in gids if g in failed]
        for g in lost[:SHOW]:
            log.warning("eval round %s: group %s failed: %s", round_id, g, failed[g])
        metrics.update(dataset_metrics(ds.key, [e.group for e in entries], len(lost)))
        versions = {v for e in entries for s in e.group.samples if s.status is not Status.FAILED
                    for v in sample_versions(s)}
        results[ds.key] = dataset_result(rid, round_id, len(gids), [e.group for e in entries], versions or {version})
        if not entries:
            log.error("eval round %s: every group of %r failed; it is left out of slime's eval data", round_id, ds.key)
            continue
        wire = [s for e in entries for s in e.group.samples]
        stamps += [v for s in wire for v in s.policy_versions]
        data[ds.key] = {  # as slime's eval_rollout_single_dataset returns it, in task order
            "rewards": [s.reward for s in wire],
            "truncated": [s.status is Status.TRUNCATED for s in wire],
            "samples": [s for i, e in enumerate(entries) for s in to_trainer_group(e, i)],
        }
    if stamps:  # the versions the workers stamped on every generate call (the pinned one, or later)
        metrics["eval/pipeline/policy_version_min"] = min(stamps)
        metrics["eval/pipeline/policy_version_max"] = max(stamps)
    return data, metrics, results


def sample_versions(sample: Any) -> set[int]:
    """The policy versions of a sample's generated tokens (per token where recorded, else the
    per-call stamps)."""
    runs = {v for v, n in sample.token_version_runs if v >= 0 and n > 0}
    return runs or set(sample.policy_versions)
