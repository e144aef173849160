"""Evaluation in the background (pipeline/eval/background.py, issue 40): the round's record in
Redis, the skip rule, a trainer restart that neither loses nor re-runs a round, a round that
failed reported failed, and the workers' share cap on eval slots. A real redis-server, the
simulated engine and real arq workers; slime's own loop runs it in
tests/conformance/test_conformance_slime.py (`test_background_eval_under_train_async`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import msgspec
import pytest
from rich.console import Console

from pipeline.config import parse_config
from pipeline.eval.background import report_finished
from pipeline.ops.metrics import figures
from pipeline.ops.monitor import snapshot
from pipeline.ops.monitor_view import print_once
from pipeline.ops.show import main as show_main
from pipeline.schema import PromptJob, Task
from pipeline.store.jobqueue import create_arq_pool, enqueue_prompt_job
from tests.pipeline.test_evaluation import DATASETS, N_TASKS, _args, _evaluate, _worker, _write_datasets
from tests.workers.test_worker_jobs import config_dict, wait_for
from workers.settings import eval_slots
from workers.sim.engine import SimConfig, serve_sim_engine
from workers.sim.tokenizer import default_tokenizer_path


def _background(redis_url, namespace, tmp_path, datasets=DATASETS[:1], **extra):
    return _args(redis_url, namespace, _write_datasets(tmp_path, datasets), pipeline_eval_mode="background",
                 num_rollout=100, **extra)


async def _done(redis, keys):
    return {k.decode(): msgspec.json.decode(v) for k, v in (await redis.hgetall(keys.eval_done)).items()}


async def _stats(redis, keys):
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.eval_stats)).items()}


async def test_skip_rule_and_a_restart_that_neither_loses_nor_reruns_the_round(redis, redis_url, keys, namespace,
                                                                               tmp_path):
    import pipeline.slime.data_source as ps

    args = _background(redis_url, namespace, tmp_path, pipeline_ledger_dir=str(tmp_path / "ledger"))
    async with serve_sim_engine() as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        first = ps.RedisDataSource(args)
        try:
            first.publish(3)
            began = time.monotonic()
            started = await _evaluate(ps, args, 3, first)  # no worker yet: the round stays queued
            call_s = time.monotonic() - began
            # the eval call after step 3 publishes what the engines hold then (train_async.py: what
            # generate(5) would): the push after step 3 has landed
            pinned = int((await redis.hget(keys.policy, "version")).decode())
            assert pinned == 4
            skipped = await _evaluate(ps, args, 4, first)  # due while the first is in flight: skipped
            now_held = int((await redis.hget(keys.policy, "version")).decode())  # after step 4's push: 5
        finally:
            first.close()  # the trainer dies with its round in flight
        assert started.data == {} and started.metrics["eval/pipeline/round_started"] == 1.0 and call_s < 5.0
        assert skipped.metrics["eval/pipeline/round_started"] == 0.0
        assert skipped.metrics["eval/pipeline/rounds_skipped"] == 1 and skipped.metrics["eval/pipeline/rounds_running"] == 1
        assert await redis.zcard(keys.queue) == N_TASKS and await redis.hlen(keys.eval_rounds) == 1
        # the monitor: rounds running, queued, skipped (its terminal view and its exports)
        snap = await snapshot(redis, keys)
        assert {k: snap.eval_rounds[k] for k in ("running", "queued", "skipped")} == {"running": 1, "queued": 0,
                                                                                     "skipped": 1}
        assert figures(snap)["eval_rounds/skipped"] == 1
        console = Console(record=True, width=140)
        print_once(snap, console)
        view = console.export_text()
        assert "eval rounds running" in view and "1 (+0 queued)" in view
        [round_id] = [k.decode() for k in await redis.hkeys(keys.eval_rounds)]
        async with _worker(config):  # the round runs while no trainer is up
            await wait_for(lambda: _xlen_at_least(redis, keys.eval_stream(round_id), N_TASKS), 30, "the round's groups")
        second = ps.RedisDataSource(args)  # the restarted trainer (a new run) finds the round
        try:
            reported = await asyncio.to_thread(report_finished, args, second)
            again = await asyncio.to_thread(report_finished, args, second)
        finally:
            second.close()
    assert (reported, again) == (1, 0)
    summary = (await _done(redis, keys))[round_id]
    assert summary["state"] == "finished" and summary["groups"] == N_TASKS and summary["groups_failed"] == 0
    # reported under the version its tokens came from: the jobs ran after the push that followed step 4
    assert summary["versions"] == {str(now_held): N_TASKS} and now_held == 5 and summary["rollout_id"] == 3
    assert await _stats(redis, keys) == {"seq": N_TASKS, "started": 1, "skipped": 1, "reported": 1}  # never re-run
    assert await redis.zcard(keys.queue) == 0 and await redis.hlen(keys.eval_rounds) == 0
    assert not await redis.exists(keys.eval_stream(round_id))
    # the ledger: the round's groups (rollout show --dir <ledger>/eval --step 3) and its summary
    from pipeline.ops.ledger import Ledger

    eval_ledger = Ledger(tmp_path / "ledger" / "eval")
    assert eval_ledger.steps() == [3] and len(eval_ledger.groups(3)) == N_TASKS
    assert json.loads((eval_ledger.dir / "round-00000003.json").read_text())["round_id"] == round_id
    console = Console(record=True, width=200)
    assert show_main(["--dir", str(tmp_path / "ledger"), "--eval", "--step", "3", "--position", "1"], console) == 0
    header = console.export_text()
    assert "reported under version  5 (logged at rollout step 4)" in header and f"{round_id} finished" in header


async def test_a_round_whose_engines_died_or_timed_out_is_reported_failed(redis, redis_url, keys, namespace,
                                                                         tmp_path):
    import pipeline.slime.data_source as ps

    args = _background(redis_url, namespace, tmp_path, pipeline_eval_max_rounds=2, pipeline_eval_timeout_s=1.5)
    async with serve_sim_engine() as sim:
        dead_url = sim.url  # the engine goes away before any eval job runs
    config = parse_config({**config_dict(redis_url, namespace, dead_url, max_tries=1),
                           "engine": {"url": dead_url, "tokenizer": default_tokenizer_path(), "max_retries": 0}})
    ds = ps.RedisDataSource(args)
    try:
        ds.publish(1)
        await _evaluate(ps, args, 1, ds)  # its jobs run against the dead engine
        [round_id] = await _round_ids(redis, keys)
        async with _worker(config):
            await wait_for(lambda: _xlen_at_least(redis, keys.eval_stream(round_id), N_TASKS), 30, "an entry per group")
        # reports the first (ended) and starts a second, which no worker runs: it times out
        second = await _evaluate(ps, args, 2, ds)
        await asyncio.sleep(1.6)
        reported = await asyncio.to_thread(report_finished, args, ds)
    finally:
        ds.close()
    assert second.metrics["eval/pipeline/rounds_reported_now"] == 1 and second.metrics["eval/pipeline/rounds_failed"] == 1
    assert reported == 1
    by_rollout = {s["rollout_id"]: s for s in (await _done(redis, keys)).values()}
    assert by_rollout[1]["state"] == "failed" and by_rollout[1]["groups_failed"] == N_TASKS
    assert "every group failed" in by_rollout[1]["reason"]
    assert by_rollout[2]["state"] == "failed" and "3 of 3 groups missing" in by_rollout[2]["reason"]
    assert await redis.zcard(keys.queue) == 0  # the timed-out round's jobs left the queue
    assert (await _stats(redis, keys))["failed"] == 2


async def test_eval_jobs_hold_at_most_their_share_of_worker_slots(redis, redis_url, keys, namespace, tmp_path):
    """4 slots, eval_share 0.5: a round of 5 eval jobs, queued ahead of 4 training jobs, runs on 2
    slots while training runs on the others (without the share, eval takes all 4 first)."""
    import pipeline.slime.data_source as ps

    assert [eval_slots(s, 4) for s in (1.0, 0.5, 0.3, 0.01)] == [4, 2, 1, 1]
    args = _background(redis_url, namespace, tmp_path, [{**DATASETS[0], "max_tasks": 5, "n_samples": 2}])
    in_progress = f"arq:in-progress:{keys.arq_job_id('eval:')}*"
    async with serve_sim_engine(SimConfig(token_latency_s=0.01, length_mu=3.0, length_sigma=0.1)) as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url, eval_share=0.5))
        ds = ps.RedisDataSource(args)
        arq = await create_arq_pool(redis_url, keys)
        try:
            ds.publish(0)
            for i in range(4):
                job = PromptJob(task=Task(id=f"{namespace}-t{i}", env="calc", prompt=f"What is {i} * 3?",
                                          label=str(3 * i)), epoch=0, n_samples=2)
                assert await enqueue_prompt_job(arq, job, keys)
            await _evaluate(ps, args, 0, ds)
            [round_id] = await _round_ids(redis, keys)
            most, trained_before_eval_done = 0, False
            async with _worker(config, concurrency=4):
                deadline = time.monotonic() + 60
                while await redis.xlen(keys.eval_stream(round_id)) < 5 and time.monotonic() < deadline:
                    most = max(most, len(await redis.keys(in_progress)))
                    trained_before_eval_done |= await redis.xlen(keys.groups) > 0
                    await asyncio.sleep(0.02)
        finally:
            await arq.aclose()
            ds.close()
    assert most == 2 and trained_before_eval_done


async def _round_ids(redis, keys):
    return [k.decode() for k in await redis.hkeys(keys.eval_rounds)]


async def _xlen_at_least(redis, key, n):
    return await redis.xlen(key) >= n


@pytest.fixture(autouse=True)
def _quiet_arq_logs(caplog):
    caplog.set_level("WARNING", logger="arq")


# ------------------------------------------------------------------ issue 47

def _sample(reward, *, runs=(), stamps=(), failed=False):
    from pipeline.schema import Sample, Status

    n = 4
    return Sample.build(tokens=[1, 2, 3, 4, 5, 6], response_length=n, loss_mask=[1] * n, rollout_log_probs=[0.0] * n,
                        reward=0.0 if failed else reward, status=Status.FAILED if failed else Status.COMPLETED,
                        token_version_runs=list(runs), policy_versions=list(stamps))


def _group(task_id, samples):
    from pipeline.schema import SampleGroup

    return SampleGroup(group_id=f"g-{task_id}", task=Task(id=task_id, env="calc", prompt="?", label="1"),
                       admission_version=5, n_samples=len(samples), samples=samples)


def test_a_mixed_group_is_reported_under_the_version_most_of_its_tokens_came_from():
    """Every task of a round with a result is in one version's figure (issue 47: rounds dropped
    their mixed groups, 7 of 20 in one run, so each version's figure missed the slow tasks): a
    group with tokens of versions 5 and 6 goes under the version of most of its tokens, counted
    as mixed there; a group whose every episode failed is counted failed; the dataset's result
    (the monitor's) covers every task."""
    from pipeline.eval.background import Finished, RoundRecord, split_round

    groups = {
        "a": _group("a", [_sample(1.0, runs=[(5, 4)]), _sample(0.0, runs=[(5, 4)])]),
        "b": _group("b", [_sample(1.0, runs=[(5, 4)]), _sample(1.0, failed=True)]),
        "c": _group("c", [_sample(1.0, runs=[(6, 4)]), _sample(1.0, runs=[(6, 4)])]),
        "d": _group("d", [_sample(0.0, runs=[(5, 1), (6, 3)]), _sample(1.0, runs=[(6, 4)])]),  # mixed: most of 6
        "e": _group("e", [_sample(0.0, stamps=[5, 6]), _sample(1.0, stamps=[5])]),  # mixed by stamps: most of 5
        "f": _group("f", [_sample(1.0, failed=True), _sample(1.0, failed=True)]),  # no result
    }
    wanted = [(f"eval:r:calc:{t}", "calc", i, t) for i, t in enumerate(groups)]
    record = RoundRecord(round_id="r", rollout_id=3, version=5, started_at=100.0, names=["calc"], wanted=wanted)
    fin = Finished(record=record, got={gid: (f"{i + 1}-0", groups[t]) for gid, _, i, t in wanted}, failed={},
                   missing=[], ended_at=110.0, now=111.0)
    summary, logs = split_round(fin)
    assert summary.versions == {5: 3, 6: 2} and summary.groups_mixed == 2 and summary.groups_failed == 1
    assert sorted(summary.mixed) == ["calc/d", "calc/e"]
    by_version = {m["eval/pipeline/policy_version"]: m for _step, _data, m in logs[:-1]}
    assert {v: (m["eval/calc/groups"], m["eval/calc/groups_mixed"]) for v, m in by_version.items()} == {
        5: (3, 1), 6: (2, 1)}
    assert sum(m["eval/calc/groups"] for m in by_version.values()) + summary.groups_failed == len(groups)
    # the reward mean leaves out failed samples (b's second), counted beside it
    assert by_version[5]["eval/calc/reward_mean"] == pytest.approx((1 + 0 + 1 + 0 + 1) / 5)
    assert by_version[5]["eval/calc/samples_failed"] == 1
    result = summary.results["calc"]
    assert (result.tasks, result.failed, result.mixed, result.versions) == (6, 1, 2, [5, 6])
    assert result.pass_at_1 == pytest.approx((0.5 + 0.5 + 1.0 + 0.5 + 0.5) / 5)
    assert result.samples_failed == 1 and result.reward_mean == pytest.approx(6 / 9)


async def test_the_monitor_shows_each_datasets_last_round(redis, redis_url, keys, namespace, tmp_path):
    """The monitor's eval view: per dataset, the last round's score, version, tasks and failed
    (`{ns}:eval_results`), in its terminal table, its figures and its Prometheus scrape."""
    import pipeline.slime.data_source as ps
    from pipeline.ops.metrics import prometheus_families

    datasets = [DATASETS[0], {"env": "ghost", "tasks": "eval_tasks.jsonl"}]
    args = _background(redis_url, namespace, tmp_path, datasets)
    async with _round_generated(ps, args, redis, keys, redis_url, namespace, N_TASKS + 1) as (ds, round_id):
        assert await asyncio.to_thread(report_finished, args, ds) == 1
    snap = await snapshot(redis, keys)
    calc, ghost = snap.eval_results["calc"], snap.eval_results["ghost"]
    # eval(3) under train_async.py publishes version 4 (what the engines hold after step 3's push)
    assert (calc.rollout_id, calc.round_id, calc.tasks, calc.failed, calc.versions) == (3, round_id, N_TASKS, 0, [4])
    assert calc.pass_at_1 is not None and 0.0 <= calc.pass_at_1 <= 1.0
    assert (ghost.tasks, ghost.failed, ghost.pass_at_1, ghost.versions) == (1, 1, None, [])
    f = figures(snap)
    assert f["eval/calc/tasks"] == N_TASKS and f["eval/calc/version"] == 4 and f["eval/ghost/failed"] == 1
    assert f["eval/calc/pass_at_1"] == pytest.approx(calc.pass_at_1)
    scraped = {(m.name, s.labels.get("dataset")): s.value for m in prometheus_families(snap) for s in m.samples}
    assert scraped[("rollout_eval_last_round_tasks", "calc")] == N_TASKS
    console = Console(record=True, width=140)
    print_once(snap, console)
    view = console.export_text()
    assert "evaluation (last round reported, per dataset)" in view
    [row] = [line for line in view.splitlines() if line.lstrip("│ ").startswith("calc ")]
    assert f"{calc.pass_at_1:.3f}" in row and " 4 " in row and f" {N_TASKS} " in row, row


@contextlib.asynccontextmanager
async def _round_generated(ps, args, redis, keys, redis_url: str, namespace: str, entries: int):
    """A trainer (slime's data source) at step 3 whose eval call started one background round, run by a
    worker on the simulator until its stream holds `entries`: yields (the data source, the round id)."""
    async with serve_sim_engine() as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        ds = ps.RedisDataSource(args)
        try:
            ds.publish(3)
            await _evaluate(ps, args, 3, ds)
            [round_id] = await _round_ids(redis, keys)
            async with _worker(config):
                await wait_for(lambda: _xlen_at_least(redis, keys.eval_stream(round_id), entries), 30, "the round")
            yield ds, round_id
        finally:
            ds.close()


@pytest.mark.parametrize("crash_at", ["ledger", "after_log", "retire"])
async def test_a_round_is_logged_once_whatever_point_the_trainer_dies_at(redis, redis_url, keys, namespace, tmp_path,
                                                                         monkeypatch, crash_at):
    """A trainer killed while reporting a round (before its log, after it, or before the retire
    transaction): the next trainer reports it; its lines reach the logger once in all (issue 47:
    a crash between the log and the retire logged it to wandb twice)."""
    import pipeline.eval.background as eb
    import pipeline.slime.data_source as ps

    logged: list[int] = []
    real_log, real_retire, real_ledger = eb.log_eval, eb._retire, eb._write_ledger

    def recording_log(args, step, data, metrics):
        logged.append(step)
        return real_log(args, step, data, metrics)

    class Killed(Exception):
        pass

    def crash(*_a, **_k):
        raise Killed(crash_at)

    def log_then_crash(args_, step, data, metrics):
        out = recording_log(args_, step, data, metrics)
        if "eval/pipeline/round_s" in metrics:  # the round's own line: the last one it logs
            raise Killed(crash_at)
        return out

    args = _background(redis_url, namespace, tmp_path)
    async with _round_generated(ps, args, redis, keys, redis_url, namespace, N_TASKS) as (first, round_id):
        monkeypatch.setattr(eb, "log_eval", log_then_crash if crash_at == "after_log" else recording_log)
        monkeypatch.setattr(eb, "_write_ledger", crash if crash_at == "ledger" else real_ledger)
        monkeypatch.setattr(eb, "_retire", crash if crash_at == "retire" else real_retire)
        with pytest.raises(Killed):
            await asyncio.to_thread(report_finished, args, first)
    monkeypatch.setattr(eb, "log_eval", recording_log)
    monkeypatch.setattr(eb, "_write_ledger", real_ledger)
    monkeypatch.setattr(eb, "_retire", real_retire)
    second = ps.RedisDataSource(args)  # the restarted trainer
    try:
        assert await asyncio.to_thread(report_finished, args, second) == 1
        assert await asyncio.to_thread(report_finished, args, second) == 0
    finally:
        second.close()
    # the version's slice (version 4: step 3) and the round's own line (its eval call's step, 3)
    assert logged == [3, 3], logged
    assert (await _done(redis, keys))[round_id]["state"] == "finished" and await redis.hlen(keys.eval_rounds) == 0
    assert (await _stats(redis, keys))["reported"] == 1


async def test_a_resumed_trainer_replaying_an_eval_call_starts_no_second_round(redis, redis_url, keys, namespace,
                                                                              tmp_path, monkeypatch):
    """slime resumed from a checkpoint before rollout 3 replays eval(3): the round that call
    started (in flight, or reported) is the only one for rollout 3 (`{ns}:eval_calls`), even with
    room for more rounds. A call that died while enqueueing (its jobs withdrawn, no record left)
    starts its round when made again, once."""
    import pipeline.eval.background as eb
    import pipeline.slime.data_source as ps

    args = _background(redis_url, namespace, tmp_path, pipeline_eval_max_rounds=3)
    real_enqueue = eb._enqueue

    async def dies_half_way(redis_, keys_, round_id, datasets, version, timeout_s, wanted, score_base=0):
        await real_enqueue(redis_, keys_, round_id, [(datasets[0][0], datasets[0][1][:1])], version, timeout_s, wanted,
                           score_base)
        raise Interrupted("the trainer died after one job was enqueued")

    async with serve_sim_engine() as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        first = ps.RedisDataSource(args)
        try:
            first.publish(2)
            monkeypatch.setattr(eb, "_enqueue", dies_half_way)
            with pytest.raises(Interrupted):
                await _evaluate(ps, args, 2, first)
            monkeypatch.setattr(eb, "_enqueue", real_enqueue)
            assert await redis.zcard(keys.queue) == 0 and await redis.hlen(keys.eval_rounds) == 0
            started = await _evaluate(ps, args, 3, first)
        finally:
            first.close()
        resumed = ps.RedisDataSource(args)
        try:
            resumed.publish(2)
            again_2 = await _evaluate(ps, args, 2, resumed)  # the call that died: its round now, once
            again_3 = await _evaluate(ps, args, 3, resumed)  # in flight: no second round
            rounds = {msgspec.json.decode(v)["rollout_id"] for v in await redis.hvals(keys.eval_rounds)}
            assert rounds == {2, 3} and await redis.zcard(keys.queue) == 2 * N_TASKS
            async with _worker(config):
                await wait_for(lambda: _no_rounds_left(args, resumed, redis, keys), 60, "both rounds reported")
            again_3_after = await _evaluate(ps, args, 3, resumed)  # reported: still none
        finally:
            resumed.close()
    assert started.metrics["eval/pipeline/round_started"] == 1.0 and again_2.metrics["eval/pipeline/round_started"] == 1.0
    assert again_3.metrics["eval/pipeline/round_started"] == 0.0
    assert again_3_after.metrics["eval/pipeline/round_started"] == 0.0
    stats = await _stats(redis, keys)
    assert stats["started"] == 2 and stats["reported"] == 2 and stats.get("skipped", 0) == 0
    assert sorted(s["rollout_id"] for s in (await _done(redis, keys)).values()) == [2, 3]
    assert await redis.zcard(keys.queue) == 0


class Interrupted(Exception):
    pass


async def _no_rounds_left(args, ds, redis, keys):
    await asyncio.to_thread(report_finished, args, ds)
    return await redis.hlen(keys.eval_rounds) == 0


async def test_eval_episodes_at_the_engine_are_capped_by_the_share(redis, redis_url, keys, namespace, tmp_path):
    """`workers.eval_share` caps eval requests at the engine, not only job slots: 4 slots x 2
    training samples, share 0.5, hold 4 eval episodes at once, though a pass@8 eval job is 8
    requests (issue 47: 2 eval slots x 8 = 16 at the engine). Its default keeps training a share."""
    import pipeline.slime.data_source as ps

    args = _background(redis_url, namespace, tmp_path, [{**DATASETS[0], "n_samples": 8}])
    async with serve_sim_engine(SimConfig(token_latency_s=0.01, length_mu=3.0, length_sigma=0.1)) as sim:
        config = parse_config({**config_dict(redis_url, namespace, sim.url, eval_share=0.5, concurrency=4),
                               "rollout": {"max_response_tokens": 512, "n_samples_per_prompt": 2}})
        ds = ps.RedisDataSource(args)
        try:
            ds.publish(0)
            await _evaluate(ps, args, 0, ds)
            [round_id] = await _round_ids(redis, keys)
            async with _worker(config, concurrency=4):
                await wait_for(lambda: _xlen_at_least(redis, keys.eval_stream(round_id), N_TASKS), 60, "the round")
        finally:
            ds.close()
    assert sim.engine.stats["requests"] >= N_TASKS * 8 and sim.engine.stats["max_running"] == 4
    from workers.eval_jobs import eval_episode_slots

    assert parse_config(config_dict(redis_url, namespace, sim.url)).workers.eval_share == 0.5  # the default
    assert eval_episode_slots(0.5, 4, 2) == 4 and eval_episode_slots(0.01, 4, 2) == 1
