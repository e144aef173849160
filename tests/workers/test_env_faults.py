"""Injected environment faults (5xx, hang, refused connection) end as counted failed
episodes through the real job path (arq job function -> runner -> env -> Redis push),
while the next group of a healthy environment goes through."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
from aiohttp import web

from pipeline.config import parse_config
from pipeline.keys import Counter
from pipeline.schema import PromptJob, SamplingParams, Status, decode_group, encode
from pipeline.store.buffer import GroupBuffer
from tests.support.env_helpers import GymServer, chat_tokens, gym_task, run_episodes, serve_gym
from workers.engine import EngineClient
from workers.envs.base import EpisodeRecord
from workers.jobs import CTX_KEY, WorkerContext, run_group
from workers.liveness import Liveness
from workers.sim.engine import SimConfig, serve_sim_engine

FAST = {"timeout_s": 0.5, "retries": 1, "backoff_s": 0.01}


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


def _env(url: str, **extra) -> dict:
    timeouts = {"start": FAST, "step": FAST, "verify": FAST, "verify_deadline_s": 2.0}
    return {"kind": "nemo_gym", "options": {"url": url}, "timeouts": timeouts, **extra}


async def test_faults_become_counted_failed_episodes_and_the_pipeline_goes_on(redis, redis_url, keys):
    healthy = GymServer()
    broken = GymServer(faults={"/verify": ["500"] * 100, "/evaluate": ["hang"] * 100})
    async with serve_gym(healthy) as good_url, serve_gym(broken) as bad_url, serve_sim_engine(
        SimConfig(accuracy=1.0, tool_use=1.0, length_mu=1.0)
    ) as engine:
        config = parse_config(
            {
                "redis": {"url": redis_url, "namespace": keys.ns},
                "workers": {"max_tries": 1},
                "environments": {
                    "hang": _env(bad_url),  # tool calls hang: step budget spent
                    "refused": _env(_refused_url()),  # nothing listens: seed_session refused
                    "drop": _env(bad_url, on_failure="drop_group"),
                    "ok": _env(good_url),
                },
            }
        )
        buffer = GroupBuffer(redis, keys)
        await buffer.ensure_group()
        context = WorkerContext(
            config=config, keys=keys, buffer=buffer, engine=EngineClient(engine.url, max_retries=1),
            chat=chat_tokens(), liveness=Liveness(redis, keys, "w1", heartbeat_s=1.0, dead_after_s=5.0), worker_id="w1",
        )
        results = {}
        started = time.monotonic()
        try:
            for env_name in ("hang", "refused", "drop", "ok"):
                task = msgspec.structs.replace(gym_task(f"t-{env_name}"), env=env_name)
                job = PromptJob(task=task, epoch=0, n_samples=2, sampling=SamplingParams(max_new_tokens=128))
                ctx = {CTX_KEY: context, "job_id": keys.arq_job_id(job.job_id), "job_try": 1}
                results[env_name] = await run_group(ctx, encode(job))
        finally:
            await context.aclose()
        elapsed = time.monotonic() - started

    assert [results[name]["status"] for name in ("hang", "refused", "drop", "ok")] == ["pushed", "pushed", "dead", "pushed"]
    entries = await redis.xrange(keys.groups)
    groups = {g.task.env: g for g in (decode_group(fields[b"g"]) for _, fields in entries)}
    # a hung tool call is sent once and its timeout becomes the model's observation (NeMo Gym's
    # simple_agent does the same); that episode then fails where the server fails it, at /verify
    for name, reason in (("hang", "POST /verify"), ("refused", "POST /seed_session")):
        for sample in groups[name].samples:
            assert sample.status is Status.FAILED and sample.reward == 0.0
            assert reason in sample.metadata["error"], sample.metadata["error"]
    assert all(s.status is Status.COMPLETED and s.reward == 1.0 for s in groups["ok"].samples)
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    assert counters[Counter.EPISODES_FAILED] == 4 and counters[Counter.EPISODES] == 6
    assert counters[Counter.FAILED] == 1  # the dropped group, dead-lettered with the reason
    dead = await redis.xrange(keys.dead)
    assert b"episodes failed" in dead[0][1][b"reason"]
    assert elapsed < 60  # bounded by the budgets, not a speed goal


@pytest.mark.parametrize("fault", ["500", "hang", "drop"])
async def test_each_fault_exhausts_its_budget_as_env_error(fault):
    from pipeline.config import EnvConfig
    from workers.envs.base import EnvError
    from workers.envs.nemo_gym import NemoGymEnvironment

    server = GymServer(faults={"/seed_session": [fault] * 10})
    async with serve_gym(server) as url:
        env = NemoGymEnvironment("gym", msgspec.convert(_env(url), EnvConfig))
        try:
            with pytest.raises(EnvError, match=r"failed 2 time\(s\)"):
                await env.start(gym_task())
        finally:
            await env.aclose()


async def test_a_budget_error_names_every_distinct_fault_its_attempts_met():
    """An episode whose first attempt met a refused connection and whose later attempts got
    5xx must say both: the last error alone would hide why it failed."""
    from workers.envs.rewards import CallBudget, EnvError, TransientError, call_with_budget

    faults = iter([ConnectionRefusedError("Connect call failed"), TransientError("HTTP 500"), TransientError("HTTP 500")])

    async def call() -> None:
        raise next(faults)

    with pytest.raises(EnvError) as caught:
        await call_with_budget(call, CallBudget(timeout_s=1.0, retries=2, backoff_s=0.0), "POST /seed_session")
    message = str(caught.value)
    assert message.startswith("POST /seed_session: failed 3 time(s); last error: TransientError: HTTP 500")
    assert "earlier: ConnectionRefusedError: Connect call failed" in message
    assert message.count("HTTP 500") == 1  # repeats are not listed twice


# ------------------------------------------------------------------ an environment's garbage is its fault, not a bug

GARBAGE = {  # what a broken or impostor server answers a 200 /verify with
    "not JSON": (b"<html>502 Bad Gateway</html>", "text/html"),
    "truncated JSON": (b'{"reward": 1.0, "extra', "application/json"),
    "a list": (b"[1.0]", "application/json"),
    "a string": (b'"1.0"', "application/json"),
    "no reward": (b'{"score": 1.0}', "application/json"),
    "a reward that is no number": (b'{"reward": "high"}', "application/json"),
    "not UTF-8": (b'{"reward": 1.0, "note": "\xff\xfe"}', "application/json; charset=utf-8"),
}


class GarbageGym(GymServer):
    """A NeMo Gym server whose `/verify` answers 200 with `answer`'s bytes, on loopback."""

    def __init__(self, answer: tuple[bytes, str]):
        super().__init__()
        self.answer = answer

    async def verify(self, request: web.Request) -> web.Response:
        await request.read()
        body, content_type = self.answer
        return web.Response(body=body, headers={"Content-Type": content_type})


