"""`nemo_gym` against REAL NeMo Gym resources servers (nemo-gym 0.7.0, started with its own
CLI by tests/support/nemo_gym_support.py): the servers' own pydantic models and verifiers are the
oracle for what the pipeline sends.

Skipped (with the reason) when the NeMo Gym venv is missing; failed instead with
ROLLOUT_REQUIRE_CONFORMANCE=1.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from tests.support.env_helpers import run_episodes
from tests.support.nemo_gym_support import FaultProxy, nemo_gym, serve_proxy  # noqa: F401 - `nemo_gym` is a fixture
from workers.envs.base import EnvError, EpisodeRecord, ToolCall
from workers.envs.nemo_gym import MAX_COMPONENT_CHARS, NemoGymEnvironment
from workers.sim.engine import SimConfig

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(900)]

FAST = {"start": {"timeout_s": 20, "retries": 2, "backoff_s": 0.05}, "verify": {"timeout_s": 60, "retries": 2, "backoff_s": 0.05}}


def _env(url: str, **config) -> NemoGymEnvironment:
    data = {"kind": "nemo_gym", "options": {"url": url}, "timeouts": FAST, **config}
    return NemoGymEnvironment("gym", msgspec.convert(data, EnvConfig))


def _tool(name: str, properties: dict) -> dict:
    required = list(properties)
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "name": name, "description": "", "parameters": parameters, "strict": True}


WEATHER = _tool("get_weather", {"city": {"type": "string"}})
INCREMENT = _tool("increment_counter", {"count": {"type": "integer"}})
GET_COUNT = _tool("get_counter_value", {})


def _task(row: dict, task_id: str = "t1") -> Task:
    return Task(id=task_id, env="gym", prompt="x", metadata=row)


def _record(task: Task, session, *turns: dict, status: Status = Status.COMPLETED) -> EpisodeRecord:
    messages = [*session.messages, *turns]
    text = " ".join(m.get("content", "") for m in turns if m["role"] == "assistant")
    return EpisodeRecord(task=task, messages=messages, response_text=text, status=status, turns=len(turns))


def _say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _calls(*calls: ToolCall, text: str = "") -> dict:
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
    }


async def _episode(url: str, row: dict, play, **config):
    """`play(session, task)` drives one session; returns what it returns."""
    env = _env(url, **config)
    task = _task(row)
    session = await env.start(task)
    try:
        return await play(session, task)
    finally:
        await session.close()
        await env.aclose()


# ------------------------------------------------------------------ example_single_tool_call


async def test_single_tool_call_episode_through_the_runner(nemo_gym):
    row = {"responses_create_params": {"input": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER]}}
    env = _env(nemo_gym.urls["single_tool"])
    try:
        [sample] = await run_episodes(env, _task(row), sim=SimConfig(accuracy=1.0, tool_use=1.0, length_mu=1.0))
    finally:
        await env.aclose()
    assert sample.status is Status.COMPLETED, sample.metadata
    assert sample.metadata["tool_calls"] == 1
    assert sample.reward == 1.0  # the real verifier found the get_weather function_call in our output


async def test_instructions_and_history_reach_the_prompt_and_the_real_verifier(nemo_gym):
    history = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text", "text": "I should look it up."}]},
        {"type": "function_call", "call_id": "call_h0", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_h0", "output": '{"city": "Oslo", "weather_description": "cold"}'},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is cold in Oslo.", "annotations": []}]},
        {"role": "user", "content": "And in Paris?"},
    ]
    row = {"responses_create_params": {"instructions": "You are a weather bot.", "input": history, "tools": [WEATHER]}}

    async def play(session, task):
        assert session.messages[0] == {"role": "system", "content": "You are a weather bot."}
        assert session.messages[2] == {
            "role": "assistant", "content": "", "reasoning_content": "I should look it up.",
            "tool_calls": [{"id": "call_h0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        }
        assert session.messages[3]["role"] == "tool" and session.messages[3]["tool_call_id"] == "call_h0"
        assert session.messages[3]["name"] == "get_weather"
        assert session.messages[4] == {"role": "assistant", "content": "It is cold in Oslo."}
        assert session.messages[-1] == {"role": "user", "content": "And in Paris?"}
        result = await session.step([ToolCall(id="call_0", name="get_weather", arguments={"city": "Paris"})])
        assert "The weather in Paris is cold." in result.messages[0]["content"]
        record = _record(task, session, _calls(ToolCall(id="call_0", name="get_weather", arguments={"city": "Paris"})),
                         *result.messages, _say("Cold."))
        return await session.verify(record)

    verification = await _episode(nemo_gym.urls["single_tool"], row, play)
    assert verification.reward == 1.0  # the real server parsed every history item of the echoed row


async def test_a_row_nemo_gym_refuses_fails_at_start_not_after_the_episode(nemo_gym):
    row = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": None}}
    env = _env(nemo_gym.urls["single_tool"])
    try:
        with pytest.raises(EnvError, match=r"responses_create_params\.tool_choice: is null"):
            await env.start(_task(row))
    finally:
        await env.aclose()
    # the real server refuses the same row at /verify, which is why it is checked first
    import aiohttp

    body = {**row, "response": {"id": "r", "created_at": 1, "model": "m", "object": "response", "output": [],
                                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}}
    async with aiohttp.ClientSession() as http:
        async with http.post(nemo_gym.urls["single_tool"] + "/verify", json=body) as response:
            assert response.status == 422 and "tool_choice" in await response.text()


# ------------------------------------------------------------------ example_session_state_mgmt: at most once


COUNTER_ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "add 1 then add 2"}], "tools": [INCREMENT, GET_COUNT]},
    "expected_count": 6,
    "initial_count": 3,
}


def _counter_play(calls_per_step: list[list[ToolCall]]):
    async def play(session, task):
        turns, observations = [], []
        for calls in calls_per_step:
            result = await session.step(calls)
            observations.append([m["content"] for m in result.messages])
            turns += [_calls(*calls), *result.messages]
        final = await session.step([ToolCall(id="call_9", name="get_counter_value", arguments={})])
        record = _record(task, session, *turns, _say("done"))
        return observations, json.loads(final.messages[0]["content"])["count"], await session.verify(record)

    return play


async def test_stateful_tools_keep_their_cookie_and_count_once(nemo_gym):
    play = _counter_play([[ToolCall(id="call_0", name="increment_counter", arguments={"count": 1})],
                          [ToolCall(id="call_0", name="increment_counter", arguments={"count": 2})]])
    observations, count, verification = await _episode(nemo_gym.urls["counter"], COUNTER_ROW, play)
    assert observations == [['{"success":true}'], ['{"success":true}']]
    assert count == 6 and verification.reward == 1.0  # seeded 3 (the row's initial_count) + 1 + 2


@pytest.mark.parametrize("fault", ["delay:3", "lose"])
async def test_a_slow_or_lost_tool_answer_is_not_sent_again(nemo_gym, fault):
    """The first increment's answer comes too late (or never): the model is told, the call is
    not sent again, and the server's count (and so the real verifier) shows one increment."""
    proxy = FaultProxy.to(nemo_gym.urls["counter"], {"/increment_counter": [fault]})
    play = _counter_play([[ToolCall(id="call_0", name="increment_counter", arguments={"count": 1})],
                          [ToolCall(id="call_0", name="increment_counter", arguments={"count": 2})]])
    async with serve_proxy(proxy) as url:
        observations, count, verification = await _episode(
            url, COUNTER_ROW, play, timeouts={**FAST, "step": {"timeout_s": 1.0, "retries": 3, "backoff_s": 0.01}}
        )
    expected = "timed out" if fault.startswith("delay") else "was lost"
    assert expected in observations[0][0] and "not sent again" in observations[0][0]
    assert observations[1] == ['{"success":true}']
    assert proxy.forwarded["/increment_counter"] == 2  # two model calls, two requests
    assert count == 6 and verification.reward == 1.0


