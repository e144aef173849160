"""Multi-turn evaluation through the pipeline (pipeline/eval/evaluation.py, workers/eval_jobs.py):
a real redis-server, the engine path a cluster runs (the session's stack: smg -> SGLang's own
front -> the simulator, tests/support/engine_stack.py) and real arq workers; slime's own eval logging on
the output (conformance)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import sys
from types import SimpleNamespace

import pytest
import yaml

from pipeline.config import ConfigError, parse_config
from pipeline.eval.evaluation import load_eval_datasets, pass_at_k
from pipeline.schema import PromptJob, Task, encode_task_json
from pipeline.store.jobqueue import create_arq_pool, enqueue_prompt_job
from tests.support.engine_stack import START_TIMEOUT_S, EngineStack, shared_stack
from tests.workers.test_worker_jobs import config_dict, stack_engine, wait_for
from workers.settings import build_worker, stop_worker

N_TASKS = 3
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)  # a test's timeout includes the session stack's start


@pytest.fixture
def stack() -> EngineStack:
    return shared_stack()


def _write_datasets(tmp_path, datasets):
    tasks = [Task(id=f"e{i}", env="calc", prompt=f"What is {i} * 7?", label=str(7 * i)) for i in range(5)]
    tasks += [Task(id=f"s{i}", env="strict", prompt=f"What is {i} + 1?", label=str(i + 1)) for i in range(2)]
    tasks += [Task(id="g0", env="ghost", prompt="What is 1 + 1?", label="2")]  # no worker has this env
    (tmp_path / "eval_tasks.jsonl").write_bytes(b"".join(encode_task_json(t) + b"\n" for t in tasks))
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(datasets))
    return str(path)


DATASETS = [
    {"env": "calc", "tasks": "eval_tasks.jsonl", "n_samples": 4, "max_tasks": N_TASKS},
    {"name": "calc-greedy", "env": "calc", "tasks": "eval_tasks.jsonl", "n_samples": 2, "max_tasks": 2,
     "sampling": {"temperature": 0.0}},
]


def _args(redis_url, namespace, datasets_path, **extra):
    base = {"pipeline_redis_url": redis_url, "pipeline_namespace": namespace, "rollout_batch_size": 2,
            "n_samples_per_prompt": 4, "pipeline_eta": 2, "pipeline_eval_datasets": datasets_path,
            "pipeline_eval_timeout_s": 60}
    return SimpleNamespace(**{**base, **extra})


async def _counters(redis, keys):
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}


@contextlib.asynccontextmanager
async def _worker(config, concurrency=4):
    worker = build_worker(config, concurrency=concurrency, handle_signals=False)
    task = asyncio.create_task(worker.async_run())
    try:
        yield worker
    finally:
        # `stop_worker`, with the cancellation repeated: a cancel swallowed inside a Redis call
        # (redis-py's wait_for before Python 3.12) is handed on by the retry wrapper on 3.11+
        # (docs/reliability.md), but not on 3.10, where an in-process worker would poll on forever
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        await stop_worker(worker, task)


async def _evaluate(slime_mod, args, rid, ds):
    return await asyncio.to_thread(slime_mod.generate_rollout, args, rid, ds, True)


async def test_multi_turn_eval_round_pinned_and_apart_from_training(stack, redis, redis_url, keys, namespace, tmp_path):
    import pipeline.slime.data_source as ps

    args = _args(redis_url, namespace, _write_datasets(tmp_path, [*DATASETS, {"env": "ghost", "tasks": "eval_tasks.jsonl"}]))
    async with stack_engine(stack) as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        ds = ps.RedisDataSource(args)
        try:
            ds.publish(4)  # the trainer is at rollout 4
            published = int((await redis.hget(keys.policy, "version")).decode())
            await redis.hset(keys.counters, mapping={"enqueued": 7, "discarded": 2, "running": 0})
            before = await _counters(redis, keys)
            async with _worker(config):
                out = await _evaluate(ps, args, 5, ds)
            # eval(5) comes after step 5 and its push: it publishes what the next generate call
            # would (the engines' version), so its labels are known even after a run's last step
            pinned = int((await redis.hget(keys.policy, "version")).decode())
            assert pinned > published
            after = await _counters(redis, keys)
        finally:
            ds.close()
    # training untouched: admission counters, the buffer, its open set, dead letters, requeues
    for name in ("enqueued", "discarded", "running"):
        assert after.get(name, 0) == before.get(name, 0), name
    assert {k: v for k, v in after.items() if v} == {k: v for k, v in before.items() if v}
    assert await redis.xlen(keys.groups) == 0 and await redis.zcard(keys.open) == 0
    assert await redis.xlen(keys.dead) == 0 and await redis.llen(keys.requeue) == 0
    assert await redis.keys(f"{namespace}:eval:*") == [] and await redis.zcard(keys.queue) == 0
    assert await redis.keys(f"{namespace}:dedup:*") == []

    # a job that can never succeed (no worker knows its environment) is reported, not waited for;
    # a dataset left with no group is left out of slime's data
    assert list(out.data) == ["calc", "calc-greedy"] and out.metrics["eval/ghost/groups_failed"] == 1
    for name, tasks, n in (("calc", N_TASKS, 4), ("calc-greedy", 2, 2)):
        d = out.data[name]
        assert sorted(d) == ["rewards", "samples", "truncated"]
        assert len(d["rewards"]) == len(d["truncated"]) == len(d["samples"]) == tasks * n
        samples = d["samples"]
        assert [s.index for s in samples] == list(range(tasks * n))
        assert [s.group_index for s in samples] == [i for i in range(tasks) for _ in range(n)]
        assert [s.metadata["pipeline"]["task_id"] for s in samples[::n]] == [f"e{i}" for i in range(tasks)]
        assert d["rewards"] == [s.reward for s in samples]
        assert all(isinstance(t, bool) for t in d["truncated"])
        m = out.metrics
        assert m[f"eval/{name}/reward_mean"] == pytest.approx(sum(d["rewards"]) / len(d["rewards"]))
        assert m[f"eval/{name}/failure_rate"] == 0.0 and m[f"eval/{name}/groups_failed"] == 0
        assert m[f"eval/{name}/turns_mean"] > 1.0  # the calculator env: tool call, tool output, answer
        assert m[f"eval/{name}/response_tokens_mean"] == pytest.approx(
            sum(s.response_length for s in samples) / len(samples))
        passed = [sum(r >= 1.0 for r in d["rewards"][i * n:(i + 1) * n]) for i in range(tasks)]
        assert m[f"eval/{name}/pass@1"] == pytest.approx(sum(c / n for c in passed) / tasks)
        # its standard error over the tasks (the bench prints it beside each accuracy)
        per_task = [c / n for c in passed]
        mean = sum(per_task) / tasks
        assert m[f"eval/{name}/pass@1_stderr"] == pytest.approx(
            (sum((p - mean) ** 2 for p in per_task) / (tasks - 1) / tasks) ** 0.5)
        assert m[f"eval/{name}/pass@{n}"] == pytest.approx(sum(c > 0 for c in passed) / tasks)
        # pinned: the jobs carry the published version, and the workers stamped it on every call
        assert {s.metadata["pipeline"]["admission_version"] for s in samples} == {pinned}
        assert {v for s in samples for v in s.weight_versions} == {str(pinned)}
    assert out.metrics["eval/pipeline/policy_version"] == pinned
    assert out.metrics["eval/pipeline/policy_version_min"] == out.metrics["eval/pipeline/policy_version_max"] == pinned
    # the monitor's eval view (`{ns}:eval_results`): each dataset's last round, in blocking mode too
    from pipeline.eval.evaluation import read_results

    results = await read_results(redis, keys)
    assert {n: (r.rollout_id, r.tasks, r.failed, r.versions) for n, r in results.items()} == {
        "calc": (5, N_TASKS, 0, [pinned]), "calc-greedy": (5, 2, 0, [pinned]), "ghost": (5, 1, 1, [pinned])}
    assert results["calc"].pass_at_1 == pytest.approx(out.metrics["eval/calc/pass@1"]) and results["ghost"].pass_at_1 is None


async def test_a_retried_eval_job_keeps_its_place_ahead_of_training_jobs(redis, redis_url, keys, namespace):
    """An eval job whose try fails (a transient error: every episode failed against a dead engine,
    `on_failure: retry_all_failed`) comes back at its own eval place, not at arq's now + defer
    (issue 47): due at once below EVAL_SCORE_MAX, so the claim counts it in `workers.eval_share`,
    and run again before the training job queued behind it (one slot: the queue's order is the
    run order). On 37671f7 the training job ran between the eval job's two tries."""
    from pipeline.eval.evaluation import EVAL_SCORE_MAX, EvalDataset, _enqueue
    from pipeline.store.jobqueue import JOB_FUNCTION
    from tests.support.policy_helpers import trainer_started
    from workers.eval_jobs import run_eval_group
    from workers.sim.engine import serve_sim_engine
    from workers.sim.tokenizer import default_tokenizer_path

    ran: list[tuple[str, int, int]] = []

    async def eval_job(ctx, round_id, payload):  # the real eval job, its tries recorded
        ran.append(("eval", ctx["job_try"], ctx["score"]))
        return await run_eval_group(ctx, round_id, payload)

    async def training_job(ctx, payload):
        ran.append(("train", ctx["job_try"], ctx["score"]))
        return {"status": "recorded"}

    await trainer_started(redis, keys)
    async with serve_sim_engine() as sim:
        dead_url = sim.url  # gone before any job runs: every episode fails
    config = parse_config({**config_dict(redis_url, namespace, dead_url, max_tries=2),
                           "engine": {"url": dead_url, "tokenizer": default_tokenizer_path(), "max_retries": 0},
                           "environments": {"calc": {"kind": "calculator", "on_failure": "retry_all_failed"}}})
    arq = await create_arq_pool(redis_url, keys)
    try:
        assert await enqueue_prompt_job(arq, PromptJob(task=Task(id=f"{namespace}-t", env="calc", prompt="What is 1 * 3?",
                                                                 label="3"), epoch=0, n_samples=1), keys)
    finally:
        await arq.aclose()
    wanted: dict = {}
    task = Task(id="e0", env="calc", prompt="What is 2 * 7?", label="14")
    await _enqueue(redis, keys, "r1", [(EvalDataset(env="calc", tasks="-", n_samples=2), [task])], 0, 60.0, wanted)
    [gid] = wanted
    async with _worker(config, concurrency=1) as worker:
        _run_eval_as(worker, eval_job)
        worker.functions[JOB_FUNCTION] = dataclasses.replace(worker.functions[JOB_FUNCTION], coroutine=training_job)
        await wait_for(lambda: _zcard_is(redis, keys.queue, 0), 30, "every job run")
    assert [(kind, job_try) for kind, job_try, _ in ran] == [("eval", 1), ("eval", 2), ("train", 1)], ran
    assert ran[0][2] == ran[1][2] < EVAL_SCORE_MAX  # the retry taken at the eval job's own place
    [(_, fields)] = await redis.xrange(keys.eval_stream("r1"))
    assert b"try 2" in fields[b"error"]  # out of tries: reported to the round, once
    await redis.delete(keys.eval_stream("r1"))


