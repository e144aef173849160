"""`kind: retrain`: a retrain-interface environment (written here, to retrain's interface: async
reset/step, TypedDict observations and actions, 5-tuple steps) with tool calls and a reward
calculator, played through the real episode runner on the simulated engine.

retrain itself has no license: nothing of it is used here; these classes are ours, and they check
what they receive as strictly as retrain's types declare it (every TypedDict field present, the
literal values, tuple shapes).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, TypedDict

import pytest

from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from tests.support.env_helpers import chat_tokens, run_episodes
from workers.envs.local import evaluate_arithmetic
from workers.envs.retrain import RetrainEnvironment
from workers.sim.engine import SimConfig


class ToolCallAction(TypedDict):
    tool_name: str
    tool_input: Optional[dict[str, Any]]


class LLMAction(TypedDict):
    action_type: Literal["text_response", "tool_call"]
    text: Optional[str]
    tool_call: Optional[ToolCallAction]
    raw_llm_output: str
    reasoning: Optional[str]
    old_per_token_logps: Any


class ToolResultObservation(TypedDict):
    tool_name: str
    tool_output: Any
    status: Literal["success", "error"]
    error_message: Optional[str]


class EnvironmentObservation(TypedDict):
    observation_type: Literal["tool_result", "environment_state", "initial", "final_answer_feedback"]
    content: Optional[Any]
    tool_result: Optional[ToolResultObservation]
    current_conversation: list[dict[str, str]]
    available_tools: list[dict[str, str]]
    requires_llm_action: bool


RAW_ROLLOUT_FIELDS = {"full_conversation_history", "executed_llm_actions", "intrinsic_rewards_per_turn",
                      "final_environment_observation", "step_info_dicts_per_turn", "rollout_metadata"}
TOOLS = [{"name": "calculate", "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}]
EVENTS: list[tuple[str, Any]] = []


def _strict(value: dict, typed: type, what: str) -> None:
    assert set(value) == set(typed.__annotations__), f"{what}: fields {sorted(value)}"


class CalculatorQuiz:
    """A retrain-style Environment: one `calculate` tool, then a text answer checked against the label."""

    def __init__(self, *, answer_reward: float = 1.0, tool_reward: float = 0.0):
        self.answer_reward, self.tool_reward = answer_reward, tool_reward
        self.conversation: list[dict[str, str]] = []
        self.label: Optional[str] = None
        self.done = False

    async def setup(self) -> None:
        EVENTS.append(("setup", None))

    def _obs(self, kind: str, content: Any = None, result: Optional[ToolResultObservation] = None) -> EnvironmentObservation:
        return EnvironmentObservation(observation_type=kind, content=content, tool_result=result,
                                      current_conversation=list(self.conversation), available_tools=TOOLS,
                                      requires_llm_action=not self.done)

    async def reset(self, *, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None):
        EVENTS.append(("reset", seed))
        assert options is not None and isinstance(options["prompt"], str)
        self.label = options["label"]
        self.conversation = [{"role": "system", "content": "Use the calculate tool, then give the answer."},
                             {"role": "user", "content": options["prompt"]}]
        return self._obs("initial"), {"task_id": options["task_id"]}

    async def step(self, action: LLMAction):
        _strict(action, LLMAction, "LLMAction")
        assert isinstance(action["raw_llm_output"], str)
        assert not self.done, "stepped after the episode ended"
        if action["action_type"] == "tool_call":
            call = action["tool_call"]
            assert action["text"] is None and call is not None
            _strict(call, ToolCallAction, "ToolCallAction")
            if call["tool_name"] != "calculate":
                result = ToolResultObservation(tool_name=call["tool_name"], tool_output=None, status="error",
                                               error_message=f"unknown tool {call['tool_name']}")
            else:
                value = evaluate_arithmetic(str((call["tool_input"] or {}).get("expression", "")))
                result = ToolResultObservation(tool_name="calculate", tool_output=str(value), status="success",
                                               error_message=None)
            return self._obs("tool_result", result=result), self.tool_reward, False, False, {"tool": call["tool_name"]}
        assert action["action_type"] == "text_response" and action["tool_call"] is None
        found = re.findall(r"-?\d+(?:\.\d+)?", action["text"] or "")
        correct = bool(found) and found[-1] == self.label
        self.done = True
        return (self._obs("final_answer_feedback", "correct" if correct else "incorrect"),
                self.answer_reward if correct else 0.0, True, False, {"correct": correct})

    def close(self) -> None:
        EVENTS.append(("close", None))


class TurnBonusCalculator:
    """A retrain-style RewardCalculator: per turn, the intrinsic reward plus a bonus for a tool call."""

    def __init__(self, bonus: float = 0.25):
        self.bonus = bonus
        self.seen: list[dict] = []

    async def process_rollouts(self, batch):
        out = []
        for rollout in batch:
            assert set(rollout) == RAW_ROLLOUT_FIELDS
            _strict(rollout["final_environment_observation"], EnvironmentObservation, "EnvironmentObservation")
            actions = rollout["executed_llm_actions"]
            assert len(actions) == len(rollout["intrinsic_rewards_per_turn"]) == len(rollout["step_info_dicts_per_turn"])
            assert all(set(m) == {"role", "content"} for m in rollout["full_conversation_history"])
            self.seen.append(rollout)
            out.append([
                {"prompt_text": "", "completion_text": a["raw_llm_output"],
                 "final_combined_reward": r + (self.bonus if a["action_type"] == "tool_call" else 0.0),
                 "auxiliary_data": {}, "old_per_token_logps": None}
                for a, r in zip(actions, rollout["intrinsic_rewards_per_turn"])
            ])
        return out


class BadShape(CalculatorQuiz):
    async def step(self, action: LLMAction):
        return self._obs("tool_result"), 1.0, False  # a 3-tuple


class SyncStep:
    async def reset(self, *, seed=None, options=None):  # pragma: no cover - never built
        return {}, {}

    def step(self, action):  # pragma: no cover
        return None


def _env(**options) -> RetrainEnvironment:
    return RetrainEnvironment("quiz", EnvConfig(kind="retrain", options={"cls": f"{__name__}:CalculatorQuiz", **options}))


TASK = Task(id="q1", env="quiz", prompt="What is 12 * 7?", label="84", metadata={"seed": 7})


async def test_tool_call_then_answer_through_the_runner():
    EVENTS.clear()
    env = _env()
    [sample] = await run_episodes(env, TASK, sim=SimConfig(accuracy=1.0, tool_use=1.0))
    assert sample.status == Status.COMPLETED, sample.metadata
    assert sample.metadata["tool_calls"] == 1 and sample.metadata["turns"] == 2
    assert sample.reward == 1.0
    assert sample.reward_components["rewards"] == [0.0, 1.0] and sample.reward_components["terminal"] is True
    assert EVENTS == [("setup", None), ("reset", 7), ("close", None)]
    # the prompt is the environment's conversation and tools, rendered by the chat template
    chat = chat_tokens()
    messages = sample.metadata["messages"]
    assert messages[0]["content"].startswith("Use the calculate tool")
    prompt = chat.prompt_ids(messages[:2], [{"type": "function", "function": TOOLS[0]}])
    assert sample.token_array()[: len(prompt)].tolist() == prompt
    # the observation is environment tokens: mask 0, and it is the tool's output
    tool_message = next(m for m in messages if m["role"] == "tool")
    assert tool_message["content"] == "84" and tool_message["name"] == "calculate"
    mask = sample.loss_mask_array().tolist()
    response = sample.token_array()[len(prompt):].tolist()
    assert len(mask) == len(response) and 0 in mask and mask[0] == 1
    zero_span = [t for t, m in zip(response, mask) if m == 0]
    assert "84" in chat.tokenizer.decode(zero_span)
    assert sample.log_prob_array().tolist()[mask.index(0)] == 0.0


async def test_wrong_answer_and_reward_calculator():
    env = _env(reward_calculator=f"{__name__}:TurnBonusCalculator", reward_calculator_kwargs={"bonus": 0.25})
    [right] = await run_episodes(env, TASK, sim=SimConfig(accuracy=1.0, tool_use=1.0))
    [wrong] = await run_episodes(env, TASK, sim=SimConfig(accuracy=0.0, tool_use=1.0))
    assert right.reward == 1.25  # tool turn 0 + 0.25 bonus, answer 1.0 (reward_reduction: sum)
    assert wrong.reward == 0.25
    assert right.reward_components["intrinsic_rewards"] == [0.0, 1.0]
    rollout = env.calculator.seen[0]
    kinds = [a["action_type"] for a in rollout["executed_llm_actions"]]
    assert kinds == ["tool_call", "text_response"]
    assert rollout["executed_llm_actions"][0]["tool_call"] == {"tool_name": "calculate", "tool_input": {"expression": "12 * 7"}}
    assert rollout["step_info_dicts_per_turn"][0] == {"tool": "calculate"}


async def test_a_truncated_episode_gets_the_nonterminal_reward():
    env = RetrainEnvironment("quiz", EnvConfig(kind="retrain", max_turns=1, nonterminal_reward=-1.0,
                                               options={"cls": f"{__name__}:CalculatorQuiz"}))
    [sample] = await run_episodes(env, TASK, sim=SimConfig(accuracy=1.0, tool_use=1.0))
    assert sample.status == Status.TRUNCATED
    assert sample.reward == -1.0  # no answer was given: the text_response step never ran


async def test_a_step_of_the_wrong_shape_fails_the_episode():
    env = _env(cls=f"{__name__}:BadShape")
    [sample] = await run_episodes(env, TASK, sim=SimConfig(accuracy=1.0, tool_use=1.0))
    assert sample.status == Status.FAILED
    assert "(observation, reward, terminated, truncated, info)" in sample.metadata["error"]


def test_config_errors():
    with pytest.raises(ConfigError, match=r"options\.cls: .*no async step"):
        _env(cls=f"{__name__}:SyncStep")
    with pytest.raises(ConfigError, match=r"options\.reward_calculator"):
        _env(reward_calculator=f"{__name__}:TOOLS")
    with pytest.raises(ConfigError, match=r"options\.cls"):
        _env(cls=f"{__name__}:Nope")
