"""`nemo_gym`: a NeMo Gym resources server over HTTP (docs/environments.md, "nemo_gym").

The task's metadata is the NeMo Gym data row (`responses_create_params` plus fields
such as `question`, `expected_answer`). Per episode:

1. The prompt: `responses_create_params` as chat messages (`convert.prompt_messages`:
   `instructions` as the system message; history items of `input` (`function_call`,
   `function_call_output`, `reasoning`) as assistant tool calls and tool messages). A row
   NeMo Gym would refuse (`convert.input_problems`, e.g. `tool_choice: null`) fails the
   episode at start, before any token is generated.
2. `POST /seed_session` with the row, in a fresh cookie jar: the server keeps the
   session's state under a signed cookie, so the jar lives exactly as long as the episode.
3. Each tool call: `POST /{tool}` with the JSON arguments, sent at most once
   (`base.call_once`): only a connection that never opened is tried again. The answer
   text is the observation; a 4xx (e.g. 422 for bad arguments), a 5xx, a timeout or a
   connection lost after sending become the observation too (as NeMo Gym's simple_agent
   passes a tool's error body to the model), never a second call. Only tools listed in
   the row's `responses_create_params.tools` are called (a model cannot reach `/verify`
   or `/seed_session` as a "tool").
4. `POST /verify` with the row (its `input` history included), `responses_create_params`
   and a Responses `response` built from the episode, reasoning split out as NeMo Gym's
   reasoning parser does. `reward` and the server's extra fields (numbers and short
   strings kept, the rest capped) become the reward and its components. An answer with
   `mask_sample: true` (e.g. the judge was unreachable: `failure_kind: judge_failed`)
   is not a measurement: the episode fails (`EnvError` naming the failure kind) and gets
   no loss, instead of training a zero.

`/seed_session` and `/verify` are idempotent in NeMo Gym's contract (a seed under the
same cookie returns the same session; verify reads the body and the session), so they
are retried within the call budgets on transient failures (unreachable, 5xx, timeout);
when those are spent the episode fails with `EnvError`. A retried seed whose first
answer was lost opens a fresh session (the first one had no cookie to reach it by).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Union

import aiohttp

from pipeline.config import CallBudget, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.answers import MalformedAnswer, json_answer
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
from workers.envs.convert import (
    chat_tool,
    input_problems,
    prompt_messages,
    responses_object,
    responses_output,
    tool_name,
)
from workers.envs.local import initial_messages
from workers.envs.options import Options, parse_options
from workers.envs.rewards import MAX_COMPONENT_CHARS, TransientError, call_with_budget, capped, deadline_in, shaped

_RESERVED = {"seed_session", "verify", "close_session", "aggregate_metrics", "reverify_mode", "mcp"}
# /verify answer fields that are not components: the request echoed back, the reward,
# and NeMo Gym's failure routing (read separately).
_NOT_COMPONENTS = {"reward", "mask_sample", "instance_config"}
MAX_COMPONENTS = 32


class NemoGymOptions(Options, frozen=True):
    url: str  # the resources server, e.g. http://127.0.0.1:8000
    model: str = "policy"  # `model` of the Responses object sent to /verify
    max_connections: int = 256


class NemoGymEnvironment(Environment):
    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, NemoGymOptions)
        self._connector: Union[aiohttp.TCPConnector, None] = None

    def connector(self) -> aiohttp.TCPConnector:
        # Created on first use: a connector binds to the running event loop.
        if self._connector is None or self._connector.closed:
            self._connector = aiohttp.TCPConnector(limit=self.options.max_connections)
        return self._connector

    async def start(self, task: Task) -> EnvSession:
        row = task.metadata
        params = row.get("responses_create_params")
        if not isinstance(params, dict):
            raise EnvError(f"nemo_gym env {self.name!r}: task {task.id!r} has no metadata.responses_create_params")
        problems = input_problems(params)
        if problems:
            listed = "; ".join(f"{where}: {reason}" for where, reason in problems[:5])
            raise EnvError(f"nemo_gym env {self.name!r}: task {task.id!r}: metadata.{listed}")
        session = NemoGymSession(self, task, row, params)
        return await opened(session, session.seed)

    async def aclose(self) -> None:
        if self._connector is not None:
            await self._connector.close()


class NemoGymSession(EnvSession):
    def __init__(self, env: NemoGymEnvironment, task: Task, row: dict[str, Any], params: dict[str, Any]):
        self.env = env
        self.task = task
        self.row = row
        self.params = params
        self.messages = prompt_messages(params) or initial_messages(task)
        self.tools = [chat_tool(t) for t in params.get("tools") or [] if t.get("type", "function") == "function"]
        self.tool_names = {tool_name(t) for t in self.tools} - _RESERVED
        # One jar per episode; unsafe=True so cookies of IP-address hosts (127.0.0.1) are kept.
        self.http = aiohttp.ClientSession(
            base_url=env.options.url,
            connector=env.connector(),
            connector_owner=False,
            cookie_jar=aiohttp.CookieJar(unsafe=True),
        )

    async def _post(self, path: str, body: Any, budget: CallBudget, deadline: Union[float, None] = None) -> tuple[int, str]:
        async def attempt() -> tuple[int, str]:
            async with self.http.post(path, json=body) as response:
                text = await response.text()
                if response.status >= 500:
                    raise TransientError(f"HTTP {response.status}: {text[:200]}")
                return response.status, text

        return await call_with_budget(attempt, budget, f"nemo_gym {self.env.name!r} POST {path}", deadline=deadline)

    async def seed(self) -> None:
        status, text = await self._post("/seed_session", self.row, self.env.config.timeouts.start)
        if status >= 300:
            raise EnvError(f"nemo_gym {self.env.name!r} /seed_session: HTTP {status}: {text[:300]}")

    async def step(self, calls: list[ToolCall]) -> StepResult:
        return StepResult(messages=[await self._call(call) for call in calls])

    async def _call(self, call: ToolCall) -> Message:
        if call.name not in self.tool_names:
            output = f"error: no tool named {call.name!r}; tools: {', '.join(sorted(self.tool_names)) or 'none'}"
        else:
            output = await self._tool(call)
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": output}

    async def _tool(self, call: ToolCall) -> str:
        """One tool call, sent at most once; whatever comes back is the model's observation."""
        budget = self.env.config.timeouts.step
        # A connect timeout of its own, shorter than the call's: it proves nothing was sent.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=max(budget.timeout_s / 2, 0.001))

        async def attempt() -> tuple[int, str]:
            async with self.http.post(f"/{call.name}", json=call.arguments, timeout=timeout) as response:
                return response.status, await response.text()

        what = f"nemo_gym {self.env.name!r} POST /{call.name}"
        try:
            status, text = await call_once(attempt, budget, what, unsent=_unsent)
        except asyncio.TimeoutError:
            return f"error: {call.name} timed out after {budget.timeout_s:g}s (not sent again: it may have run)"
        except aiohttp.ClientError as exc:
            return f"error: the answer of {call.name} was lost ({type(exc).__name__}; not sent again: it may have run)"
        return text if status < 300 else f"error: HTTP {status}: {text[:1000]}"

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        output = responses_output(episode.messages[len(self.messages) :])
        body = {
            **self.row,
            "responses_create_params": self.params,
            "response": responses_object(output, self.params, self.env.options.model),
        }
        status, text = await self._post("/verify", body, timeouts.verify, deadline_in(timeouts.verify_deadline_s))
        what = f"nemo_gym {self.env.name!r} /verify"
        if status >= 300:
            raise EnvError(f"{what}: HTTP {status}: {text[:300]}")
        answer = json_answer(text, what)
        try:
            reward = float(answer["reward"])
        except (ValueError, TypeError, KeyError) as exc:  # the server's answer, not our code: a fault
            raise MalformedAnswer(f"{what}: no numeric reward in the answer: {text[:300]}") from exc
        if _masked(answer):
            kind = answer.get("failure_kind") or "unspecified"
            reason = str(answer.get("failure_reason") or "")[:300]
            raise EnvError(f"nemo_gym {self.env.name!r} /verify: sample masked, failure_kind={kind}: {reason}")
        components = verify_components(answer, body)
        return shaped(self.env.config, [reward], terminal=episode.status == Status.COMPLETED, components=components)

    async def close(self) -> None:
        await self.http.close()


def _unsent(exc: BaseException) -> bool:
    """The request never left: the connection was refused or did not open in time."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def _masked(answer: dict[str, Any]) -> bool:
    """NeMo Gym's "this reward is no measurement" flag (top level; older servers put it
    in `instance_config`)."""
    legacy = answer.get("instance_config")
    return bool(answer.get("mask_sample")) or (isinstance(legacy, dict) and bool(legacy.get("mask_sample")))


def verify_components(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The /verify answer's own fields, small: numbers, booleans and short strings as they
    are; longer strings and structures capped at MAX_COMPONENT_CHARS (structures as JSON
    text); at most MAX_COMPONENTS fields. The request echoed back and NeMo Gym's private
    `_ng_*` fields are left out."""
    components: dict[str, Any] = {}
    for key, value in answer.items():
        if key in body or key in _NOT_COMPONENTS or key.startswith("_ng_"):
            continue
        if len(components) >= MAX_COMPONENTS:
            components["components_dropped"] = len(answer) - len(components)
            break
        components[key] = _small(value)
    return components


def _small(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return capped(value)
    text = json.dumps(value, default=str, separators=(",", ":"))
    return value if len(text) <= MAX_COMPONENT_CHARS else capped(text)
