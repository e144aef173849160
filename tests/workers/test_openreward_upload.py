"""Trajectory upload to OpenReward (`options.upload`, workers/upload.py) with the SDK's own
rollout client and sender, against a loopback server standing in for the OpenReward API
(POST /v1/rollouts, recorded), on episodes of a real SDK environment server through the
real runner: every episode uploaded once, its messages in order with their rewards; an API
that is down or slow changes and delays no episode, and its failures are counted."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # no PyPI lookups from tests

import msgspec
import pytest
from aiohttp import web

from pipeline.config import ConfigError, EnvConfig, PipelineConfig
from pipeline.schema import Sample, SamplingParams, Status, Task
from pipeline.store.local_redis import free_port
from tests.support.env_helpers import chat_tokens, serve_openreward
from tests.workers.test_env_openreward import Arith
from workers.engine import EngineClient
from workers.envs.openreward_env import OpenRewardEnvironment
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.sim.engine import SimConfig, serve_sim_engine

API_KEY = "sk-or-test-4f1c9e0d7b"
KEY_VAR = "ROLLOUT_TEST_OR_UPLOAD_KEY"
RUN = "ns-upload-test"


@pytest.fixture(scope="module")
def or_server():
    with serve_openreward(Arith) as url:
        yield url


@dataclass
class FakeApi:
    """POST /v1/rollouts as OpenReward's API takes it: `{"events": [...]}`; records each body."""

    delay_s: float = 0.0
    delay_messages_s: float = 0.0  # only batches of message events are slow (rollouts are created at once)
    refuse_messages: bool = False  # answer 400 to batches of message events (rollouts are created)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    async def rollouts(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.keys.append(request.headers.get("x-api-key", ""))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.delay_messages_s and any(e.get("eventType") == "message" for e in body["events"]):
            await asyncio.sleep(self.delay_messages_s)
        if self.refuse_messages and any(e.get("eventType") == "message" for e in body["events"]):
            return web.json_response({"error": "refused"}, status=400)
        self.bodies.append(body)
        return web.json_response({"ok": True})

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for b in self.bodies for e in b["events"] if e.get("eventType") == kind]


@asynccontextmanager
async def serve_api(api: FakeApi) -> AsyncIterator[str]:
    from aiohttp.test_utils import TestServer

    app = web.Application()
    app.router.add_post("/v1/rollouts", api.rollouts)
    server = TestServer(app, host="127.0.0.1")  # aiohttp's own loopback server, on a free port
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _env(url: str, upload: dict | None) -> OpenRewardEnvironment:
    options: dict[str, Any] = {"environment": "arith", "base_url": url, "api_key_env": KEY_VAR}
    if upload is not None:
        options["upload"] = upload
    return OpenRewardEnvironment("arith", msgspec.convert({"kind": "openreward", "options": options}, EnvConfig))


def _task(i: int) -> Task:
    question, answer = ("What is 6 * 7?", "42") if i % 2 == 0 else ("What is 2 + 2?", "4")
    return Task(id=f"t{i}", env="arith", prompt="{}", metadata={"task_spec": {"question": question, "answer": answer}})


async def _episodes(env: OpenRewardEnvironment, tasks: list[Task], n: int) -> tuple[list[tuple[str, Sample]], float]:
    """`n` episodes of each task through the real runner; (episode id, sample) pairs and the seconds."""
    sim = SimConfig(accuracy=1.0, tool_use=1.0, length_mu=1.0)
    async with serve_sim_engine(sim) as engine, EngineClient(engine.url, max_retries=1) as client:
        settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=256))
        runner = EpisodeRunner(client, chat_tokens(), env, settings, run=RUN)
        ids = [f"{task.id}/{i}" for task in tasks for i in range(n)]
        started = time.monotonic()
        samples = await asyncio.gather(*(runner.run(task, f"{task.id}/{i}", i) for task in tasks for i in range(n)))
        return list(zip(ids, samples)), time.monotonic() - started


def _summary(sample: Sample) -> tuple:
    return (sample.status, sample.reward, sample.metadata["step_rewards"], sample.metadata["turns"], sample.response)


