"""`retrain`: a retrain `Environment` per episode, optionally a retrain `RewardCalculator` as verifier.

The interface (retrain, `retrain/environment/environment.py` and `types.py` at the slime-bridge
commit): an environment object with

    async reset(*, seed=None, options=None) -> (EnvironmentObservation, info: dict)
    async step(action: LLMAction) -> (EnvironmentObservation, reward: float, terminated: bool,
                                      truncated: bool, info: dict)
    async setup() (optional), close() (optional)

`EnvironmentObservation` is a dict with `observation_type`, `content`, `tool_result`
(`{tool_name, tool_output, status, error_message}` or None), `current_conversation` (chat
messages), `available_tools` and `requires_llm_action`. `LLMAction` is a dict with
`action_type` ("text_response" | "tool_call"), `text`, `tool_call` (`{tool_name, tool_input}`),
`raw_llm_output`, `reasoning`, `old_per_token_logps`. Nothing of retrain is imported here: the
configured class is loaded by its dotted path, and the dicts are built and checked by their
field names, so retrain (which has no license) is never copied or vendored.

Per episode (a fresh instance from `options.cls(**options.kwargs)`):
- *start*: `setup()`, then `reset(seed=metadata.seed, options={task fields})`; the prompt is the
  observation's `current_conversation` (else the task's prompt), the tools its `available_tools`
  as chat-template function schemas.
- *tool calls*: each parsed call is one `step` with a `tool_call` action; the observation
  (its `tool_result` output, or its error, or `content`) is appended as the tool message
  (environment tokens, loss mask 0); the step's reward is a step reward; `terminated` or
  `truncated` ends the episode.
- *the final text answer*: when the model answers without a tool call, `verify` sends it as a
  `text_response` action, the step that retrain environments score answers on.
- *reward*: without a reward calculator, the step rewards reduced with `reward_reduction`
  (nonterminal reward when `terminated` never came, clamps). With `options.reward_calculator`
  (an object with `async process_rollouts([RawRolloutData]) -> [[turn, ...]]`), the rollout is
  handed to it as retrain's `RawRolloutData` and the turns' `final_combined_reward`s are reduced
  the same way.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from typing import Any, Union

from pipeline.aio import wait_for
from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import (
    EnvError,
    Environment,
    EnvSession,
    EpisodeRecord,
    Message,
    StepResult,
    ToolCall,
    Verification,
    opened,
)
from workers.envs.local import initial_messages
from workers.envs.options import Options, parse_options
from workers.envs.rewards import call_with_budget, deadline_in, shaped
from workers.plugins import import_dotted

OBSERVATION_KEYS = (
    "observation_type", "content", "tool_result", "current_conversation", "available_tools", "requires_llm_action",
)
OBSERVATION_TYPES = ("tool_result", "environment_state", "initial", "final_answer_feedback")
TOOL_RESULT_KEYS = ("tool_name", "tool_output", "status", "error_message")
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class RetrainOptions(Options, frozen=True):
    cls: str  # dotted path of the retrain Environment subclass (one instance per episode)
    kwargs: dict[str, Any] = {}  # its constructor's keyword arguments
    reward_calculator: Union[str, None] = None  # dotted path of a RewardCalculator class or factory
    reward_calculator_kwargs: dict[str, Any] = {}
    seed_key: str = "seed"  # metadata key of the seed passed to reset (absent: seed=None)


def _import(name: str, key: str, target: str) -> Any:
    try:
        return import_dotted(target)
    except ValueError as exc:
        raise ConfigError(f"environments.{name}.options.{key}: {exc}") from exc


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def check_observation(obs: Any, where: str) -> dict[str, Any]:
    """The observation when it is an EnvironmentObservation; EnvError naming what is wrong."""
    if not isinstance(obs, dict):
        raise EnvError(f"{where}: observation must be an EnvironmentObservation dict, got {type(obs).__name__}")
    missing = [k for k in OBSERVATION_KEYS if k not in obs]
    if missing:
        raise EnvError(f"{where}: observation lacks EnvironmentObservation field(s) {missing}")
    if obs["observation_type"] not in OBSERVATION_TYPES:
        raise EnvError(f"{where}: observation_type {obs['observation_type']!r} is not one of {list(OBSERVATION_TYPES)}")
    result = obs["tool_result"]
    if result is not None:
        if not isinstance(result, dict) or [k for k in TOOL_RESULT_KEYS if k not in result]:
            raise EnvError(f"{where}: tool_result must be a ToolResultObservation with {list(TOOL_RESULT_KEYS)}")
        if result["status"] not in ("success", "error"):
            raise EnvError(f"{where}: tool_result.status {result['status']!r} is not 'success' or 'error'")
    if not isinstance(obs["current_conversation"], list) or not isinstance(obs["available_tools"], list):
        raise EnvError(f"{where}: current_conversation and available_tools must be lists")
    return obs


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        value = value.item() if hasattr(value, "item") else value  # a 0-d tensor / numpy scalar
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EnvError(f"{where}: reward must be a number, got {type(value).__name__}")
    return float(value)


def tool_schema(tool: Any) -> dict[str, Any]:
    """An `available_tools` entry as a chat-template function schema."""
    if not isinstance(tool, dict) or not tool.get("name") and tool.get("type") != "function":
        raise EnvError(f"retrain available_tools entry must be a dict with a name, got {tool!r:.200}")
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        return tool
    parameters: Any = tool.get("parameters") or tool.get("input_schema") or {"type": "object", "properties": {}}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError:
            parameters = {"type": "object", "properties": {}}
    function = {"name": str(tool["name"]), "description": str(tool.get("description") or ""), "parameters": parameters}
    return {"type": "function", "function": function}


def observation_text(obs: dict[str, Any]) -> str:
    """What the model sees of an observation: the tool's output (or its error), else the content."""
    result = obs.get("tool_result")
    if result is not None:
        if result["status"] == "error":
            return f"error: {result.get('error_message') or result.get('tool_output') or 'tool failed'}"
        output = result.get("tool_output")
        return output if isinstance(output, str) else json.dumps(output, default=str)
    content = obs.get("content")
    if content is None:
        return ""
    return content if isinstance(content, str) else json.dumps(content, default=str)


