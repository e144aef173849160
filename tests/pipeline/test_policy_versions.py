"""Staleness in policy versions on the real pipeline, driven in slime's own order (issue 10).

redis-server, the engine path a cluster runs (the session's stack: smg -> SGLang's own front ->
the simulator, tests/support/engine_stack.py; the labels and version spans are SGLang's TokenizerManager's
and scheduler's), real arq workers, the producer and `RedisDataSource`, with a trainer that calls
them exactly as slime's train_async.py does (read from the pinned snapshot,
../shared/third_party/slime/train_async.py):

    source = DataSource(args)            # RolloutManager.__init__
    source.load(start - 1)               # resume (checkpoint start - 1), or start = 0
    update_weights()                     # label str(1): slime's updater counts pushes from 0
    gen(start)
    for r in range(start, N):
        data = gen(r); gen(r + 1)        # r + 1 is generated while r trains
        train(r); save(r)
        if (r + 1) % interval == 0: update_weights()   # after gen(r + 1) finished

The engine's labels are slime's push counter: "1", "2", ... and "1" again after a resume.
The oracle knows which policy version each (run, label) really was and checks every trained
token: its lag is <= eta, and the stamp the pipeline trained on is never newer than the truth.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.state import PipelineState
from producers.enqueue import ProducerOptions, run_producer
from tests.support.engine_stack import START_TIMEOUT_S, shared_stack
from tests.support.policy_helpers import calc_config
from workers.settings import build_worker, stop_worker

B, N = 3, 2
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 180)  # a test's timeout includes the session stack's start


@pytest.fixture
def stack():
    running = shared_stack()
    running.configure()
    return running


def _post(url: str, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        reply.read()


class SlimeAsyncTrainer(threading.Thread):
    """train_async.py's call sequence against the pipeline; records the oracle's facts."""

    def __init__(self, args: SimpleNamespace, engine_urls: list[str], *, run: int, start: int, steps: int, interval: int,
                 truth: dict[tuple[int, str], int], actor_init_s: float = 0.0):
        super().__init__(daemon=True)
        self.args, self.engine_urls, self.run_no = args, engine_urls, run
        self.start_id, self.steps, self.interval, self.truth = start, steps, interval, truth
        self.actor_init_s = actor_init_s
        self.trained: dict[int, list[list[Any]]] = {}
        self.stats: dict[int, Any] = {}
        self.pushes = 0
        self.error: BaseException | None = None

    def update_weights(self, version: int) -> None:
        """slime's updater, on every engine: pause (aborts running requests), push, label
        str(push count), continue."""
        self.pushes += 1
        self.truth[(self.run_no, str(self.pushes))] = version
        for path, body in (("/pause_generation", {}), ("/update_weight_version", {"new_version": str(self.pushes)}),
                           ("/continue_generation", {})):
            for url in self.engine_urls:
                _post(url, path, body)

    def run(self) -> None:
        source = RedisDataSource(self.args)
        try:
            time.sleep(self.actor_init_s)  # Megatron init: workers and producer must not burn tasks meanwhile
            source.load(self.start_id - 1 if self.start_id else None)
            self.update_weights(self.start_id)
            end = self.start_id + self.steps
            pending = self._generate(source, self.start_id)
            for r in range(self.start_id, end):
                self.trained[r] = pending
                if r + 1 < end:
                    pending = self._generate(source, r + 1)
                time.sleep(0.05)  # train(r)
                source.save(r)
                if (r + 1) % self.interval == 0:
                    self.update_weights(r + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            source.close()

    def _generate(self, source: RedisDataSource, rid: int) -> list[list[Any]]:
        out = generate_rollout(self.args, rid, source)
        self.stats[rid] = source.last_stats
        return out.samples


def _args(redis_url: str, ns: str, *, eta: int, interval: int) -> SimpleNamespace:
    return SimpleNamespace(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=B, n_samples_per_prompt=N,
        pipeline_eta=eta, pipeline_wait_timeout_s=60.0, update_weights_interval=interval,
        sglang_router_ip="127.0.0.1", sglang_router_port=None,  # set per test
    )


def _config(redis_url: str, ns: str, *, eta: int, engine: str) -> dict[str, Any]:
    return calc_config(redis_url, ns, engine=engine, eta=eta, batch=B, n=N, max_response_tokens=256, concurrency=4)


def _write_tasks(path, count: int) -> None:
    path.write_text("".join(
        json.dumps({"id": f"t{i}", "env": "calc", "prompt": f"What is {i} * 3?", "label": str(3 * i)}) + "\n"
        for i in range(count)
    ))


def _check_lags(trainer: SlimeAsyncTrainer, eta: int) -> int:
    """Every trained call: stamp <= true version, rollout - true version <= eta. Returns calls checked."""
    checked = 0
    for rid, groups in trainer.trained.items():
        assert len(groups) == B, f"rollout {rid} got {len(groups)} groups"
        for group in groups:
            for sample in group:
                labels = sample.metadata["engine_weight_versions"]
                stamps = [int(v) for v in sample.weight_versions]  # what slime sees: policy versions
                run = sample.metadata["pipeline"]["policy_run"]
                if sample.remove_sample:
                    continue
                assert len(labels) == len(stamps) and stamps, (labels, stamps)
                for label, stamp in zip(labels, stamps):
                    truth = trainer.truth[(run, label)] if run == trainer.run_no else min(
                        trainer.truth[(run, label)], trainer.start_id)
                    assert stamp <= truth, f"rollout {rid}: stamped {stamp}, the weights were {truth}"
                    assert rid - truth <= eta, f"rollout {rid} trained tokens of version {truth} (eta {eta})"
                    checked += 1
    return checked


@pytest.mark.parametrize("interval, eta", [(1, 1), (2, 2)])
async def test_resume_from_a_checkpoint_trains_on_with_bounded_lag(stack, tmp_path, redis, redis_url, keys, namespace,
                                                                   interval, eta):
    """Run 1 trains rollouts 0-3; the trainer dies; run 2 resumes from checkpoint 3 with the engines'
    labels back at "1" (slime's counter restarts) and trains 4-7: no stale storm, every lag <= eta."""
    _write_tasks(tmp_path / "tasks.jsonl", 60)
    truth: dict[tuple[int, str], int] = {}
    stack.configure(accuracy=0.6)
    config = parse_config(_config(redis_url, namespace, eta=eta, engine=stack.router_url))
    workers = [build_worker(config, handle_signals=False) for _ in range(2)]
    runs = [asyncio.create_task(w.async_run()) for w in workers]
    producer = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", follow=True, epochs=5,
                                                redis=redis, options=ProducerOptions(poll_s=0.02)))
    port = int(stack.router_url.rsplit(":", 1)[1])
    try:
        for run, start in ((1, 0), (2, 4)):
            args = _args(redis_url, namespace, eta=eta, interval=interval)
            args.sglang_router_port = port
            trainer = SlimeAsyncTrainer(args, stack.engine_urls, run=run, start=start, steps=4, interval=interval,
                                        truth=truth)
            trainer.start()
            while trainer.is_alive():
                await asyncio.sleep(0.05)
            if trainer.error is not None:
                raise trainer.error
            assert _check_lags(trainer, eta) > 0
            stale = sum(s.stale for s in trainer.stats.values())
            assert stale <= B, f"run {run}: {stale} groups rejected stale"
            assert max(max(s.staleness, default=0) for s in trainer.stats.values()) <= eta
            for url in stack.engine_urls:  # engines restart too
                await asyncio.to_thread(_post, url, "/update_weight_version", {"new_version": "default"})
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        for worker, task in zip(workers, runs):
            await stop_worker(worker, task)
    counters = await PipelineState(redis, keys).counters()
    assert counters.get(Counter.ACCEPTED, 0) == 8 * B


