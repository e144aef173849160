"""Injected environment faults (5xx, hang, refused connection) end as counted failed
episodes through the real job path (arq job function -> runner -> env -> Redis push),
while the next group of a healthy environment goes through."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest

from pipeline.buffer import GroupBuffer
from pipeline.config import parse_config
from pipeline.keys import Counter
from pipeline.schema import PromptJob, SamplingParams, Status, decode_group, encode
from tests.env_helpers import GymServer, chat_tokens, gym_task, serve_gym
from workers.engine import EngineClient
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