async def test_a_tool_5xx_is_the_models_observation(nemo_gym):
    proxy = FaultProxy.to(nemo_gym.urls["counter"], {"/increment_counter": ["502"]})
    play = _counter_play([[ToolCall(id="call_0", name="increment_counter", arguments={"count": 1})],
                          [ToolCall(id="call_0", name="increment_counter", arguments={"count": 3})]])
    async with serve_proxy(proxy) as url:
        observations, count, verification = await _episode(url, COUNTER_ROW, play)
    assert observations[0][0].startswith("error: HTTP 502")
    assert proxy.seen["/increment_counter"] == 2  # not retried
    assert count == 6 and verification.reward == 1.0  # 3 + 3: the failed call never ran


async def test_seed_and_verify_are_retried_when_their_answers_are_lost(nemo_gym):
    """Both are idempotent in NeMo Gym: a lost /verify answer is asked again and the
    session's state is what it was; a lost /seed_session answer seeds afresh."""
    proxy = FaultProxy.to(nemo_gym.urls["counter"], {"/seed_session": ["lose"], "/verify": ["lose", "502"]})
    play = _counter_play([[ToolCall(id="call_0", name="increment_counter", arguments={"count": 3})]])
    async with serve_proxy(proxy) as url:
        _, count, verification = await _episode(url, COUNTER_ROW, play)
    assert proxy.seen["/seed_session"] == 2 and proxy.seen["/verify"] == 3
    assert count == 6 and verification.reward == 1.0