def _text_messages(messages: list[Message]) -> list[dict[str, str]]:
    """Chat messages as retrain keeps its conversation: role and text content."""
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            content = ((content or "") + "\n" + json.dumps(calls)).strip()
        out.append({"role": str(m.get("role")), "content": content if isinstance(content, str) else json.dumps(content)})
    return out


def _reasoning(text: str) -> Union[str, None]:
    found = _THINK.findall(text)
    return "\n".join(t.strip() for t in found) if found else None


class RetrainEnvironment(Environment):
    options_type = RetrainOptions

    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, RetrainOptions)
        self.cls = _import(name, "cls", self.options.cls)
        for method in ("reset", "step"):
            if not inspect.iscoroutinefunction(getattr(self.cls, method, None)):
                raise ConfigError(
                    f"environments.{name}.options.cls: {self.options.cls!r} has no async {method}() (retrain Environment)"
                )
        self.calculator: Any = None
        if self.options.reward_calculator is not None:
            factory = _import(name, "reward_calculator", self.options.reward_calculator)
            where = f"environments.{name}.options.reward_calculator"
            if not callable(factory):
                raise ConfigError(f"{where}: {self.options.reward_calculator!r} is not a class or factory")
            try:
                self.calculator = factory(**self.options.reward_calculator_kwargs)
            except Exception as exc:  # noqa: BLE001 - the user's constructor
                raise ConfigError(f"{where}: building it failed: {exc!r}") from exc
            if not callable(getattr(self.calculator, "process_rollouts", None)):
                raise ConfigError(
                    f"environments.{name}.options.reward_calculator: {self.options.reward_calculator!r} gives no "
                    "process_rollouts(batch) (retrain RewardCalculator)"
                )

    async def start(self, task: Task) -> EnvSession:
        try:
            impl = self.cls(**self.options.kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise EnvError(f"retrain env {self.name!r}: {self.options.cls}(**kwargs) failed: {exc!r}") from exc
        session = RetrainSession(self, task, impl)
        return await opened(session, session.open)


class RetrainSession(EnvSession):
    def __init__(self, env: RetrainEnvironment, task: Task, impl: Any):
        self.env, self.task, self.impl = env, task, impl
        self.where = f"retrain env {env.name!r}"
        self.messages: list[Message] = initial_messages(task)
        self.tools: list[dict[str, Any]] = []
        self.actions: list[dict[str, Any]] = []  # LLMActions sent, in order
        self.rewards: list[float] = []  # intrinsic reward per action
        self.infos: list[dict[str, Any]] = []  # info per action
        self.observations: list[dict[str, Any]] = []
        self.terminated = False
        self.ended = False  # terminated or truncated: no more steps
        self.closed = False

    async def open(self) -> None:
        timeouts = self.env.config.timeouts
        seed = self.task.metadata.get(self.env.options.seed_key)
        options = {**self.task.metadata, "task_id": self.task.id, "prompt": self.task.prompt, "label": self.task.label}

        async def reset() -> tuple[Any, ...]:
            await _maybe_await(getattr(self.impl, "setup", lambda: None)())
            return await self.impl.reset(seed=seed if isinstance(seed, int) else None, options=options)

        returned = await call_with_budget(reset, timeouts.start, f"{self.where}: reset")
        if not isinstance(returned, tuple) or len(returned) != 2 or not isinstance(returned[1], dict):
            raise EnvError(f"{self.where}: reset must return (EnvironmentObservation, info dict), got {returned!r:.200}")
        obs = check_observation(returned[0], f"{self.where}: reset")
        self.observations.append(obs)
        if obs["current_conversation"]:
            self.messages = [dict(m) for m in obs["current_conversation"]]
        self.tools = [tool_schema(t) for t in obs["available_tools"]]

    async def _step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float, bool, bool]:
        where = f"{self.where}: step ({action['action_type']})"
        try:
            returned = await wait_for(self.impl.step(action), self.env.config.timeouts.step.timeout_s)
        except asyncio.TimeoutError as exc:  # a step is not idempotent: never sent twice
            raise EnvError(f"{where}: no answer in {self.env.config.timeouts.step.timeout_s}s") from exc
        if not isinstance(returned, tuple) or len(returned) != 5:
            raise EnvError(f"{where}: must return (observation, reward, terminated, truncated, info), got {returned!r:.200}")
        obs, reward, terminated, truncated, info = returned
        obs = check_observation(obs, where)
        if not isinstance(terminated, bool) or not isinstance(truncated, bool) or not isinstance(info, dict):
            raise EnvError(f"{where}: terminated and truncated must be bools and info a dict")
        value = _number(reward, where)
        self.actions.append(action)
        self.rewards.append(value)
        self.infos.append(info)
        self.observations.append(obs)
        self.terminated = self.terminated or terminated
        self.ended = self.ended or terminated or truncated
        return obs, value, terminated, truncated

    async def step(self, calls: list[ToolCall]) -> StepResult:
        out: list[Message] = []
        rewards: list[float] = []
        for call in calls:
            if self.ended:
                out.append({"role": "tool", "tool_call_id": call.id, "name": call.name,
                            "content": "error: the episode has ended"})
                continue
            action = {
                "action_type": "tool_call",
                "text": None,
                "tool_call": {"tool_name": call.name, "tool_input": dict(call.arguments)},
                "raw_llm_output": json.dumps({"name": call.name, "arguments": call.arguments}),
                "reasoning": None,
                "old_per_token_logps": None,
            }
            obs, reward, _terminated, _truncated = await self._step(action)
            rewards.append(reward)
            out.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": observation_text(obs)})
        return StepResult(messages=out, reward=sum(rewards) if rewards else None, done=self.ended)

    async def verify(self, episode: EpisodeRecord) -> Verification:
        last = next((m for m in reversed(episode.messages) if m.get("role") == "assistant"), None)
        if last is not None and not last.get("tool_calls") and episode.status == Status.COMPLETED and not self.ended:
            text = str(last.get("content") or "")
            await self._step({
                "action_type": "text_response",
                "text": _THINK.sub("", text).strip(),
                "tool_call": None,
                "raw_llm_output": text,
                "reasoning": _reasoning(text),
                "old_per_token_logps": None,
            })
        components: dict[str, Any] = {"actions": len(self.actions), "intrinsic_rewards": list(self.rewards)}
        rewards = list(self.rewards)
        if self.env.calculator is not None:
            rewards = await call_with_budget(
                lambda: self._calculate(episode), self.env.config.timeouts.verify, f"{self.where}: reward calculator",
                deadline=deadline_in(self.env.config.timeouts.verify_deadline_s),
            )
        return shaped(self.env.config, rewards, terminal=self.terminated, components=components)

    async def _calculate(self, episode: EpisodeRecord) -> list[float]:
        rollout = {
            "full_conversation_history": _text_messages(episode.messages),
            "executed_llm_actions": list(self.actions),
            "intrinsic_rewards_per_turn": list(self.rewards),
            "final_environment_observation": self.observations[-1],
            "step_info_dicts_per_turn": list(self.infos),
            "rollout_metadata": {"task_id": self.task.id, "status": episode.status.value, "turns": episode.turns},
        }
        trajectories = await _maybe_await(self.env.calculator.process_rollouts([rollout]))
        if not isinstance(trajectories, list) or len(trajectories) != 1 or not isinstance(trajectories[0], list):
            raise EnvError(f"{self.where}: process_rollouts must return one trajectory per rollout")
        turns = trajectories[0]
        if self.actions and not turns:  # retrain's calculator returns [] when it failed on the rollout
            raise EnvError(f"{self.where}: the reward calculator returned no turns for {len(self.actions)} action(s)")
        return [_number(t.get("final_combined_reward") if isinstance(t, dict) else None, f"{self.where}: turn")
                for t in turns]

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        closer = getattr(self.impl, "close", None)
        if callable(closer):
            await _maybe_await(closer())
