"""`openreward`: an OpenReward environment through the real `openreward` SDK.

Optional extra (`pip install 'rollout-pipeline[openreward]'`); imported when the
first environment of this kind is built. Per episode: one SDK session for the task
(`task.metadata.task_spec`, or `split` + `index`, as producers/sources.py writes
them); its prompt as the SDK's conversation (`get_messages(format="openai")`: system,
user, assistant turns with tool calls and reasoning, tool results, as the environment
wrote them; prompt-only environments and servers before SDK 0.1.157 answer a single
user message) and its tools; tool calls through the SDK (per-call `reward` and
`finished`), and in `verify`, when the model ended with a plain message and the
environment has a `@terminal` tool, that message goes to the terminal tool (the
SDK's `is_assistant_message_final` contract), its reasoning (`<think>...</think>`) cut
off. The reward is then shaped as in
OpenReward's train_config.yaml: rewards of every call, `nonterminal_reward`
appended when the episode never finished, `reward_reduction`, clamp.

A tool call runs at most once. The SDK's `/call` is a resumable SSE stream: once the
server has named the call's task, a dropped stream is resumed (the server replays that
one run); before that, this module asks the SDK not to re-POST (`resumable_only`, where
the SDK has it) and sends again only a call whose connection never opened. An answer
lost otherwise (a timeout, a stream that broke before its task id) fails the episode:
the call may have run and its reward is unknown. A call refused with "episode finished"
when no answer said so means an answer was lost (the SDK re-sent a call that had
finished the episode): an environment failure, not the model's mistake. Other
`ToolCallError`s (unknown tool, bad arguments) are the model's mistake and become its
observation; a tool that crashed server-side (`ToolFailed`) fails the episode.

`base_url` points at an environment server (a locally hosted
`openreward.environments.Server` works); without it the SDK's platform URL is used.
The API key comes from the env var named by `api_key_env`; the environment's own
secrets are the env vars listed in `secrets`, sent with the session (never logged).

With `upload` (opt-in), every finished episode of the chosen tasks is also uploaded to
OpenReward's rollout viewer (`workers/upload.py`, off the episode's path): its whole
conversation, each tool result with its call's reward and `finished`, the final answer
with the terminal tool's, and as the rollout's metadata the trained reward, status, step
rewards and policy versions; the task spec as `task_spec`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
from typing import Any, Union

import aiohttp

from pipeline.aio import wait_for
from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Sample, Status, Task
from workers.envs.answers import MalformedAnswer
from workers.envs.base import (
    EnvError,
    Environment,
    EnvSession,
    EpisodeRecord,
    Message,
    StepResult,
    ToolCall,
    Verification,
    call_once,
    opened,
)
from workers.envs.convert import chat_tool, content_text, split_reasoning
from workers.envs.math import final_answer_text
from workers.envs.options import Options, parse_options, read_secrets
from workers.envs.rewards import call_with_budget, deadline_in, shaped
from workers.upload import FINAL_ANSWER, Trajectory, TrajectoryUploader, UploadOptions, chosen, events_of

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0


class OpenRewardOptions(Options, frozen=True):
    environment: str  # "owner/name" on the platform, or an environment of a local server
    base_url: Union[str, None] = None  # environment server; None = the SDK's default
    variant: Union[str, None] = None
    api_key_env: str = "OPENREWARD_API_KEY"
    system_prompt: str = ""  # the system message when set (before the environment's own system text)
    # Domains each secret may be sent to, for secrets the SDK does not know by name
    # (openreward's WELL_KNOWN_SECRETS covers e.g. OPENAI_API_KEY).
    secret_domains: dict[str, list[str]] = {}
    # Upload finished episodes to OpenReward's rollout viewer (docs/environments.md); None = off
    upload: Union[UploadOptions, None] = None


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
        self.uploader: Union[TrajectoryUploader, None] = None
        if self.options.upload is not None:
            if not os.environ.get(self.options.api_key_env):
                raise ConfigError(f"environments.{name}.options.upload: the API key ${self.options.api_key_env} is not set")
            self.uploader = TrajectoryUploader(
                api_key=os.environ[self.options.api_key_env],
                api_url=self.options.upload.api_url,
                queue_size=self.options.upload.queue_size,
                what=f"openreward upload (env {name!r})",
            )

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

    def upload(self, session: OpenRewardSession, sample: Sample, episode_id: str, run: str) -> None:
        """Queue the episode for upload when it is configured and its task chosen (never blocks)."""
        settings = self.options.upload
        if self.uploader is None or settings is None or not chosen(session.task.id, settings.every):
            return
        self.uploader.submit(trajectory_of(self, session, sample, episode_id, settings.run_name or run or "rollout"))

    async def aclose(self) -> None:
        if self.uploader is not None:
            await asyncio.to_thread(self.uploader.close)
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
        # (reward, finished) per tool call id, and the terminal tool's under FINAL_ANSWER: the upload's
        self.call_results: dict[str, tuple[Union[float, None], bool]] = {}

    async def open(self) -> None:
        budget = self.env.config.timeouts.start
        what = f"openreward {self.env.name!r}"
        await call_with_budget(self._enter, budget, f"{what}: create session")
        if hasattr(self.session, "get_messages"):
            conversation = await call_with_budget(lambda: self.session.get_messages(format="openai"), budget, f"{what}: get_messages")
            messages = chat_conversation(conversation)
        else:  # an SDK before 0.1.157
            prompt = await call_with_budget(self.session.get_prompt, budget, f"{what}: get_prompt")
            messages = [{"role": "user", "content": blocks_text(prompt)}]
        tools = await call_with_budget(lambda: self.session.list_tools(format="openai"), budget, f"{what}: list_tools")
        self.terminal_tool = await call_with_budget(self.session.terminal_tool, budget, f"{what}: terminal_tool")
        self.messages = with_system_prompt(messages, self.env.options.system_prompt)
        self.tools = [chat_tool(t) for t in tools]

    async def _enter(self) -> None:
        """A fresh SDK session per attempt: a half-created one is torn down, not reused."""
        await self.close()
        self.session = self.env.sdk_session(self.task)
        await self.session.__aenter__()

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, Union[float, None], bool]:
        from openreward.api.errors import ToolCallError

        try:
            output = await call_tool_once(self.session, name, arguments)
        except ToolCallError as exc:
            if exc.reason == "episode_finished" and not self.finished:
                raise EnvError(
                    f"openreward {self.env.name!r}: tool {name}: the server says the episode finished, but no "
                    "answer said so: an earlier answer was lost"
                ) from exc
            self.tool_errors += 1  # the model's mistake: tell it
            return f"error: {exc}", None, False
        return blocks_text(output.blocks), *self._checked(name, output.reward, output.finished)

    def _checked(self, name: str, reward: Any, finished: Any) -> tuple[Union[float, None], bool]:
        """The answer's reward and `finished` as its protocol types them. The SDK client copies
        them off the wire unchecked, so a server's "reward": "high" would reach `float()` in our
        code (a bug, failing the job) and "finished": "false" would end the episode (truthy):
        both are the server's fault, a failed episode naming what came."""
        what = self._tool_label(name)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise MalformedAnswer(f"{what}: the answer's reward {reward!r} is not a finite number")
        if not isinstance(finished, bool):
            raise MalformedAnswer(f"{what}: the answer's finished {finished!r} is not true or false")
        return (None if reward is None else float(reward)), finished

    def _tool_label(self, name: str) -> str:
        return f"openreward {self.env.name!r}: tool {name}"

    async def _run_tool(self, name: str, arguments: dict[str, Any], budget: Any, deadline: Union[float, None] = None) -> tuple[str, Union[float, None]]:
        what = self._tool_label(name)
        if deadline is not None:
            budget = _within(budget, deadline)
        try:
            text, reward, finished = await call_once(lambda: self._call(name, arguments), budget, what, unsent=_unsent)
        except EnvError:
            raise
        except asyncio.TimeoutError as exc:
            raise EnvError(f"{what}: no answer within {budget.timeout_s:g}s; not sent again (it may have run)") from exc
        except Exception as exc:  # noqa: BLE001 - SDK transport errors, ToolFailed, a dead session
            raise EnvError(f"{what}: {type(exc).__name__}: {exc}"[:600]) from exc
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
                self.call_results[call.id] = (reward, self.finished)
                if reward is not None:
                    step_rewards.append(float(reward))
            observations.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
        return StepResult(messages=observations, reward=sum(step_rewards) if step_rewards else None, done=self.finished)

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        ended_with_message = episode.status == Status.COMPLETED
        if not self.finished and ended_with_message and self.terminal_tool is not None:
            term = self.terminal_tool
            # the answer, not the reasoning before it (as a reasoning parser would hand it over)
            arguments = {} if term.arg is None else {term.arg: split_reasoning(final_answer_text(episode))[1]}
            _, reward = await self._run_tool(term.name, arguments, timeouts.verify, deadline_in(timeouts.verify_deadline_s))
            self.call_results[FINAL_ANSWER] = (reward, self.finished)
        components = {"tool_errors": self.tool_errors, "finished": self.finished}
        return shaped(self.env.config, self.rewards, terminal=self.finished, components=components)

    def episode_done(self, sample: Sample, episode_id: str, run: str) -> None:
        self.env.upload(self, sample, episode_id, run)

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        try:
            await wait_for(session.__aexit__(None, None, None), CLOSE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - closing must not fail the episode; the server reaps it
            log.warning("openreward %r: closing session failed: %r", self.env.name, exc)


def trajectory_of(env: OpenRewardEnvironment, session: OpenRewardSession, sample: Sample, episode_id: str, run_name: str) -> Trajectory:
    """What the viewer gets of one episode (plain data; the SDK's objects are made in the upload thread)."""
    task = session.task
    messages = sample.metadata.get("messages")
    if not isinstance(messages, list):  # a plain single-turn episode: the prompt, then the response
        messages = [*session.messages, {"role": "assistant", "content": sample.response.strip()}]
    metadata: dict[str, Any] = {
        "reward": sample.reward,
        "status": sample.status.value,
        "step_rewards": list(sample.metadata.get("step_rewards", [])),
        "policy_versions": list(sample.policy_versions),
        "policy_run": sample.policy_run,
        "task_id": task.id,
        "pipeline_env": env.name,
    }
    if sample.metadata.get("error"):
        metadata["error"] = str(sample.metadata["error"])[:500]
    spec = task.metadata.get("task_spec")
    return Trajectory(
        run_name=run_name,
        rollout_name=episode_id,
        environment=task.metadata.get("environment") or env.options.environment,
        variant=env.options.variant,
        split=task.metadata.get("split"),
        task_spec=spec if isinstance(spec, dict) else None,
        metadata=metadata,
        events=events_of(messages, session.call_results),
    )


def chat_conversation(conversation: list[dict[str, Any]]) -> list[Message]:
    """The SDK's OpenAI-format conversation as chat-template messages: text content (images
    are not passed to a text model), tool-call arguments as objects, tool messages named."""
    names: dict[str, str] = {}
    messages: list[Message] = []
    for entry in conversation:
        message: Message = {"role": entry["role"], "content": _openai_text(entry.get("content"))}
        if entry.get("reasoning_content"):
            message["reasoning_content"] = entry["reasoning_content"]
        calls = []
        for call in entry.get("tool_calls") or []:
            function = call.get("function") or {}
            names[call.get("id", "")] = function.get("name", "")
            calls.append({"id": call.get("id", ""), "type": "function", "function": {"name": function.get("name", ""), "arguments": _decoded(function.get("arguments"))}})
        if calls:
            message["tool_calls"] = calls
        if entry["role"] == "tool":
            message["tool_call_id"] = entry.get("tool_call_id", "")
            if message["tool_call_id"] in names:
                message["name"] = names[message["tool_call_id"]]
        messages.append(message)
    return messages


def with_system_prompt(messages: list[Message], system_prompt: str) -> list[Message]:
    """`system_prompt` as the system message, folded with the environment's own leading one
    (chat templates take one system message, first)."""
    if not system_prompt:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{system_prompt}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": system_prompt}, *messages]


def _openai_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") if part.get("type") == "text" else "[image omitted]" for part in content if isinstance(part, dict))
    return content_text(content)


def _decoded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments or {}


def _unsent(exc: BaseException) -> bool:
    """The call never reached the server: its connection was refused or did not open."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def _within(budget: Any, deadline: float) -> Any:
    """`budget` with its timeout cut to what is left before `deadline` (loop time)."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise EnvError("openreward: verification deadline passed")
    return type(budget)(timeout_s=min(budget.timeout_s, left), retries=budget.retries, backoff_s=budget.backoff_s)


def _resumable_only_supported() -> bool:
    """Whether the installed SDK has everything `call_tool_once` uses (else: `call_tool`)."""
    try:
        from openreward.api._session.http import _RemoteSSEError, resumable_sse  # noqa: F401
        from openreward.api._session.ping import ErrorResponse  # noqa: F401
        from openreward.api.environments import client as sdk_client
        from openreward.api.environments.types import ToolOutput  # noqa: F401
    except ImportError:
        return False
    has_helpers = all(hasattr(sdk_client, name) for name in ("_parse_blocks", "_infer_invalid_reason"))
    return has_helpers and "resumable_only" in inspect.signature(resumable_sse).parameters


_RESUMABLE_ONLY = None


async def call_tool_once(session: Any, name: str, arguments: dict[str, Any]) -> Any:
    """`session.call_tool(name, arguments)`, except that the SDK must not re-POST a call whose
    stream broke before the server named its task (that could run the tool twice).

    The SDK has the switch (`resumable_sse(..., resumable_only=True)`, meant for `/call`) but
    its `call_tool` does not pass it yet; this is `AsyncSession.call_tool` with it passed. A
    session of an SDK without it (or whose internals differ) uses `call_tool` as it is.
    """
    global _RESUMABLE_ONLY
    if _RESUMABLE_ONLY is None:
        _RESUMABLE_ONLY = _resumable_only_supported()
    needed = ("_run_or_die", "_env_path", "_mark_dead", "client", "sid", "deployment", "api_key")
    if not _RESUMABLE_ONLY or not all(hasattr(session, attr) for attr in needed):
        return await session.call_tool(name, arguments)
    from openreward.api._session.http import _RemoteSSEError, resumable_sse
    from openreward.api._session.ping import ErrorResponse
    from openreward.api.environments import client as sdk_client
    from openreward.api.environments.types import ToolOutput
    from openreward.api.errors import ToolCallError, ToolFailed

    try:
        res = await session._run_or_die(
            resumable_sse(
                session.client,
                session._env_path("/call"),
                sid=session.sid,
                deployment=session.deployment,
                token=session.api_key,
                json={"name": name, "input": arguments},
                max_retries=5,
                resumable_only=True,
            )
        )
    except _RemoteSSEError as exc:  # the tool raised server-side: the SDK marks the session dead
        session._mark_dead(ErrorResponse(type="error", message=str(exc)))
        raise ToolFailed(str(exc)) from exc
    if res["ok"]:
        output = res["output"]
        return ToolOutput(
            blocks=sdk_client._parse_blocks(output["blocks"]),
            metadata=output.get("metadata"),
            reward=output.get("reward"),
            finished=output.get("finished", False),  # as sent: checked by the session (_checked)
        )
    reason = res.get("reason")
    if reason not in getattr(sdk_client, "_VALID_REASONS", ()):
        reason = sdk_client._infer_invalid_reason(res["error"])
    raise ToolCallError(reason=reason, detail=res["error"])