# ------------------------------------------------------------------ math_with_judge

MATH_ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "What is 1 + 1? Put the answer in \\boxed{}."}]},
    "question": "What is 1 + 1?",
    "expected_answer": "2",
}


async def _math(url: str, answer: str):
    async def play(session, task):
        return await session.verify(_record(task, session, _say(answer)))

    return await _episode(url, MATH_ROW, play)


async def test_math_without_a_judge_reads_the_answer_not_the_reasoning(nemo_gym):
    right = await _math(nemo_gym.urls["math_plain"], "<think>Is it \\boxed{3}? No.</think>So \\boxed{2}.")
    assert right.reward == 1.0 and right.components["extracted_answer"] == "2"
    # an answer left only in the reasoning is no answer (math_with_judge reads output_text)
    wrong = await _math(nemo_gym.urls["math_plain"], "<think>It is \\boxed{2}.</think>")
    assert wrong.reward == 0.0


async def test_math_with_a_reachable_judge(nemo_gym):
    # math-verify cannot read "two"; the judge (asked both ways round) says the answers are equal
    verification = await _math(nemo_gym.urls["math_judge"], "\\boxed{two}")
    assert verification.reward == 1.0 and verification.components["library_reward"] == 0.0
    assert nemo_gym.upstream_requests.count("/up/v1/responses") >= 2
    evaluations = verification.components["judge_evaluations"]
    assert isinstance(evaluations, str) and len(evaluations) <= MAX_COMPONENT_CHARS + 3  # capped, not copied whole


async def test_judge_outage_fails_the_episode_instead_of_training_a_zero(nemo_gym):
    with pytest.raises(EnvError, match="failure_kind=judge_failed"):
        await _math(nemo_gym.urls["math_judge_down"], "\\boxed{3}")  # wrong for math-verify: the judge is asked


async def test_judge_outage_through_the_runner_is_a_failed_sample(nemo_gym):
    question = MATH_ROW["responses_create_params"]["input"][0]["content"]
    env = _env(nemo_gym.urls["math_judge_down"])
    try:
        [sample] = await run_episodes(env, _task(MATH_ROW), sim=SimConfig(accuracy=1.0, answers={question: "\\boxed{3}"}))
    finally:
        await env.aclose()
    assert sample.status is Status.FAILED and sample.reward == 0.0
    assert "judge_failed" in sample.metadata["error"]


# ------------------------------------------------------------------ code_gen

CODE_ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "Read n and print 2n."}]},
    "verifier_metadata": {"unit_tests": {"inputs": ["3\n", "10\n"], "outputs": ["6\n", "20\n"]}},
}
CODE = "```python\nn = int(input())\nprint(2 * n)\n```"


@pytest.mark.parametrize(
    "text",
    [
        f"<think>Double it.</think>\n\n{CODE}",  # a thinking model's turn
        f"Double it.\n</think>\n\n{CODE}",  # the template opened <think> in the prompt
        CODE,
    ],
)
async def test_code_gen_scores_thinking_models(nemo_gym, text):
    async def play(session, task):
        return await session.verify(_record(task, session, _say(text)))

    verification = await _episode(nemo_gym.urls["code_gen"], CODE_ROW, play)
    assert verification.components["reasoning_format_violation_rate"] == 0.0
    assert verification.reward == 1.0
