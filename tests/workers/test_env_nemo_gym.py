"""`nemo_gym`: a NeMo Gym-protocol resources server on loopback, driven by real episodes."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status
from tests.support.env_helpers import GymServer, gym_task, run_episodes, serve_gym
from workers.envs.base import EnvError, EpisodeRecord, ToolCall
from workers.envs.nemo_gym import NemoGymEnvironment


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


# ------------------------------------------------------------------ conversions (fast; the real servers are in
# tests/conformance/test_conformance_nemo_gym.py)

import json  # noqa: E402

from aiohttp import web  # noqa: E402

from pipeline.config import parse_config  # noqa: E402
from pipeline.schema import decode_task_json  # noqa: E402
from producers.prepare_tasks import PrepareError, prepare_tasks  # noqa: E402
from tests.support.env_helpers import EVALUATE_TOOL, chat_tokens  # noqa: E402
from workers.envs.convert import input_problems, prompt_messages, responses_output, split_reasoning  # noqa: E402
from workers.envs.nemo_gym import MAX_COMPONENT_CHARS, verify_components  # noqa: E402


@pytest.mark.parametrize(
    "text,reasoning,answer",
    [
        ("plain", [], "plain"),
        ("<think>a</think>\n\nb", ["a"], "b"),
        ("a\n</think>\n\nb", ["a"], "b"),  # the template opened <think> in the prompt
        ("x <think>cut off", ["cut off"], "x"),  # truncated while thinking
        ("<think>a</think>b<think>c</think>d", ["a", "c"], "bd"),
        ("<think>a</think>b</think>", ["a"], "b</think>"),  # a stray tag stays: the server may penalise it
    ],
)
def test_split_reasoning(text, reasoning, answer):
    assert split_reasoning(text) == (reasoning, answer)


def test_responses_output_puts_reasoning_in_its_own_item():
    output = responses_output([
        {"role": "assistant", "content": "<think>look it up</think>", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "evaluate", "arguments": {"expression": "6*7"}}}]},
        {"role": "tool", "tool_call_id": "call_0", "name": "evaluate", "content": "42"},
        {"role": "assistant", "content": "<think>done</think>Answer: 42"},
    ])
    assert [item["type"] for item in output] == ["reasoning", "function_call", "function_call_output", "reasoning", "message"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "look it up"}]
    assert output[-1]["content"][0]["text"] == "Answer: 42"
    assert output[1]["call_id"] == output[2]["call_id"]


HISTORY_PARAMS = {
    "instructions": "Be exact.",
    "input": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "6*7?"}]},
        {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "compute"}]},
        {"type": "function_call", "call_id": "h1", "name": "evaluate", "arguments": '{"expression": "6*7"}'},
        {"type": "function_call_output", "call_id": "h1", "output": "42"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And 6*8?"},
    ],
    "tools": [EVALUATE_TOOL],
}


def test_prompt_messages_render_instructions_and_history():
    assert prompt_messages(HISTORY_PARAMS) == [
        {"role": "system", "content": "Be exact.\n\nUse tools."},
        {"role": "user", "content": "6*7?"},
        {"role": "assistant", "content": "", "reasoning_content": "compute", "tool_calls": [
            {"id": "h1", "type": "function", "function": {"name": "evaluate", "arguments": {"expression": "6*7"}}}]},
        {"role": "tool", "tool_call_id": "h1", "name": "evaluate", "content": "42"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And 6*8?"},
    ]
    assert chat_tokens().prompt_ids(prompt_messages(HISTORY_PARAMS), None)  # the chat template takes it


def test_input_problems_name_the_field():
    assert input_problems(HISTORY_PARAMS) == []
    bad = {"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}, {"type": "web_search_call"}],
           "tool_choice": None, "parallel_tool_calls": None}
    assert [where for where, _ in input_problems(bad)] == [
        "responses_create_params.input[0].call_id", "responses_create_params.input[1].type",
        "responses_create_params.tool_choice", "responses_create_params.parallel_tool_calls",
    ]


def test_verify_components_keep_numbers_and_short_strings_and_cap_the_rest():
    body = {"question": "q", "response": {}}
    answer = {**body, "reward": 1.0, "mask_sample": False, "_ng_failure_class": "x", "ok": True, "n": 3,
              "short": "yes", "long": "x" * 5000, "nested": {"a": list(range(1000))}, "small": {"a": 1}}
    components = verify_components(answer, body)
    assert components == {"ok": True, "n": 3, "short": "yes", "long": "x" * MAX_COMPONENT_CHARS + "...",
                          "nested": components["nested"], "small": {"a": 1}}
    assert components["nested"].startswith('{"a":[0,1,2') and len(components["nested"]) == MAX_COMPONENT_CHARS + 3


async def test_masked_verification_fails_the_episode_with_the_failure_kind():
    async def verify(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({**body, "reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed",
                                  "failure_reason": "judge unreachable"})

    async def seed(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/seed_session", seed)
    app.router.add_post("/verify", verify)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    env = _env(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        [sample] = await run_episodes(env, gym_task())
    finally:
        await env.aclose()
        await runner.cleanup()
    assert sample.status is Status.FAILED and sample.reward == 0.0
    assert "failure_kind=judge_failed" in sample.metadata["error"]


async def test_a_tool_call_to_a_server_that_went_away_is_retried_then_fails_unsent():
    server = GymServer()
    async with serve_gym(server) as url:
        env = _env(url, timeouts={"step": {"timeout_s": 2.0, "retries": 2, "backoff_s": 0.01}})
        session = await env.start(gym_task())
    # the server is gone; its closed keep-alive connection leaves the client's pool once the loop
    # reads the EOF (long before any real next call). A call on it the same instant would fail
    # after writing, which is rightly reported as "may have run", not retried.
    await asyncio.sleep(0.05)
    try:
        with pytest.raises(EnvError, match=r"not sent after 3 attempt\(s\)"):
            await session.step([ToolCall(id="call_0", name="evaluate", arguments={"expression": "1"})])
    finally:
        await session.close()
        await env.aclose()


async def test_a_row_nemo_gym_would_refuse_fails_before_seeding():
    env = _env("http://127.0.0.1:9")
    task = gym_task()
    task.metadata = {**task.metadata, "responses_create_params": {**task.metadata["responses_create_params"], "parallel_tool_calls": None}}
    with pytest.raises(EnvError, match=r"responses_create_params\.parallel_tool_calls: is null"):
        await env.start(task)


def _prepare(tmp_path, rows):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config({"environments": {"gym": {"kind": "nemo_gym", "options": {"url": "http://x"},
                                                     "dataset": {"source": "nemo_gym", "files": ["rows.jsonl"]}}}})
    return prepare_tasks(config, tmp_path / "tasks.jsonl", base_dir=tmp_path)


def test_prepare_takes_rows_with_history_and_renders_their_prompt(tmp_path):
    row = {"id": "h", "responses_create_params": HISTORY_PARAMS, "expected_answer": "48"}
    _prepare(tmp_path, [row])
    [task] = [decode_task_json(line) for line in (tmp_path / "tasks.jsonl").read_bytes().splitlines()]
    assert task.prompt == prompt_messages(HISTORY_PARAMS)
    assert task.metadata == row  # the row travels whole: /seed_session and /verify get it back


def test_prepare_refuses_null_tool_choice_with_file_line_and_field(tmp_path):
    good = {"responses_create_params": {"input": "hi"}}
    bad = {"responses_create_params": {"input": "hi", "tool_choice": None}}
    with pytest.raises(PrepareError, match=r"rows\.jsonl:2: field responses_create_params\.tool_choice: is null"):
        _prepare(tmp_path, [good, bad])
