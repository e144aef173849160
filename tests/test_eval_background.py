"""Evaluation in the background (pipeline/eval_background.py, issue 40): the round's record in
Redis, the skip rule, a trainer restart that neither loses nor re-runs a round, a round that
failed reported failed, and the workers' share cap on eval slots. A real redis-server, the
simulated engine and real arq workers; slime's own loop runs it in
tests/test_conformance_slime.py (`test_background_eval_under_train_async`)."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
from rich.console import Console

from pipeline.config import parse_config
from pipeline.eval_background import report_finished
from pipeline.jobqueue import create_arq_pool, enqueue_prompt_job
from pipeline.metrics import figures
from pipeline.monitor import snapshot
from pipeline.monitor_view import print_once
from pipeline.schema import PromptJob, Task
from pipeline.show import main as show_main
from tests.test_evaluation import DATASETS, N_TASKS, _args, _evaluate, _worker, _write_datasets
from tests.test_worker_jobs import config_dict, wait_for
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
    import pipeline.slime as ps

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
    from pipeline.ledger import Ledger

    eval_ledger = Ledger(tmp_path / "ledger" / "eval")
    assert eval_ledger.steps() == [3] and len(eval_ledger.groups(3)) == N_TASKS
    assert json.loads((eval_ledger.dir / "round-00000003.json").read_text())["round_id"] == round_id
    console = Console(record=True, width=200)
    assert show_main(["--dir", str(tmp_path / "ledger"), "--eval", "--step", "3", "--position", "1"], console) == 0
    header = console.export_text()
    assert "reported under version  5 (logged at rollout step 4)" in header and f"{round_id} finished" in header


async def test_a_round_whose_engines_died_or_timed_out_is_reported_failed(redis, redis_url, keys, namespace,
                                                                         tmp_path):
    import pipeline.slime as ps

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
    import pipeline.slime as ps

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