async def test_workers_and_producer_started_before_the_trainer_train_no_startup_failures(
        stack, tmp_path, redis, redis_url, keys, namespace):
    """Workers on `engine: auto` and the producer start well before slime: the producer waits for the
    trainer's settings, the workers for its engine URL and first policy version; nothing fails."""
    _write_tasks(tmp_path / "tasks.jsonl", 30)
    truth: dict[tuple[int, str], int] = {}
    config = parse_config(_config(redis_url, namespace, eta=1, engine="auto"))
    worker = build_worker(config, handle_signals=False)
    run = asyncio.create_task(worker.async_run())
    producer = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", follow=True,
                                                redis=redis, options=ProducerOptions(poll_s=0.02)))
    try:
        await asyncio.sleep(2.0)  # the startup window: slime is still launching
        assert await redis.xlen(keys.groups) == 0
        args = _args(redis_url, namespace, eta=1, interval=1)
        args.sglang_router_port = int(stack.router_url.rsplit(":", 1)[1])
        trainer = SlimeAsyncTrainer(args, stack.engine_urls, run=1, start=0, steps=3, interval=1, truth=truth,
                                    actor_init_s=1.5)
        trainer.start()
        while trainer.is_alive():
            await asyncio.sleep(0.05)
        if trainer.error is not None:
            raise trainer.error
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await stop_worker(worker, run)
    trained = [s for groups in trainer.trained.values() for g in groups for s in g]
    assert len(trained) == 3 * B * N and not any(s.remove_sample for s in trained)
    counters = await PipelineState(redis, keys).counters()
    assert counters.get(Counter.EPISODES_FAILED, 0) == 0 and counters.get(Counter.FAILED, 0) == 0
    assert await redis.xlen(keys.dead) == 0
    _check_lags(trainer, 1)


def test_labels_raise_a_stamp_to_the_next_push_but_never_lower_it():
    from pipeline.staleness import TrainerLoop, label_versions
    from pipeline.state import PolicyStamp

    labels = label_versions(3, start=0, interval=1)  # async: engines hold step 2's push, label "3"
    assert labels == {"1": 0, "2": 1, "3": 2, "4": 3}
    stamp = PolicyStamp(run=1, version=2, labels=dict(list(labels.items())[-2:]))
    assert stamp.version_of(("4",)) == 3  # the next push landed before the trainer published it
    assert stamp.version_of(("3",)) == 2
    assert stamp.version_of(("1",)) == 2  # someone else's labels: the published version, not lower
    assert stamp.version_of(("default", "4")) == 2  # a call across a push: its oldest tokens count
    assert label_versions(2, start=0, interval=2) == {"1": 0, "2": 2}
    assert label_versions(3, start=0, loop=TrainerLoop.SYNC, first_label=6)["9"] == 3