async def test_every_episode_is_uploaded_once_with_its_messages_in_order_and_rewards(or_server, monkeypatch, caplog, capsys):
    monkeypatch.setenv(KEY_VAR, API_KEY)
    caplog.set_level(logging.DEBUG)
    api = FakeApi()
    async with serve_api(api) as api_url:
        env = _env(or_server, {"api_url": api_url})
        try:
            episodes, _ = await _episodes(env, [_task(0), _task(1)], n=3)
        finally:
            await env.aclose()  # flushes the SDK's sender
    assert env.uploader is not None and env.uploader.stats()["uploaded"] == 6
    assert env.uploader.stats()["unsent_at_close"] == 0  # every message delivered before close returned

    rollouts = api.events("rollout")
    assert sorted(r["rolloutName"] for r in rollouts) == sorted(e for e, _ in episodes)  # each once
    by_name = {r["rolloutName"]: r for r in rollouts}
    messages = api.events("message")
    for episode_id, sample in episodes:
        assert sample.status is Status.COMPLETED and sample.reward == 1.25, sample.metadata
        rollout = by_name[episode_id]
        assert rollout["runName"] == RUN and rollout["environment"] == "arith"
        task = _task(int(episode_id[1]))
        assert rollout["task_spec"] == task.metadata["task_spec"]
        meta = rollout["metadata"]
        assert meta["reward"] == sample.reward and meta["status"] == "completed" and meta["step_rewards"] == [0.25]
        assert meta["policy_versions"] == list(sample.policy_versions) and meta["task_id"] == task.id
        mine = sorted((m for m in messages if m["rolloutEventId"] == rollout["eventId"]), key=lambda m: m["index"])
        assert [m["index"] for m in mine] == list(range(len(mine)))
        # the prompt, the tool call (its reward on its result), the final answer graded by `submit`
        kinds = [m["type"] for m in mine]
        assert kinds[0] == "user_message" and mine[0]["content"] == task.metadata["task_spec"]["question"]
        assert kinds[-3:] == ["tool_call", "tool_result", "assistant_message"]
        call, result, answer = mine[-3:]
        assert call["name"] == "evaluate" and result["callId"] == call["callId"]
        assert result["reward"] == 0.25 and not result["isFinished"]
        assert answer["content"].endswith(f"Answer: {task.metadata['task_spec']['answer']}")
        assert answer["reward"] == 1.0 and answer["isFinished"] is True
        one_each = ("system_message", "user_message", "assistant_message", "tool_result")
        assert sum(1 for k in kinds if k in one_each) == len(sample.metadata["messages"])  # every message

    # the key went to the API, and nowhere else: no log line, no sample, no printed output
    assert set(api.keys) == {API_KEY}
    printed = capsys.readouterr()
    assert API_KEY not in caplog.text and API_KEY not in printed.out + printed.err
    assert all(API_KEY not in msgspec.json.encode(s).decode() for _, s in episodes)


async def test_every_n_uploads_whole_groups_of_one_task_in_n(or_server, monkeypatch):
    monkeypatch.setenv(KEY_VAR, API_KEY)
    api = FakeApi()
    async with serve_api(api) as api_url:
        env = _env(or_server, {"api_url": api_url, "every": 3})
        try:
            tasks = [_task(i) for i in range(6, 10)]  # t7 and t8 are the chosen ones (crc32 % 3)
            episodes, _ = await _episodes(env, tasks, n=2)
        finally:
            await env.aclose()
    from workers.upload import chosen

    expected = sorted(e for e, _ in episodes if chosen(e.split("/")[0], 3))
    assert 0 < len(expected) < len(episodes)
    assert sorted(r["rolloutName"] for r in api.events("rollout")) == expected


