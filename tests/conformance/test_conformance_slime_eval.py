"""Background evaluation under slime's own train_async.py (issue 40): the snapshot's loop
(scripts/oracle/slime_loop.py) calls `rollout_manager.eval` every `--eval-interval` steps,
slime's `RolloutManager.eval` calls the pipeline's rollout function with `evaluation=True`, and
real workers run the rounds on the simulator while the loop trains and pushes weights. Checked:
the loop never waits for a round (each eval call's wait is measured against the rounds'
durations, and steps trained while a round ran); every result is logged through slime's own
`log_eval_rollout_data` at the rollout step of the version it is reported under, and every
generate call of every reported sample ran on the weights of that version (the oracle: which
policy version each pushed label really was); groups with tokens of two versions are named,
never reported."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from tests.conformance.test_conformance_slime import _loop_config, slime  # noqa: F401  (slime: the module fixture)
from tests.pipeline.test_evaluation import _write_datasets

pytestmark = pytest.mark.conformance

EVAL_TASKS, EVAL_N = 5, 2
NUM_ROLLOUT, EVAL_INTERVAL = 8, 2  # eval after steps 1, 3, 5 and 7 (the last waits for what is in flight)


@pytest.mark.timeout(180)
async def test_background_eval_under_train_async(slime, monkeypatch, tmp_path, redis, redis_url, keys,  # noqa: F811
                                                 namespace):
    from pipeline.config import parse_config
    from producers.enqueue import ProducerOptions, run_producer
    from scripts.oracle.slime_loop import Cluster, install, load_loop, slime_args
    from workers.settings import build_worker, stop_worker
    from workers.sim.engine import SimConfig, serve_sim_engine

    loop = load_loop(slime.path, "train_async")
    import slime.observability.rollout_metrics as rollout_metrics  # imported by slime.ray.rollout
    reported: list[tuple[int, dict, dict]] = []  # what the pipeline hands slime's eval logger
    logged: list[dict] = []  # what slime's logger hands wandb/tensorboard
    slime_log = rollout_metrics.log_eval_rollout_data

    def capture(rollout_id, args, data, extra_metrics=None):
        reported.append((rollout_id, data, dict(extra_metrics or {})))
        return slime_log(rollout_id, args, data, extra_metrics)

    monkeypatch.setattr(rollout_metrics, "log_eval_rollout_data", capture)
    # the worker runs in this process: its start-up gc.freeze() of the whole heap (a worker
    # process's tweak) would leave it frozen, and the trainer side's conversions without their GC trick
    monkeypatch.setattr("workers.settings._quiet_garbage_collector", lambda: None)
    monkeypatch.setattr(rollout_metrics.logging_utils, "log", lambda args, metrics, step_key: logged.append(
        {**metrics, "_step_key": step_key}))
    (tmp_path / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "env": "calc", "prompt": f"What is {i} * 3?", "label": str(3 * i)}) + "\n"
        for i in range(60)))
    datasets = _write_datasets(tmp_path, [{"env": "calc", "tasks": "eval_tasks.jsonl", "n_samples": EVAL_N,
                                           "max_tasks": EVAL_TASKS}])
    async with serve_sim_engine(SimConfig(accuracy=0.6, token_latency_s=0.004)) as sim:
        config = parse_config({**_loop_config(redis_url, namespace, eta=1, engine=sim.url),
                               "workers": {"concurrency": 4, "eval_share": 0.5, "heartbeat_s": 0.5,
                                           "dead_after_s": 5.0, "poll_delay_s": 0.02}})
        worker = build_worker(config, handle_signals=False)
        run = asyncio.create_task(worker.async_run())
        producer = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", follow=True, epochs=5,
                                                    redis=redis, options=ProducerOptions(poll_s=0.02)))
        cluster = Cluster([sim.url], train_s=0.3)
        pipeline_args = dict(
            pipeline_redis_url=redis_url, pipeline_namespace=namespace, rollout_batch_size=3, n_samples_per_prompt=2,
            pipeline_eta=1, pipeline_wait_timeout_s=60.0, pipeline_trainer_loop="async", pipeline_publish_engine=False,
            pipeline_eval_datasets=datasets, pipeline_eval_mode="background", pipeline_eval_timeout_s=60.0,
            eval_interval=EVAL_INTERVAL,
            # what slime's log_eval_rollout_data reads
            custom_eval_rollout_log_function_path=None, advantage_estimator="grpo", reward_key=None,
            log_reward_category=None, log_passrate=True, n_samples_per_eval_prompt=EVAL_N,
            wandb_always_use_train_step=False, use_wandb=False, use_tensorboard=False,
        )
        try:
            install(monkeypatch, loop, slime, cluster)
            await asyncio.to_thread(loop.train, slime_args(pipeline_args, num_rollout=NUM_ROLLOUT, interval=1,
                                                           save_interval=2))
            await asyncio.to_thread(cluster.managers[-1].close)
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            await stop_worker(worker, run)
    [manager] = cluster.managers
    calls = dict(manager.eval_calls)
    assert sorted(calls) == [1, 3, 5, 7]
    rounds = [msgspec.json.decode(v) for v in (await redis.hgetall(keys.eval_done)).values()]
    stats = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.eval_stats)).items()}
    assert await redis.hlen(keys.eval_rounds) == 0 and stats["started"] == len(rounds) >= 2
    assert stats["started"] + stats.get("skipped", 0) == 4  # every due round started or was skipped, counted
    assert all(r["state"] == "finished" for r in rounds) and 7 in {r["rollout_id"] for r in rounds}  # the last runs

    # not held: the eval calls before the last return at once while the rounds run for seconds,
    # and the loop trains steps while a round runs (Redis's clock and the steps' are this machine's)
    held = [calls[r] for r in (1, 3, 5)]
    shortest = min(r["round_s"] for r in rounds)
    assert max(held) < shortest / 4, (held, shortest)
    during = {r["rollout_id"]: [rid for rid, start, end in cluster.steps_at
                                if r["started_at"] <= start and end <= r["started_at"] + r["round_s"]]
              for r in rounds}
    assert any(during.values()), (during, cluster.steps_at)
    print(f"eval calls waited {calls} s; rounds {[(r['rollout_id'], round(r['round_s'], 2)) for r in rounds]} s; "
          f"steps trained during each {during}; versions {[r['versions'] for r in rounds]}; "
          f"mixed {[r['groups_mixed'] for r in rounds]}; stats {stats}")

    # each version's results at that version's step: every call of every sample of a group on that
    # version, but in a mixed group (tokens of several versions: reported under one of them, counted)
    truth = {label: version for (_run, label), version in cluster.truth.items()}
    slices = [(rid, data, metrics) for rid, data, metrics in reported if data]
    assert slices
    mixed_reported = 0
    for rid, data, metrics in slices:
        version = metrics["eval/pipeline/policy_version"]
        assert rid == version - 1, (rid, version)
        samples = data["calc"]["samples"]
        mixed_here = 0
        for first in range(0, len(samples), EVAL_N):
            group = samples[first:first + EVAL_N]
            labels = [label for sample in group for label in sample.metadata["engine_weight_versions"]]
            versions = {truth[label] for label in labels} | {int(v) for s in group for v in s.weight_versions}
            assert labels and version in versions, (labels, version)
            mixed_here += versions != {version}
        assert metrics["eval/calc/groups_mixed"] == mixed_here and metrics["eval/calc/groups"] * EVAL_N == len(samples)
        mixed_reported += mixed_here
    assert mixed_reported == sum(r["groups_mixed"] for r in rounds)  # every mixed group in a figure, counted
    pushes_during = sum(len(r["versions"]) + r["groups_mixed"] - 1 for r in rounds)
    mixed = [name for r in rounds for name in r["mixed"]]
    assert len(mixed) == sum(r["groups_mixed"] for r in rounds)  # every mixed group named
    assert pushes_during >= 1  # some round lived through a push: its groups span versions

    # slime's logger put each version's eval/calc on eval/step = that version's step
    by_step = {m["eval/step"]: m for m in logged if "eval/calc" in m}
    assert {rid for rid, *_ in slices} == set(by_step)
    assert all(m["_step_key"] == "eval/step" and "eval/calc-pass@2" in m for m in by_step.values())
    bookkeeping = [m for m in logged if "eval/pipeline/rounds_running" in m]
    assert [m["eval/step"] for m in bookkeeping] == [1, 3, 5, 7]
    assert bookkeeping[-1]["eval/pipeline/rounds_running"] == 0 == bookkeeping[-1]["eval/pipeline/rounds_queued"]