def test_eval_reward_mean_leaves_out_failed_samples_and_counts_them():
    """As the trainer's `reward_mean/<env>` (pipeline/slime/data_source.py): a failed episode's 0 is no
    measurement; it is counted beside the mean (`samples_failed`), and never passes."""
    from pipeline.eval.evaluation import dataset_metrics
    from pipeline.schema import Sample, SampleGroup, Status

    def sample(reward, status):
        return Sample.build(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
                            reward=reward, status=status)

    groups = [SampleGroup(group_id=f"g{i}", task=Task(id=f"t{i}", env="calc", prompt="?", label="1"),
                          admission_version=0, n_samples=2, samples=pair)
              for i, pair in enumerate([[sample(1.0, Status.COMPLETED), sample(0.0, Status.FAILED)],
                                        [sample(0.5, Status.COMPLETED), sample(1.0, Status.TRUNCATED)]])]
    m = dataset_metrics("calc", groups)
    assert m["eval/calc/reward_mean"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert m["eval/calc/samples_failed"] == 1 and m["eval/calc/failure_rate"] == 0.25
    assert m["eval/calc/pass@1"] == pytest.approx((0.5 + 0.5) / 2)


async def test_eval_jobs_run_before_queued_training_jobs(stack, redis, redis_url, keys, namespace, tmp_path):
    import pipeline.slime.data_source as ps

    args = _args(redis_url, namespace, _write_datasets(tmp_path, DATASETS[:1]))
    async with stack_engine(stack) as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        ds = ps.RedisDataSource(args)
        arq = await create_arq_pool(redis_url, keys)
        try:
            ds.publish(0)
            training = [PromptJob(task=Task(id=f"{namespace}-t{i}", env="calc", prompt=f"What is {i} * 3?",
                                            label=str(3 * i)), epoch=0, n_samples=4) for i in range(4)]
            for job in training:  # queued before the eval round
                assert await enqueue_prompt_job(arq, job, keys)
            evaluation = asyncio.create_task(_evaluate(ps, args, 0, ds))
            await wait_for(lambda: _zcard_is(redis, keys.queue, len(training) + N_TASKS), 10, "the eval jobs queued")
            async with _worker(config, concurrency=1):  # one slot: the queue's order is the run order
                out = await evaluation
                await wait_for(lambda: _xlen_is(redis, keys.groups, len(training)), 30, "the training groups")
        finally:
            await arq.aclose()
            ds.close()
    eval_pushed = [_ms(s.metadata["pipeline"]["stream_id"]) for s in out.data["calc"]["samples"]]
    train_pushed = [_ms(entry_id.decode()) for entry_id, _ in await redis.xrange(keys.groups)]
    assert max(eval_pushed) <= min(train_pushed)
    assert len(eval_pushed) == N_TASKS * 4 and len(train_pushed) == len(training)


async def test_timeout_names_what_is_missing_and_withdraws_the_round(redis, redis_url, keys, namespace, tmp_path):
    import pipeline.slime.data_source as ps

    args = _args(redis_url, namespace, _write_datasets(tmp_path, DATASETS[:1]), pipeline_eval_timeout_s=1)
    ds = ps.RedisDataSource(args)  # no worker runs
    try:
        with pytest.raises(TimeoutError, match=r"0/3 eval groups .* calc: 3 missing \(e\.g\. e0, e1, e2\)"):
            await _evaluate(ps, args, 2, ds)
    finally:
        ds.close()
    assert await redis.zcard(keys.queue) == 0 and await redis.keys(f"arq:job:{namespace}:*eval*") == []  # this test's own (the server is shared)
    assert await _counters(redis, keys) == {}


def _run_eval_as(worker, body):
    """The worker runs `body` as its eval function (arq's Function record kept: tries, timeout)."""
    import dataclasses

    from pipeline.eval.evaluation import EVAL_FUNCTION

    worker.functions[EVAL_FUNCTION] = dataclasses.replace(worker.functions[EVAL_FUNCTION], coroutine=body)


async def _arq_keys_left(redis, namespace):
    """This namespace's arq keys but results (arq keeps a finished job's result: KEEP_RESULT_S)."""
    return sorted(k for k in await redis.keys(f"arq:*{namespace}:*") if not k.startswith(b"arq:result:"))


async def test_a_round_withdraws_the_jobs_whose_groups_came_back_before_arq_finished_them(
        redis, redis_url, keys, namespace, tmp_path):
    """A job's group (or error) is in the round's stream before arq finishes the job (the rest of
    `run_eval_group`, then arq's `finish_job`), and the round ends on the stream. A worker stopped
    in between (a drain past its grace, the tests' `stop_worker`) cancels the job, which arq hands
    back ("cancelled, will be run again": in-progress key deleted, entry kept at its place): a
    later worker ran it again for a round that was gone (test_multi_turn_eval_round_... found the
    ghost job left in the queue so, once in a full run). Here every job is held after
    `run_eval_group` returned (that window, widened) while the round ends and the worker stops."""
    import pipeline.slime.data_source as ps
    from workers.eval_jobs import run_eval_group
    from workers.sim.engine import serve_sim_engine

    async def held(ctx, *args):
        outcome = await run_eval_group(ctx, *args)  # the group (or error) is in the stream now
        await asyncio.Event().wait()  # arq's finish never comes: the worker stops first
        return outcome

    datasets = [{**DATASETS[0], "n_samples": 2, "max_tasks": 2}, {"env": "ghost", "tasks": "eval_tasks.jsonl"}]
    args = _args(redis_url, namespace, _write_datasets(tmp_path, datasets))
    async with serve_sim_engine() as sim:
        # heartbeats far apart: no sweep meanwhile (a held job stays owned until arq's finish anyway,
        # tests/workers/test_liveness_finish.py)
        # eval_share 1.0: the 3 jobs held at once (at the default share, 2 held jobs fill the eval slots)
        config = parse_config(config_dict(redis_url, namespace, sim.url, heartbeat_s=10.0, dead_after_s=30.0,
                                          eval_share=1.0))
        ds = ps.RedisDataSource(args)
        try:
            async with _worker(config) as worker:
                _run_eval_as(worker, held)
                out = await _evaluate(ps, args, 1, ds)
                assert await redis.zcard(keys.queue) == 0  # the round's end withdrew every job it enqueued
        finally:
            ds.close()
    assert len(out.data["calc"]["samples"]) == 2 * 2 and out.metrics["eval/ghost/groups_failed"] == 1
    # the stopped worker handed its jobs back to no entry: nothing to run again, no job key left
    assert await redis.zcard(keys.queue) == 0 and await _arq_keys_left(redis, namespace) == []


async def test_a_withdrawn_eval_job_that_retries_is_not_queued_again(redis, redis_url, keys, namespace):
    """arq hands a job that raised `Retry` back with ZINCRBY, which adds the entry again when its
    round withdrew it meanwhile (a round past its timeout withdraws the jobs still running): a job
    with no key, queued for nothing. The worker's hand-back moves only an entry still queued."""
    from arq.constants import in_progress_key_prefix
    from arq.worker import Retry

    from pipeline.eval.evaluation import EvalDataset, _enqueue, _withdraw
    from workers.jobs import CTX_KEY
    from workers.sim.engine import serve_sim_engine

    withdrawn = asyncio.Event()

    async def retries(ctx, round_id, payload):  # run_eval_group's transient-error path, after the withdrawal
        w = ctx[CTX_KEY]
        await w.liveness.job_started(ctx["job_id"])  # owned while it runs, as run_eval_group's are
        try:
            await withdrawn.wait()
        finally:
            await w.liveness.job_ended(ctx["job_id"])
        raise Retry(defer=60)

    task = Task(id="e0", env="calc", prompt="What is 2 * 7?", label="14")
    wanted: dict = {}
    await _enqueue(redis, keys, "r1", [(EvalDataset(env="calc", tasks="-"), [task])], 0, 60.0, wanted)
    [gid] = wanted
    in_progress = in_progress_key_prefix + keys.arq_job_id(gid)
    async with serve_sim_engine() as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        async with _worker(config) as worker:
            _run_eval_as(worker, retries)
            await wait_for(lambda: _exists(redis, in_progress), 30, "the job taken")
            await _withdraw(redis, keys, [gid])
            withdrawn.set()
            await wait_for(lambda: _gone(redis, in_progress), 10, "arq's hand-back")
            assert await redis.zcard(keys.queue) == 0
    assert await redis.zcard(keys.queue) == 0 and await _arq_keys_left(redis, namespace) == []


async def test_a_round_past_its_timeout_aborts_the_jobs_still_generating(stack, redis, redis_url, keys, namespace,
                                                                        tmp_path):
    """A round that passes `pipeline_eval_timeout_s` while its jobs generate withdraws them and
    aborts them (arq's Job.abort path): each request is aborted on the engine that runs it, not
    generated to its end (~50 s here) for a round that is gone. (The round's timeout leaves a
    loaded machine time to start the worker and the requests.)"""
    from arq.constants import in_progress_key_prefix

    import pipeline.slime.data_source as ps

    stack.configure(token_latency_s=0.5, tool_use=0.0, length_mu=4.6, length_sigma=0.01)  # ~100 tokens: ~50 s a request
    datasets = [{**DATASETS[0], "n_samples": 2, "max_tasks": 1}]
    args = _args(redis_url, namespace, _write_datasets(tmp_path, datasets), pipeline_eval_timeout_s=20)
    config = parse_config(config_dict(redis_url, namespace, stack.router_url))
    taken = in_progress_key_prefix + keys.arq_job_id("*")  # this namespace's jobs in progress
    ds = ps.RedisDataSource(args)
    round_ = None
    try:
        async with _worker(config):
            round_ = asyncio.create_task(_evaluate(ps, args, 1, ds))
            await wait_for(lambda: asyncio.sleep(0, stack.total_stats()["running"] == 2), 20, "the round's requests")
            assert len(await redis.keys(taken)) == 1
            with pytest.raises(TimeoutError, match=r"0/1 eval groups"):
                await round_
            await wait_for(lambda: asyncio.sleep(0, stack.total_stats()["aborted"] == 2), 5,
                           "the engines to abort the round's requests")
            await wait_for(lambda: _no_keys(redis, taken), 10, "arq's finish of the aborted job")
            assert stack.total_stats()["running"] == 0
    finally:
        if round_ is not None:  # its thread ends at the round's timeout: ds closes after it, as a trainer's would
            await asyncio.wait({round_}, timeout=60)
        ds.close()
    assert await redis.zcard(keys.queue) == 0 and await _arq_keys_left(redis, namespace) == []


async def _no_keys(redis, pattern):
    return not await redis.keys(pattern)


def test_datasets_file_errors_name_the_entry(tmp_path):
    with pytest.raises(ConfigError, match="entry 0 .*no task of env 'nope'"):
        load_eval_datasets(_write_datasets(tmp_path, [{"env": "nope", "tasks": "eval_tasks.jsonl"}]))
    with pytest.raises(ConfigError, match="entry 1 .*used twice"):
        load_eval_datasets(_write_datasets(tmp_path, [DATASETS[0], DATASETS[0]]))
    with pytest.raises(ConfigError, match="n_samples"):
        load_eval_datasets(_write_datasets(tmp_path, [{**DATASETS[0], "n_samples": 0}]))
    seeded = [{**DATASETS[0], "n_samples": 4, "sampling": {"sampling_seed": 7}}]
    with pytest.raises(ConfigError, match="entry 0 .*sampling_seed 7 does nothing.*deterministic-inference"):
        load_eval_datasets(_write_datasets(tmp_path, seeded))  # issue 32: silently useless on 2a5bbd0
    [(dataset, _)] = load_eval_datasets(_write_datasets(tmp_path, seeded), deterministic=True)
    assert dataset.sampling.sampling_seed == 7
    near_max = [{**seeded[0], "sampling": {"sampling_seed": 2**63 - 3}}]  # seed + 3 overflows at the 4th sample
    with pytest.raises(ConfigError, match=r"entry 0 .*sample index 3 exceeds 2\*\*63 - 1"):
        load_eval_datasets(_write_datasets(tmp_path, near_max), deterministic=True)
    jsonl = tmp_path / "eval.jsonl"
    _write_datasets(tmp_path, [])
    jsonl.write_text('{"env": "strict", "tasks": "eval_tasks.jsonl"}\n')
    [(dataset, tasks)] = load_eval_datasets(jsonl)
    assert dataset.key == "strict" and dataset.n_samples == 1 and [t.id for t in tasks] == ["s0", "s1"]
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


# ------------------------------------------------------------------ conformance: slime's own classes

@pytest.fixture
def slime_side():
    """pipeline.slime.data_source (and the modules that bind slime's classes at import) imported with the
    slime snapshot on sys.path, the originals put back afterwards."""
    from tests.support.conformance_support import require_slime

    ns = require_slime("slime.observability.rollout_metrics")
    names = ("pipeline.slime.samples", "pipeline.slime.data_source", "pipeline.eval.evaluation")
    saved = {name: sys.modules.pop(name, None) for name in names}
    try:
        ns.pipeline = importlib.import_module("pipeline.slime.data_source")
        assert ns.pipeline.SampleClass is ns.Sample
        yield ns
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
                setattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2], module)


