"""`rollout monitor` against a pipeline state built on the real redis-server: arq jobs queued
with arq's own enqueue, one held by a real arq worker, groups buffered and handed out,
dead letters, heartbeats and trainer settings. The CLI runs as a subprocess, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import msgspec
import pytest
from arq.connections import RedisSettings, create_pool
from arq.worker import Worker
from prometheus_client.parser import text_string_to_metric_families

from pipeline.keys import Counter
from pipeline.ops.metrics import figures
from pipeline.ops.monitor import snapshot
from pipeline.slime.trained_log import record_step
from pipeline.state import PipelineState, TrainerInfo
from pipeline.store.buffer import GroupBuffer
from pipeline.store.local_redis import free_port
from pipeline.synthetic import make_group

READY_JOBS, DEFERRED_JOBS = 3, 2
BUFFERED, HANDED_OUT, DEAD = 5, 2, 1
VERSION, ETA, BATCH = 3, 1, 4


def _rollout(*argv: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "scripts.cli", *argv], env=env, text=True, **popen)


async def _hold(ctx, release_key: str) -> str:
    """A job that runs until the test lets it go: the 'running' job."""
    while not await ctx["redis"].exists(release_key):
        await asyncio.sleep(0.05)
    return "done"


async def _build_state(redis, redis_url, keys):
    """Queue jobs with arq, start a worker holding one, and fill the buffer; returns the worker task."""
    arq = await create_pool(
        RedisSettings.from_dsn(redis_url), default_queue_name=keys.queue,
        job_serializer=msgspec.msgpack.encode, job_deserializer=msgspec.msgpack.decode,
    )
    release = f"{keys.ns}:release"
    await arq.enqueue_job("_hold", release, _job_id=f"{keys.ns}-held:0")
    worker = Worker(
        functions=[_hold], redis_pool=arq, queue_name=keys.queue, max_jobs=1, poll_delay=0.05,
        handle_signals=False, job_serializer=msgspec.msgpack.encode, job_deserializer=msgspec.msgpack.decode,
    )
    task = asyncio.create_task(worker.async_run())
    in_progress = f"arq:in-progress:{keys.ns}-held:0"
    for _ in range(200):
        if await redis.exists(in_progress):
            break
        await asyncio.sleep(0.05)
    assert await redis.exists(in_progress), "the arq worker never picked the held job"
    for i in range(READY_JOBS):  # the worker's only slot is taken: these stay ready
        await arq.enqueue_job("_hold", release, _job_id=f"{keys.ns}-ready{i}:0")
    for i in range(DEFERRED_JOBS):
        await arq.enqueue_job("_hold", release, _job_id=f"{keys.ns}-later{i}:0", _defer_by=3600)

    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    for i in range(BUFFERED):
        env = "math" if i < 3 else "tools"
        await buf.push(make_group(f"g{i}:0", n=4, env=env, admission_version=VERSION - (i % 3), seed=i))
    assert len(await buf.read("trainer", HANDED_OUT)) == HANDED_OUT
    await buf.dead_letter(source="jobs", reason="poison for the test", ref="bad:0")
    for rid, lags in ((1, [1]), (2, [0, 1])):  # what the data source notes per step it trains
        await record_step(redis, keys, rid, lags)

    state = PipelineState(redis, keys)
    await state.set_version(VERSION)
    await state.set_trainer_info(TrainerInfo(rollout_batch_size=BATCH, n_samples_per_prompt=4, eta=ETA))
    await state.incr(**{Counter.ENQUEUED: 14, Counter.DISCARDED: 2, Counter.RUNNING: 1})
    now = time.time()
    await redis.zadd(keys.workers, {"node1-w0": now, "node1-w1": now - 2, "node2-w0": now - 120})
    await redis.sadd(keys.worker_jobs("node1-w0"), f"{keys.ns}-held:0")  # workers/liveness.py records it
    return arq, worker, task, release


async def _stop(redis, arq, worker, task, release):
    await redis.set(release, 1)
    await worker.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await arq.aclose()


@pytest.fixture
async def pipeline_state(redis, redis_url, keys):
    arq, worker, task, release = await _build_state(redis, redis_url, keys)
    yield
    await _stop(redis, arq, worker, task, release)


def _expected_headroom() -> int:
    return (ETA + VERSION + 1) * BATCH - (14 - 2)


async def test_json_snapshot_matches_the_pipeline_state(pipeline_state, redis_url, namespace):
    proc = _rollout("monitor", "--json", "--redis-url", redis_url, "--namespace", namespace,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0, err
    snap = json.loads(out)
    assert snap["queue"] == {"ready": READY_JOBS, "deferred": DEFERRED_JOBS, "running": 1}
    assert snap["running_counter"] == 1
    assert (snap["buffer_ready"], snap["buffer_pending"]) == (BUFFERED - HANDED_OUT, HANDED_OUT)
    assert snap["dead_letters"] == DEAD
    assert snap["policy_version"] == VERSION
    assert snap["admission_headroom"] == _expected_headroom() == 8
    assert snap["workers_live"] == 2
    workers = {w["id"]: w for w in snap["workers"]}
    assert workers["node2-w0"]["live"] is False and workers["node1-w0"]["load"] == 1
    assert workers["node1-w1"]["load"] == 0
    # admission versions VERSION - (i % 3) for i in 0..4: lags 0, 1, 2, 0, 1; the first 2 handed out
    assert snap["waiting_staleness_hist"] == {"0": 1, "1": 1, "2": 1}
    assert snap["staleness_hist"] == {"0": 1, "1": 2} and snap["trained_steps"] == 2  # as the trainer saw them
    assert snap["staleness_max"] == 2  # of what waits and what was trained
    assert snap["envs"]["math"]["groups"] == 3 and snap["envs"]["tools"]["episodes"] == 8
    assert snap["envs"]["math"]["reward_mean"] == pytest.approx(0.5)
    assert snap["throughput"]["groups_per_min"] == pytest.approx(BUFFERED * 60 / 60.0)
    assert snap["counters"][Counter.BUFFERED] == BUFFERED


async def test_once_prints_the_table(pipeline_state, redis_url, namespace):
    proc = _rollout("monitor", "--once", "--redis-url", redis_url, "--namespace", namespace,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0, err
    assert f"pipeline '{namespace}'" in out and "node2-w0" in out and "silent" in out
    assert "tools" in out and "admission headroom" in out


def _scrape(port: int, deadline_s: float = 30.0) -> str:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return reply.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def test_prometheus_endpoint_is_scrapeable_and_parses(pipeline_state, redis, redis_url, keys):
    port = free_port()
    proc = _rollout("monitor", "--serve", str(port), "--host", "127.0.0.1", "--redis-url", redis_url,
                    "--namespace", keys.ns, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        text = await asyncio.to_thread(_scrape, port)
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["namespace"] == keys.ns
            label = tuple(v for k, v in sorted(s.labels.items()) if k != "namespace")
            samples[(s.name, label)] = s.value
    assert samples[("rollout_up", ())] == 1
    assert samples[("rollout_queue_jobs", ("ready",))] == READY_JOBS
    assert samples[("rollout_queue_jobs", ("deferred",))] == DEFERRED_JOBS
    assert samples[("rollout_queue_jobs", ("running",))] == 1
    assert samples[("rollout_buffer_groups", ("pending",))] == HANDED_OUT
    assert samples[("rollout_dead_letters", ())] == DEAD
    assert samples[("rollout_admission_headroom", ())] == _expected_headroom()
    assert samples[("rollout_workers", ("live",))] == 2
    assert samples[("rollout_worker_load", ("node1-w0",))] == 1
    assert samples[("rollout_trained_staleness_groups", ("1",))] == 2
    assert samples[("rollout_staleness_max", ())] == 2
    assert samples[("rollout_env_reward_mean", ("tools",))] == pytest.approx(0.5)
    assert samples[("rollout_buffered_total", ())] == BUFFERED
    assert samples[("rollout_running_groups", ())] == 1
    # the same figures as an in-process snapshot (the wandb keys)
    flat = figures(await snapshot(redis, keys))
    assert flat["queue/ready"] == samples[("rollout_queue_jobs", ("ready",))]
    assert flat["admission/headroom"] == samples[("rollout_admission_headroom", ())]


async def test_prometheus_reports_down_when_redis_is_unreachable(namespace):
    port, dead_port = free_port(), free_port()
    proc = _rollout("monitor", "--serve", str(port), "--host", "127.0.0.1",
                    "--redis-url", f"redis://127.0.0.1:{dead_port}/0", "--namespace", namespace,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        text = await asyncio.to_thread(_scrape, port)
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values == {"rollout_up": 0.0}


def test_wandb_missing_is_a_clear_error(monkeypatch):
    from pipeline.ops.metrics import WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(SystemExit, match=r"pip install 'rollout-pipeline\[wandb\]'"):
        WandbLogger(project="p", namespace="ns", mode="offline")


async def test_wandb_offline_logs_the_figures(pipeline_state, redis, keys, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from pipeline.ops.metrics import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="rollout-test", namespace=keys.ns, mode="offline", run_dir=str(tmp_path))
    snap = await snapshot(redis, keys)
    logger.log(snap)
    summary = dict(logger.run.summary)
    logger.close()
    assert summary["queue/ready"] == READY_JOBS and summary["dead_letters"] == DEAD
    assert wandb.run is None
    assert list(tmp_path.glob("wandb/offline-run-*"))
