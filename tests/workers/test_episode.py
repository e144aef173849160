"""Episode runner, token in / token out, through the engine path a cluster runs (the session's
stack: smg -> SGLang's own front -> the simulator, tests/support/engine_stack.py)."""

import asyncio

import aiohttp
import numpy as np
import pytest

from pipeline.config import EnvConfig, PipelineConfig, parse_config
from pipeline.schema import SamplingParams, Status, Task
from tests.support.engine_stack import SHARED_MODEL_CONTEXT, START_TIMEOUT_S, EngineStack, shared_stack
from workers.chat import ChatTokens
from workers.engine import EngineClient, Generation
from workers.envs.local import CALCULATOR_TOOL
from workers.envs.registry import build_environment
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.sim.tokenizer import load_test_tokenizer

TASK = Task(id="calc-1", env="calc", prompt="What is 12 * (3 + 4)?", label="84")
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)  # a test's timeout includes the session stack's start


@pytest.fixture
def stack() -> EngineStack:
    return shared_stack()


def engine(stack: EngineStack, **sim) -> str:
    """The stack's router, its simulators set to `sim` (SimConfig fields) with a clean slate."""
    stack.configure(**sim)
    return stack.router_url


async def on_every_engine(stack: EngineStack, *calls: tuple[str, dict]) -> None:
    """SGLang's control endpoints, called on each engine as slime's updater calls them."""
    async with aiohttp.ClientSession() as http:
        for path, body in calls:
            for url in stack.engine_urls:
                async with http.post(f"{url}{path}", json=body) as r:
                    assert r.status == 200, await r.text()


