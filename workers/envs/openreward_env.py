"""`openreward`: an OpenReward environment through the real `openreward` SDK.

Optional extra (`pip install 'rollout-pipeline[openreward]'`); imported when the
first environment of this kind is built. Per episode: one SDK session for the task
(`task.metadata.task_spec`, or `split` + `index`, as producers/sources.py writes
them), its prompt and tools, tool calls through `call_tool` (per-call `reward` and
`finished`), and in `verify`, when the model ended with a plain message and the
environment has a `@terminal` tool, that message goes to the terminal tool (the
SDK's `is_assistant_message_final` contract). The reward is then shaped as in
OpenReward's train_config.yaml: rewards of every call, `nonterminal_reward`
appended when the episode never finished, `reward_reduction`, clamp.

`base_url` points at an environment server (a locally hosted
`openreward.environments.Server` works); without it the SDK's platform URL is used.
The API key comes from the env var named by `api_key_env`; the environment's own
secrets are the env vars listed in `secrets`, sent with the session (never logged).
A `ToolCallError` (unknown tool, bad arguments, episode over) is the model's
mistake and becomes the observation; transport failures use the call budgets;
a tool that crashed server-side (`ToolFailed`) fails the episode.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Union

from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import (
    Environment, EnvError, EnvSession, EpisodeRecord, Message, StepResult, ToolCall, Verification, opened,
)
from workers.envs.convert import chat_tool
from workers.envs.math import final_answer_text
from workers.envs.options import Options, parse_options, read_secrets
from workers.envs.rewards import call_with_budget, deadline_in, shaped

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0


class OpenRewardOptions(Options):
    environment: str  # "owner/name" on the platform, or an environment of a local server
    base_url: Union[str, None] = None  # environment server; None = the SDK's default
    variant: Union[str, None] = None
    api_key_env: str = "OPENREWARD_API_KEY"
    system_prompt: str = ""  # prepended as a system message when set
    # Domains each secret may be sent to, for secrets the SDK does not know by name
    # (openreward's WELL_KNOWN_SECRETS covers e.g. OPENAI_API_KEY).
    secret_domains: dict[str, list[str]] = {}


def _sdk() -> Any:
    try:
        import openreward
    except ImportError as exc:
        raise ConfigError("kind openreward needs the SDK: pip install 'rollout-pipeline[openreward]'") from exc
    return openreward


def blocks_text(blocks: Any) -> str:
    """Text of SDK output blocks; images are not passed to a text model."""
    return "".join(getattr(b, "text", None) or "[image omitted]" for b in blocks)


class OpenRewardEnvironment(Environment):
    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, OpenRewardOptions)
        self.sdk = _sdk()
        self.secrets: dict[str, Any] = {
            var: (value, self.options.secret_domains[var]) if var in self.options.secret_domains else value
            for var, value in read_secrets(name, config).items()
        }
        self._client: Any = None
        self._handle: Any = None

    def handle(self) -> Any:
        """The SDK's AsyncEnvironment (made on first use: its HTTP session needs the running loop)."""
        if self._handle is None:
            api_key = os.environ.get(self.options.api_key_env) or None
            self._client = self.sdk.AsyncOpenReward(api_key=api_key)
            self._handle = self._client.environments.get(
                self.options.environment, variant=self.options.variant, base_url=self.options.base_url
            )
        return self._handle

    def sdk_session(self, task: Task) -> Any:
        handle = self.handle()
        meta = task.metadata
        if "task_spec" in meta:
            from openreward.api.environments.types import Task as SdkTask

            env_name = meta.get("environment") or self.options.variant or handle.name
            spec = SdkTask(server_name=handle.server, environment_name=env_name, task_spec=meta["task_spec"], namespace=handle.namespace)
            return handle.session(task=spec, secrets=self.secrets or None)
        if "split" in meta and "index" in meta:
            return handle.session(split=meta["split"], index=int(meta["index"]), secrets=self.secrets or None)
        raise EnvError(f"openreward env {self.name!r}: task {task.id!r} has neither metadata.task_spec nor split+index")

    async def start(self, task: Task) -> EnvSession:
        session = OpenRewardSession(self, task)
        return await opened(session, session.open)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.environments.aclose()


class OpenRewardSession(EnvSession):
    def __init__(self, env: OpenRewardEnvironment, task: Task):
        self.env = env
        self.task = task
        self.session: Any = None
        self.messages: list[Message] = []
        self.tools: list[dict[str, Any]] = []
        self.terminal_tool: Any = None
        self.rewards: list[float] = []
        self.finished = False
        self.tool_errors = 0

    async def open(self) -> None:
        budget = self.env.config.timeouts.start
        what = f"openreward {self.env.name!r}"
        await call_with_budget(self._enter, budget, f"{what}: create session")
        prompt = await call_with_budget(self.session.get_prompt, budget, f"{what}: get_prompt")
        tools = await call_with_budget(lambda: self.session.list_tools(format="openai"), budget, f"{what}: list_tools")
        self.terminal_tool = await call_with_budget(self.session.terminal_tool, budget, f"{what}: terminal_tool")
        system = [{"role": "system", "content": self.env.options.system_prompt}] if self.env.options.system_prompt else []
        self.messages = [*system, {"role": "user", "content": blocks_text(prompt)}]
        self.tools = [chat_tool(t) for t in tools]

    async def _enter(self) -> None:
        """A fresh SDK session per attempt: a half-created one is torn down, not reused."""
        await self.close()
        self.session = self.env.sdk_session(self.task)
        await self.session.__aenter__()

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, Union[float, None], bool]:
        from openreward.api.errors import ToolCallError

        try:
            output = await self.session.call_tool(name, arguments)
        except ToolCallError as exc:  # the model's mistake: tell it
            self.tool_errors += 1
            return f"error: {exc}", None, False
        return blocks_text(output.blocks), output.reward, bool(output.finished)

    async def _run_tool(self, name: str, arguments: dict[str, Any], budget: Any, deadline: Union[float, None] = None) -> tuple[str, Union[float, None]]:
        text, reward, finished = await call_with_budget(
            lambda: self._call(name, arguments), budget, f"openreward {self.env.name!r}: tool {name}", deadline=deadline
        )
        if reward is not None:
            self.rewards.append(float(reward))
        self.finished = self.finished or finished
        return text, reward

    async def step(self, calls: list[ToolCall]) -> StepResult:
        observations: list[Message] = []
        step_rewards: list[float] = []
        for call in calls:
            if self.finished:
                text = f"{call.name!r} was not run: the episode has finished"
            else:
                text, reward = await self._run_tool(call.name, call.arguments, self.env.config.timeouts.step)
                if reward is not None:
                    step_rewards.append(float(reward))
            observations.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
        return StepResult(messages=observations, reward=sum(step_rewards) if step_rewards else None, done=self.finished)

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        ended_with_message = episode.status == Status.COMPLETED
        if not self.finished and ended_with_message and self.terminal_tool is not None:
            term = self.terminal_tool
            arguments = {} if term.arg is None else {term.arg: final_answer_text(episode)}
            await self._run_tool(term.name, arguments, timeouts.verify, deadline_in(timeouts.verify_deadline_s))
        components = {"tool_errors": self.tool_errors, "finished": self.finished}
        return shaped(self.env.config, self.rewards, terminal=self.finished, components=components)

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        try:
            await asyncio.wait_for(session.__aexit__(None, None, None), CLOSE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - closing must not fail the episode; the server reaps it
            log.warning("openreward %r: closing session failed: %r", self.env.name, exc)