@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_a_garbled_answer_is_an_environment_error_not_a_bug(garbage):
    from pipeline.config import EnvConfig
    from workers.envs.answers import MalformedAnswer
    from workers.envs.nemo_gym import NemoGymEnvironment
    from workers.errors import is_bug

    async with serve_gym(GarbageGym(GARBAGE[garbage])) as url:
        env = NemoGymEnvironment("gym", msgspec.convert(_env(url), EnvConfig))
        try:
            [sample] = await run_episodes(env, gym_task())
        finally:
            await env.aclose()
    assert sample.status is Status.FAILED and sample.reward == 0.0  # failed episode, never a trained 0 or 1
    assert "/verify" in sample.metadata["error"], sample.metadata
    session_error = None
    async with serve_gym(GarbageGym(GARBAGE[garbage])) as url:
        env = NemoGymEnvironment("gym", msgspec.convert(_env(url), EnvConfig))
        session = await env.start(gym_task())
        try:
            await session.verify(EpisodeRecord(task=gym_task(), messages=list(session.messages), response_text=""))
        except Exception as exc:  # noqa: BLE001 - what the runner sees
            session_error = exc
        finally:
            await session.close()
            await env.aclose()
    assert session_error is not None and not is_bug(session_error), repr(session_error)
    assert isinstance(session_error, MalformedAnswer) or garbage == "not UTF-8", repr(session_error)


async def _run_group_once(redis, redis_url, keys, env: dict, *, max_tries: int = 1) -> tuple[dict, list]:
    """One group of env `env` through the real job function on the simulated engine: (result,
    dead-letter entries)."""
    async with serve_sim_engine(SimConfig(accuracy=1.0, tool_use=1.0, length_mu=1.0)) as engine:
        config = parse_config({"redis": {"url": redis_url, "namespace": keys.ns},
                               "workers": {"max_tries": max_tries}, "environments": {"gym": env}})
        buffer = GroupBuffer(redis, keys)
        await buffer.ensure_group()
        context = WorkerContext(
            config=config, keys=keys, buffer=buffer, engine=EngineClient(engine.url, max_retries=1),
            chat=chat_tokens(), liveness=Liveness(redis, keys, "w1", heartbeat_s=1.0, dead_after_s=5.0), worker_id="w1",
        )
        task = msgspec.structs.replace(gym_task("t-garbage"), env="gym")
        job = PromptJob(task=task, epoch=0, n_samples=2, sampling=SamplingParams(max_new_tokens=128))
        ctx = {CTX_KEY: context, "job_id": keys.arq_job_id(job.job_id), "job_try": 1}
        try:
            result = await run_group(ctx, encode(job))
        finally:
            await context.aclose()
    return result, await redis.xrange(keys.dead)


async def test_garbled_json_hands_the_task_back_instead_of_dead_lettering_it_as_a_bug(redis, redis_url, keys):
    """Under `retry_all_failed` a group whose every /verify answer is garbled JSON is handed back
    (the next attempt enqueued) like any outage; before, JSONDecodeError counted as a bug of ours
    and the task was dead-lettered for good."""
    async with serve_gym(GarbageGym(GARBAGE["truncated JSON"])) as url:
        result, dead = await _run_group_once(redis, redis_url, keys, _env(url, on_failure="retry_all_failed"))
    assert result["status"] == "dead"
    [(_, fields)] = dead
    reason = fields[b"reason"].decode()
    assert "a bug" not in reason and "handed back as attempt 1" in reason, reason
    assert "answer is not JSON" in reason, reason


async def test_our_own_bug_on_a_good_answer_still_fails_the_job_as_a_bug(redis, redis_url, keys, monkeypatch):
    """The other side: the server answers well, our code handling the answer raises (a KeyError
    where we read our own structure): one dead-letter with the traceback, no hand-back."""
    import workers.envs.nemo_gym as nemo_gym

    def broken_components(answer: dict, body: dict) -> dict:
        return {"reward": body["no such field of ours"]}

    monkeypatch.setattr(nemo_gym, "verify_components", broken_components)
    async with serve_gym(GymServer()) as url:
        result, dead = await _run_group_once(redis, redis_url, keys, _env(url, on_failure="retry_all_failed"))
    assert result["status"] == "dead" and "a bug, not retried: KeyError" in result["reason"]
    [(_, fields)] = dead
    assert b"handed back" not in fields[b"reason"] and b"Traceback" in fields[b"reason"]