async def test_an_api_that_is_down_changes_no_episode_and_is_counted_and_logged_once(or_server, monkeypatch, caplog, capsys):
    monkeypatch.setenv(KEY_VAR, API_KEY)
    caplog.set_level(logging.WARNING, logger="workers.upload")
    tasks = [_task(0), _task(1)]
    plain = _env(or_server, None)
    try:
        without, _ = await _episodes(plain, tasks, n=3)
    finally:
        await plain.aclose()
    env = _env(or_server, {"api_url": f"http://127.0.0.1:{free_port()}"})  # nothing listens there
    try:
        with_upload, _ = await _episodes(env, tasks, n=3)
    finally:
        await env.aclose()
    assert [_summary(s) for _, s in with_upload] == [_summary(s) for _, s in without]
    assert env.uploader is not None
    stats = env.uploader.stats()
    assert stats["failed"] == 6 and stats["uploaded"] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.upload"]
    assert 1 <= len(lines) <= 2, lines  # the first failure at once, the rest in the report at close
    assert sum(int(line.split(": ")[1].split(" ")[0]) for line in lines) == 6, lines
    assert "episodes are not affected" in lines[0]
    printed = capsys.readouterr()
    assert "failed to start rollout" not in printed.out + printed.err  # the SDK's per-rollout lines are counted
    assert API_KEY not in caplog.text + printed.out + printed.err


async def test_message_batches_the_api_refuses_are_counted(or_server, monkeypatch, caplog, capsys):
    monkeypatch.setenv(KEY_VAR, API_KEY)
    caplog.set_level(logging.WARNING, logger="workers.upload")
    api = FakeApi(refuse_messages=True)
    async with serve_api(api) as api_url:
        env = _env(or_server, {"api_url": api_url})
        try:
            episodes, _ = await _episodes(env, [_task(0)], n=2)
        finally:
            await env.aclose()
    assert env.uploader is not None
    stats = env.uploader.stats()
    assert stats["failed"] == 0 and stats["failed_batches"] >= 1 and len(api.events("rollout")) == 2
    assert all(s.status is Status.COMPLETED for _, s in episodes)
    assert any("last error: upload failed" in r.getMessage() for r in caplog.records), caplog.text
    printed = capsys.readouterr()
    assert "upload failed" not in printed.out + printed.err  # counted and reported by us, not printed per batch


async def test_a_slow_api_delays_no_episode_and_drops_are_counted(or_server, monkeypatch, capsys):
    """Side by side, one run: a batch of episodes without upload, then with upload to an API
    that takes 3 s per request (the SDK's rollout start blocks its caller that long)."""
    monkeypatch.setenv(KEY_VAR, API_KEY)
    tasks = [_task(i) for i in range(4)]
    plain = _env(or_server, None)
    try:
        _, warm = await _episodes(plain, tasks, n=4)  # warm the SDK client and the server
        without, seconds_without = await _episodes(plain, tasks, n=4)
    finally:
        await plain.aclose()
    api = FakeApi(delay_s=3.0)
    async with serve_api(api) as api_url:
        env = _env(or_server, {"api_url": api_url, "queue_size": 2})
        try:
            with_upload, seconds_with = await _episodes(env, tasks, n=4)
            assert env.uploader is not None
            stats = env.uploader.stats()
            await asyncio.to_thread(env.uploader.close, 0.5)  # the thread is stuck in the SDK's start
        finally:
            await env.aclose()
    with capsys.disabled():
        print(f"\nupload to a 3 s API: a batch of 16 episodes took {seconds_with:.2f}s with it, "
              f"{seconds_without:.2f}s without (ratio {seconds_with / seconds_without:.2f}; 2 cores shared with other work)")
    assert [_summary(s) for _, s in with_upload] == [_summary(s) for _, s in without]
    # waiting on the API even once would cost 3 s; the ratio bound is loose for a loaded machine
    assert seconds_with < 3.0 and seconds_with < seconds_without * 2 + 1.0
    assert stats["dropped"] >= 16 - 3 and stats["uploaded"] == 0  # one in the thread, two queued


