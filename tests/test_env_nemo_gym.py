"""`nemo_gym`: a NeMo Gym-protocol resources server on loopback, driven by real episodes."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status
from workers.envs.base import EnvError, EpisodeRecord, ToolCall
from workers.envs.nemo_gym import NemoGymEnvironment

from tests.env_helpers import GymServer, gym_task, run_episodes, serve_gym


def _env(url: str, **config) -> NemoGymEnvironment:
    return NemoGymEnvironment("gym", msgspec.convert({"kind": "nemo_gym", "options": {"url": url}, **config}, EnvConfig))


async def test_episode_through_the_runner_uses_tools_with_cookie_state_and_verifies():
    server = GymServer()
    async with serve_gym(server) as url:
        env = _env(url)
        try:
            samples = await run_episodes(env, gym_task(), n=2)
        finally:
            await env.aclose()
    for sample in samples:
        assert sample.status is Status.COMPLETED, sample.metadata
        assert sample.reward == 1.0
        assert sample.reward_components["tool_calls_seen"] == 1  # server-side state of that episode's cookie
        assert sample.metadata["tool_calls"] == 1
    assert len(server.sessions) == 2  # one session (cookie jar) per episode
    body = server.verify_bodies[0]
    assert body["expected_answer"] == "42" and body["responses_create_params"]["tools"][0]["name"] == "evaluate"
    kinds = [item["type"] for item in body["response"]["output"]]
    # the simulated model thinks aloud, calls the tool, then answers
    assert kinds == ["message", "function_call", "function_call_output", "message"]
    assert '"result": 42' in body["response"]["output"][2]["output"]  # the tool's answer text, verbatim  # the tool's answer text, verbatim


async def test_session_direct_tools_are_converted_and_bad_calls_become_observations():
    server = GymServer()
    async with serve_gym(server) as url:
        env = _env(url)
        task = gym_task()
        session = await env.start(task)
        try:
            assert session.tools[0]["function"]["name"] == "evaluate"  # chat-template form
            assert session.messages == [{"role": "user", "content": "What is 6 * 7?"}]
            result = await session.step(
                [
                    ToolCall(id="call_0", name="evaluate", arguments={"expr": "1"}),  # 422 from the server
                    ToolCall(id="call_1", name="verify", arguments={}),  # not a tool: never reaches /verify
                ]
            )
            assert "HTTP 422" in result.messages[0]["content"]
            assert "no tool named 'verify'" in result.messages[1]["content"]
            assert server.verify_bodies == []
            record = EpisodeRecord(
                task=task,
                messages=[*session.messages, {"role": "assistant", "content": "Answer: 41"}],
                response_text="Answer: 41",
                status=Status.COMPLETED,
            )
            verification = await session.verify(record)
            assert verification.reward == 0.0 and verification.components["tool_calls_seen"] == 0
        finally:
            await session.close()
            await env.aclose()


async def test_transient_5xx_and_dropped_connections_are_retried():
    server = GymServer(faults={"/seed_session": ["500", "drop"], "/verify": ["500"]})
    async with serve_gym(server) as url:
        env = _env(url, timeouts={"start": {"retries": 3, "backoff_s": 0.01}, "verify": {"retries": 2, "backoff_s": 0.01}})
        try:
            [sample] = await run_episodes(env, gym_task())
        finally:
            await env.aclose()
    assert sample.status is Status.COMPLETED and sample.reward == 1.0


async def test_missing_row_fails_at_start():
    env = _env("http://127.0.0.1:9")
    task = gym_task()
    task.metadata = {"question": "x"}
    with pytest.raises(EnvError, match="responses_create_params"):
        await env.start(task)
