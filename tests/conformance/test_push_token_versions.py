"""Weight pushes that keep the running requests (SGLang's in_place / retract pause), end to end: real
workers generate through smg -> SGLang 0.5.23's front -> the simulators (tests/support/engine_stack.py) while a
trainer loop (RedisDataSource + generate_rollout, train.py's order) pushes weights in that mode with
answers long enough that requests live through pushes. Every trained token carries the version of
the weights that generated it, as the label law can know it at the call (the test's own record of
which label was which version is the truth), and every trained token is within eta of the step that
trains it, the trainer's own per-token staleness metric included."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from pipeline.slime.weight_push import PushMode, push_weights
from pipeline.staleness import TrainerLoop, label_versions
from tests.support.engine_stack import START_TIMEOUT_S, shared_stack
from tests.support.policy_helpers import calc_config

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(START_TIMEOUT_S + 180)]

B, N, STEPS = 2, 2, 6
TRAIN_S = 0.3


def _config(redis_url, ns, *, eta, engine):
    return calc_config(redis_url, ns, engine=engine, eta=eta, batch=B, n=N, max_response_tokens=1024, concurrency=8)


def _trainer(args, source, engines, mode):
    """train.py's order: generate(r), train (a sleep), save, push the weights of version r + 1 labelled
    as slime's updater labels them (its k-th push is "k"; the push before the loop is "1" = version 0)."""
    from pipeline.slime.data_source import generate_rollout

    metrics = []
    push_weights(engines, "1", mode)
    for rid in range(STEPS):
        out = generate_rollout(args, rid, source)
        metrics.append(out.metrics)
        time.sleep(TRAIN_S)
        source.save(rid)
        push_weights(engines, str(rid + 2), mode)
    return metrics


def _model_runs(sample):
    """The (version, tokens) runs of the model's tokens, in order (template tokens carry -1)."""
    versions = sample.token_versions()[sample.loss_mask_array() == 1]
    runs: list[list[int]] = []
    for v in versions.tolist():
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return [tuple(r) for r in runs]


def _expected_runs(sample, truth):
    """The versions the label law gives the call's span labels, oldest first: a label the published
    map knew at the call (the engines' push and the next one) is its true version, a later one the
    call's stamp (a lower bound, never above the truth)."""
    (stamp,) = sample.policy_versions  # one call: nothing was aborted and resumed
    known = label_versions(stamp, start=0, loop=TrainerLoop.SYNC)
    versions = [max(stamp, known.get(label, stamp)) for label in sample.weight_versions]
    for label, version in zip(sample.weight_versions, versions):
        assert stamp <= version <= truth[label], (label, version, truth[label])
    return [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]


@pytest.mark.parametrize("mode, eta", [(PushMode.IN_PLACE, 2), (PushMode.RETRACT, 1)])
async def test_tokens_that_live_through_a_push_carry_their_weights_version(
        tmp_path, redis, redis_url, keys, namespace, mode, eta):
    from pipeline.config import parse_config
    from producers.enqueue import ProducerOptions, run_producer
    from scripts.bench.async_loop import RecordingSource
    from workers.settings import build_worker, stop_worker

    stack = await asyncio.to_thread(shared_stack)
    # ~150-token answers at 10 ms a token: 1.5 s each, pushes every ~0.3 s of training plus the wait
    await asyncio.to_thread(stack.configure, accuracy=0.6, tool_use=0.0, length_mu=5.0, length_sigma=0.3,
                            token_latency_s=0.01, latency_sigma=0.0, slots=64)
    (tmp_path / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "env": "calc", "prompt": f"What is {i} * 3?", "label": str(3 * i)}) + "\n"
        for i in range(40)))
    config = parse_config(_config(redis_url, namespace, eta=eta, engine=stack.router_url))
    workers = [build_worker(config, handle_signals=False)]
    runs = [asyncio.create_task(w.async_run()) for w in workers]
    producer = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", follow=True, epochs=2,
                                                redis=redis, options=ProducerOptions(poll_s=0.02)))
    args = SimpleNamespace(
        pipeline_redis_url=redis_url, pipeline_namespace=namespace, rollout_batch_size=B, n_samples_per_prompt=N,
        pipeline_eta=eta, pipeline_wait_timeout_s=60.0, pipeline_wait_log_s=5.0, pipeline_trainer_loop="sync",
        pipeline_publish_engine=False)
    source = RecordingSource(args)
    try:
        metrics = await asyncio.to_thread(_trainer, args, source, stack.engine_urls, mode)
    finally:
        source.close()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        for worker, task in zip(workers, runs):
            await stop_worker(worker, task)

    truth = {str(k + 1): k for k in range(STEPS + 1)}  # label -> the version the loop pushed under it
    spanning = 0
    for rid, group in source.trained:
        for sample in group.samples:
            runs_ = _model_runs(sample)
            assert [v for v, _ in runs_] == _expected_runs(sample, truth), (rid, sample.weight_versions, runs_)
            assert all(rid - v <= eta for v, _ in runs_), (rid, runs_)  # every trained token within eta
            spanning += len(runs_) > 1
    assert len(source.trained) == STEPS * B
    assert spanning >= 2, "no trained answer lived through a weight push: the test saw nothing"
    for step in metrics:
        assert step["rollout/pipeline/token_staleness_max"] <= eta