class RecordingClient(EngineClient):
    """The real HTTP client, keeping every answer so the test can compare token by token."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], Generation]] = []

    async def generate(self, input_ids, sampling, *, rid, routing_key, due_order=None):
        gen = await super().generate(input_ids, sampling, rid=rid, routing_key=routing_key)
        self.calls.append((list(input_ids), gen))
        return gen


@pytest.fixture(scope="module")
def chat():
    return ChatTokens(load_test_tokenizer())


def runner_for(client, chat, kind="calculator", env_overrides=None, **rollout) -> EpisodeRunner:
    config: PipelineConfig = parse_config({"rollout": rollout} if rollout else {})
    env_config = EnvConfig(kind=kind, **(env_overrides or {}))
    env = build_environment("calc", env_config)
    return EpisodeRunner(client, chat, env, EpisodeSettings.from_config(config, env_config, SamplingParams()))


async def test_multi_turn_tool_episode_lines_up_with_the_engine(chat, stack):
    url = engine(stack, accuracy=1.0, tool_use=1.0)
    await on_every_engine(stack, ("/update_weight_version", {"new_version": "3"}))
    async with RecordingClient(url) as client:
        sample = await runner_for(client, chat).run(TASK, "calc-1:0/0/1")
    assert sample.status is Status.COMPLETED and sample.reward == 1.0
    assert len(client.calls) == 2 and sample.metadata["turns"] == 2 and sample.metadata["tool_calls"] == 1

    # prompt = the chat template rendered once, tools included
    messages = [{"role": "user", "content": TASK.prompt}]
    prompt = chat.prompt_ids(messages, [CALCULATOR_TOOL])
    tokens, mask, log_probs = sample.token_array(), sample.loss_mask_array(), sample.log_prob_array()
    assert tokens[: len(prompt)].tolist() == prompt
    assert sample.num_tokens - sample.response_length == len(prompt)

    (input1, gen1), (input2, gen2) = client.calls
    assert input1 == prompt
    # turn 1: engine ids verbatim, mask 1, engine log-probs
    n1 = len(gen1.output_ids)
    assert tokens[len(prompt) : len(prompt) + n1].tolist() == gen1.output_ids
    assert mask[:n1].tolist() == [1] * n1
    np.testing.assert_array_equal(log_probs[:n1], np.asarray(gen1.log_probs, dtype=np.float32))
    # observation: the template's continuation tokens, mask 0, log-prob 0.0
    continuation = input2[len(input1) + n1 :]
    assert chat.tokenizer.decode(continuation) == (
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    c_end = n1 + len(continuation)
    assert mask[n1:c_end].tolist() == [0] * len(continuation)
    assert log_probs[n1:c_end].tolist() == [0.0] * len(continuation)
    # turn 2 sent the full sequence and was appended verbatim
    assert input2 == tokens[: len(input2)].tolist()
    assert tokens[len(input2) :].tolist() == gen2.output_ids
    assert mask[c_end:].tolist() == [1] * len(gen2.output_ids)
    np.testing.assert_array_equal(log_probs[c_end:], np.asarray(gen2.log_probs, dtype=np.float32))
    assert sample.weight_versions == ["3", "3"]
    assert "Answer: 84" in sample.response


async def test_abort_mid_episode_resumes_with_both_weight_versions(chat, stack):
    url = engine(stack, accuracy=1.0, tool_use=0.0, token_latency_s=0.004, latency_sigma=0.01,
                 length_mu=5.0, length_sigma=0.01)  # ~150 tokens, ~0.6 s
    await on_every_engine(stack, ("/update_weight_version", {"new_version": "0"}))
    async with RecordingClient(url) as client:
        episode = asyncio.create_task(runner_for(client, chat, kind="arithmetic").run(TASK, "calc-1:0/0/1"))
        while not stack.total_stats()["running"]:  # wait until the turn is being generated
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await on_every_engine(stack, ("/pause_generation", {}), ("/update_weight_version", {"new_version": "1"}),
                              ("/continue_generation", {}))  # slime's updater: pause (abort), push, continue
        sample = await asyncio.wait_for(episode, 20)
    assert sample.status is Status.COMPLETED and sample.reward == 1.0
    assert sample.weight_versions == ["0", "1"]
    (first_input, aborted), (second_input, resumed) = client.calls
    assert aborted.finish == "abort" and 0 < len(aborted.output_ids)
    assert second_input == first_input + aborted.output_ids  # resumed from the tokens so far
    response = sample.token_array()[len(first_input) :].tolist()
    assert response == aborted.output_ids + resumed.output_ids
    assert sample.loss_mask_array().tolist() == [1] * len(response)
    np.testing.assert_array_equal(
        sample.log_prob_array(), np.asarray(aborted.log_probs + resumed.log_probs, dtype=np.float32)
    )
    assert sample.metadata["turn_log"][0]["aborts"] == 1
    # the resumed turn continues the same plan: one stop, under the remaining budget
    assert resumed.finish == "stop"


async def test_context_overflow_truncates_and_bad_request_fails(chat, stack):
    url = engine(stack)
    long_task = Task(id="calc-1", env="calc", prompt="What is 12 * (3 + 4)? " * (SHARED_MODEL_CONTEXT // 10), label="84")
    async with EngineClient(url, backoff_s=0.01) as client:
        runner = runner_for(client, chat)
        sample = await runner.run(long_task, "e1")
        # the prompt alone fills the context (learned from /server_info): nothing is sent, and an
        # episode with no model token is failed, one masked EOS keeping it well-formed for slime
        assert sample.status is Status.FAILED and sample.response_length == 1
        assert sample.loss_mask_array().tolist() == [0] and "does not fit" in sample.metadata["error"]
        assert sample.metadata["turn_log"] == []
    async with EngineClient(url, backoff_s=0.01) as client:
        stack.sim("fail_next", {"status": 400, "message": "bad top_k"})
        sample = await runner_for(client, chat).run(TASK, "e2")
        assert sample.status is Status.FAILED and "bad top_k" in sample.metadata["error"]
        assert sample.reward == 0.0


async def test_malformed_tool_call_is_fed_back_and_counted(chat, stack):
    async with RecordingClient(engine(stack, accuracy=1.0, tool_use=1.0, malformed_rate=1.0)) as client:
        sample = await runner_for(client, chat).run(TASK, "e3")
    assert sample.status is Status.COMPLETED and sample.metadata["malformed_tool_calls"] == 1
    second_input = client.calls[1][0]
    assert "error: tool call 0: invalid JSON" in chat.tokenizer.decode(second_input)


async def test_budgets_truncate(chat, stack):
    async with EngineClient(engine(stack, tool_use=1.0, length_mu=4.0)) as client:
        sample = await runner_for(client, chat, max_response_tokens=10).run(TASK, "e4")
        assert sample.status is Status.TRUNCATED and sample.response_length == 10
        assert sample.metadata["turn_log"][0]["finish"] == "length"
        sample = await runner_for(client, chat, env_overrides={"max_turns": 1}).run(TASK, "e5")
        assert sample.status is Status.TRUNCATED and sample.metadata["turns"] == 1
        assert sample.loss_mask_array().all()  # the unanswered tool call got no observation tokens


class _BrokenAt:
    """A plugin environment that raises `exc` at `where` (start, verify): a bug or an outage."""

    @staticmethod
    def env(where: str, exc: BaseException):
        from tests.support.env_helpers import OneTurnSession
        from workers.envs.base import Environment

        class Session(OneTurnSession):
            async def verify(self, episode):
                if where == "verify":
                    raise exc
                return await super().verify(episode)

        class Env(Environment):
            async def start(self, task):
                if where == "start":
                    raise exc
                return Session(task)

        return Env("broken", EnvConfig(kind="x"))


@pytest.mark.parametrize("where", ["start", "verify"])
async def test_an_environments_bug_fails_the_job_and_its_outage_fails_the_episode(where):
    """A bug (TypeError, KeyError, ...) in an environment must reach the job (one try, dead
    letter with its traceback: workers/jobs.py), not turn into a quiet failed episode in every
    group; an outage (EnvError, a connection error) fails only that episode, with its reason."""
    from tests.support.env_helpers import run_episodes
    from workers.envs.base import EnvError

    task = Task(id="t", env="broken", prompt="What is 6 * 7?", label="42")
    with pytest.raises(TypeError, match="unsupported operand"):
        await run_episodes(_BrokenAt.env(where, TypeError("unsupported operand")), task)
    [sample] = await run_episodes(_BrokenAt.env(where, EnvError("POST /x: connection refused")), task)
    assert sample.status is Status.FAILED and "connection refused" in sample.metadata["error"]