@pytest.mark.conformance
async def test_eval_output_is_slimes_and_slimes_eval_logger_takes_it(stack, slime_side, redis, redis_url, keys, namespace,
                                                                      tmp_path):
    from slime.rollout.base_types import RolloutFnEvalOutput, call_rollout_fn

    rollout_metrics = slime_side.modules["slime.observability.rollout_metrics"]
    ps = slime_side.pipeline
    args = _args(redis_url, namespace, _write_datasets(tmp_path, DATASETS[:1]),
                 # what slime's log_eval_rollout_data reads
                 custom_eval_rollout_log_function_path=None, advantage_estimator="grpo", reward_key=None,
                 log_reward_category=None, log_passrate=True, n_samples_per_eval_prompt=4,
                 wandb_always_use_train_step=False, use_wandb=False, use_tensorboard=False)
    async with stack_engine(stack) as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        ds = ps.RedisDataSource(args)
        try:
            async with _worker(config):
                out = await asyncio.to_thread(call_rollout_fn, ps.generate_rollout, args, 1, ds, evaluation=True)
        finally:
            ds.close()
    assert type(out) is RolloutFnEvalOutput
    samples = out.data["calc"]["samples"]
    assert all(type(s) is slime_side.Sample for s in samples)
    assert all(s.status in (slime_side.Sample.Status.COMPLETED, slime_side.Sample.Status.TRUNCATED) for s in samples)
    logged = rollout_metrics.log_eval_rollout_data(1, args, out.data, dict(out.metrics))
    rewards = out.data["calc"]["rewards"]
    assert logged["eval/calc"] == pytest.approx(sum(rewards) / len(rewards))
    assert logged["eval/calc-truncated_ratio"] == sum(out.data["calc"]["truncated"]) / len(rewards)
    # slime's own pass@k over our rewards agrees with ours (rewards are 0/1 here)
    assert logged["eval/calc-pass@1"] == pytest.approx(out.metrics["eval/calc/pass@1"])
    assert logged["eval/calc-pass@4"] == pytest.approx(out.metrics["eval/calc/pass@4"])
    assert "eval/calc/response_len/mean" in logged and logged["eval/step"] == 1


async def _zcard_is(redis, key, n):
    return await redis.zcard(key) == n


async def _xlen_is(redis, key, n):
    return await redis.xlen(key) == n


async def _exists(redis, key):
    return bool(await redis.exists(key))


async def _gone(redis, key):
    return not await redis.exists(key)


def _ms(stream_id: str) -> int:
    return int(stream_id.split("-")[0])