async def test_a_worker_job_uploads_its_group_under_the_pipelines_run(or_server, monkeypatch, redis, redis_url, keys):
    """Through the worker's job function: the run name defaults to the pipeline's namespace and
    each episode's rollout is named by its episode id (group / index / try)."""
    from pipeline.config import parse_config
    from pipeline.schema import PromptJob, encode
    from pipeline.store.buffer import GroupBuffer
    from workers.jobs import CTX_KEY, WorkerContext, run_group
    from workers.liveness import Liveness

    monkeypatch.setenv(KEY_VAR, API_KEY)
    api = FakeApi()
    async with serve_api(api) as api_url, serve_sim_engine(SimConfig(accuracy=1.0, tool_use=1.0, length_mu=1.0)) as engine:
        options = {"environment": "arith", "base_url": or_server, "api_key_env": KEY_VAR, "upload": {"api_url": api_url}}
        config = parse_config({"redis": {"url": redis_url, "namespace": keys.ns},
                               "environments": {"arith": {"kind": "openreward", "options": options}}})
        buffer = GroupBuffer(redis, keys)
        await buffer.ensure_group()
        context = WorkerContext(
            config=config, keys=keys, buffer=buffer, engine=EngineClient(engine.url, max_retries=1), chat=chat_tokens(),
            liveness=Liveness(redis, keys, "w1", heartbeat_s=1.0, dead_after_s=5.0), worker_id="w1",
        )
        job = PromptJob(task=_task(0), epoch=0, n_samples=2, sampling=SamplingParams(max_new_tokens=256))
        try:
            result = await run_group({CTX_KEY: context, "job_id": keys.arq_job_id(job.job_id), "job_try": 1}, encode(job))
        finally:
            await context.aclose()  # closes the environment: its uploader flushes
    assert result["status"] == "pushed", result
    rollouts = api.events("rollout")
    assert {r["runName"] for r in rollouts} == {keys.ns}
    assert sorted(r["rolloutName"] for r in rollouts) == [f"{job.job_id}/0/1", f"{job.job_id}/1/1"]


def test_bad_upload_options_name_the_key(monkeypatch):
    monkeypatch.delenv(KEY_VAR, raising=False)
    with pytest.raises(ConfigError, match=rf"environments\.arith\.options\.upload: the API key \${KEY_VAR} is not set"):
        _env("http://x", {})
    monkeypatch.setenv(KEY_VAR, API_KEY)
    with pytest.raises(ConfigError, match=r"environments\.arith\.options\.upload"):
        _env("http://x", {"every": 0})
    with pytest.raises(ConfigError, match=r"environments\.arith\.options\.upload\.runname"):
        _env("http://x", {"runname": "x"})


# ------------------------------------------------------------------ shutdown, attribution, the SDK's evictions


def _trajectory(i: int) -> Any:
    from workers.upload import Event, Trajectory

    return Trajectory(run_name=RUN, rollout_name=f"t{i}/0", environment="arith", variant=None, split=None,
                      task_spec={"question": "What is 6 * 7?", "answer": "42"}, metadata={"reward": 1.0},
                      events=[Event("UserMessage", {"content": "What is 6 * 7?"}),
                              Event("AssistantMessage", {"content": "Answer: 42"}, 1.0, True)])


def _uploader(api_url: str, what: str, queue_size: int = 256) -> Any:
    from workers.upload import TrajectoryUploader

    return TrajectoryUploader(api_key=API_KEY, api_url=api_url, queue_size=queue_size, what=what)


async def test_episodes_still_queued_at_close_are_counted_as_dropped_and_logged_once(caplog):
    """6 submitted to an API that takes 3 s: the upload thread is in the SDK's blocking start of
    the first when `close(0.5)` gives up; the 5 still queued are dropped, counted, and one line
    says so with their number."""
    caplog.set_level(logging.WARNING, logger="workers.upload")
    api = FakeApi(delay_s=3.0)
    async with serve_api(api) as api_url:
        uploader = _uploader(api_url, "openreward upload (env 'slow')")
        assert all(uploader.submit(_trajectory(i)) for i in range(6))
        await asyncio.sleep(0.5)  # the thread took the first
        await asyncio.to_thread(uploader.close, 0.5)
        stats = uploader.stats()
        await asyncio.sleep(3.5)  # the first upload ends; the thread stops after it
    assert stats["dropped"] == stats["dropped_at_close"] == 5 and stats["queued"] == 0, stats
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.upload"]
    assert [line for line in lines if "still queued" in line] == [
        "openreward upload (env 'slow'): closed with 5 episode(s) still queued after 0.5s: dropped, not uploaded "
        "(episodes are not affected)"], lines


