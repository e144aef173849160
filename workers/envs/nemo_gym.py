"""`nemo_gym`: a NeMo Gym resources server over HTTP (PROTOCOLS.md "NeMo Gym").

The task's metadata is the NeMo Gym data row (`responses_create_params` plus fields
such as `question`, `expected_answer`). Per episode:

1. `POST /seed_session` with the row, in a fresh cookie jar: the server keeps the
   session's state in a signed cookie, so the jar lives exactly as long as the episode.
2. Each tool call: `POST /{tool}` with the JSON arguments; the answer text is the
   observation. Only tools listed in the row's `responses_create_params.tools` are
   called (so a model cannot reach `/verify` or `/seed_session` as a "tool"). A 4xx
   (e.g. 422 for bad arguments) is the model's mistake: it becomes the observation.
3. `POST /verify` with the row, `responses_create_params` and a Responses API
   `response` built from the episode; `reward` and the server's extra fields become
   the reward and its components.

Transient failures (unreachable, 5xx, timeout) are retried within the environment's
call budgets; when those are spent the episode fails with `EnvError`.
"""

from __future__ import annotations

import json
from typing import Any, Union

import aiohttp

from pipeline.config import CallBudget, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import (
    Environment, EnvError, EnvSession, EpisodeRecord, Message, StepResult, ToolCall, Verification, opened,
)
from workers.envs.convert import chat_messages, chat_tool, responses_object, responses_output, tool_name
from workers.envs.local import initial_messages
from workers.envs.options import Options, parse_options
from workers.envs.rewards import TransientError, call_with_budget, deadline_in, shaped

_RESERVED = {"seed_session", "verify", "close_session", "aggregate_metrics"}


class NemoGymOptions(Options):
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
        self.messages = chat_messages(params.get("input")) or initial_messages(task)
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
            status, text = await self._post(f"/{call.name}", call.arguments, self.env.config.timeouts.step)
            output = text if status < 300 else f"error: HTTP {status}: {text[:1000]}"
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": output}

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        output = responses_output(episode.messages[len(self.messages) :])
        body = {
            **self.row,
            "responses_create_params": self.params,
            "response": responses_object(output, self.params, self.env.options.model),
        }
        status, text = await self._post("/verify", body, timeouts.verify, deadline_in(timeouts.verify_deadline_s))
        try:
            answer = json.loads(text) if status < 300 else None
            reward = float(answer["reward"])
        except (ValueError, TypeError, KeyError) as exc:
            raise EnvError(f"nemo_gym {self.env.name!r} /verify: HTTP {status}: {text[:300]}") from exc
        extras = {k: v for k, v in answer.items() if k not in body and k != "reward"}
        return shaped(self.env.config, [reward], terminal=episode.status == Status.COMPLETED, components=extras)

    async def close(self) -> None:
        await self.http.close()