async def test_messages_still_in_the_sdks_sender_at_close_are_counted_and_logged_once(caplog):
    """3 episodes whose rollouts are created at once and whose message POSTs take 2 s: when
    `close(1.0)` returns, the SDK's sender still holds their 6 messages (lost when the process
    ends). They are counted and one line says so; before, stats said uploaded 3, dropped 0."""
    caplog.set_level(logging.WARNING, logger="workers.upload")
    api = FakeApi(delay_messages_s=2.0)
    async with serve_api(api) as api_url:
        uploader = _uploader(api_url, "openreward upload (env 'slow-messages')")
        assert all(uploader.submit(_trajectory(i)) for i in range(3))
        await asyncio.to_thread(uploader.close, 1.0)
        stats = uploader.stats()
        await asyncio.sleep(1.5)  # the POST answers; the SDK's sender ends
    assert stats["uploaded"] == 3 and stats["dropped"] == 0 and stats["messages"] == 6, stats
    assert stats["unsent_at_close"] == 6 and stats["messages_sent"] == 0, stats
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.upload"]
    assert [line for line in lines if "still in the SDK's sender" in line] == [
        "openreward upload (env 'slow-messages'): closed with 6 message(s) still in the SDK's sender after 1.0s: "
        "not uploaded (episodes are not affected)"], lines


async def test_sdk_failures_are_counted_by_the_uploader_that_sent_them(monkeypatch):
    """Two upload-enabled environments in one process, one API down: its failures are counted by
    its uploader alone; the other's rollouts are all created and none counted as failed."""
    api = FakeApi()
    async with serve_api(api) as api_url:
        healthy = _uploader(api_url, "openreward upload (env 'up')")
        broken = _uploader(f"http://127.0.0.1:{free_port()}", "openreward upload (env 'down')")  # nothing listens
        for i in range(3):
            assert healthy.submit(_trajectory(i)) and broken.submit(_trajectory(10 + i))
        await asyncio.gather(asyncio.to_thread(healthy.close, 30.0), asyncio.to_thread(broken.close, 30.0))
    assert broken.stats()["failed"] == 3 and broken.stats()["uploaded"] == 0, broken.stats()
    assert healthy.stats()["failed"] == 0 and healthy.stats()["uploaded"] == 3, healthy.stats()
    assert len(api.events("rollout")) == 3


async def test_messages_the_sdks_ring_buffer_evicts_are_counted(monkeypatch, caplog, capsys):
    """The SDK's sender keeps messages in a ring buffer and evicts the oldest when it is full,
    with one warning line each ("ring buffer full, evicted oldest event"). Its capacity is
    100 000 in the SDK's client config: made 2 here (and its flush thresholds above that) so
    that the SDK's own loop evicts; each eviction is counted and reported, none printed."""
    import openreward.client
    from openreward.models import SendLoopConfig

    def small_ring(**fields: Any) -> SendLoopConfig:
        return SendLoopConfig(**{**fields, "ring_capacity": 2, "max_items": 1000, "max_age": 60.0})

    monkeypatch.setattr(openreward.client, "SendLoopConfig", small_ring)
    caplog.set_level(logging.WARNING, logger="workers.upload")
    api = FakeApi()
    async with serve_api(api) as api_url:
        uploader = _uploader(api_url, "openreward upload (env 'ring')")
        assert uploader.submit(_trajectory(0))  # 2 messages: the ring is full, nothing evicted
        assert uploader.submit(_trajectory(1))  # 2 more: 2 evicted
        await asyncio.to_thread(uploader.close, 30.0)
    stats = uploader.stats()
    assert stats["evicted"] == 2 and stats["uploaded"] == 2, stats
    assert len(api.events("message")) == 2  # what the ring kept
    reported = [re.search(r"(\d+) message\(s\) evicted by the SDK's buffer", r.getMessage()) for r in caplog.records]
    # one line per report: both evictions in one, or one each when a report fell between them (a loaded machine)
    assert sum(int(m.group(1)) for m in reported if m) == 2, caplog.text
    printed = capsys.readouterr()
    assert "ring buffer full" not in printed.out + printed.err
