"""Base of sessions without tools (answer checkers): the task's prompt, no tools, and a
tool call answered with an error observation so the model can still give its answer."""

from __future__ import annotations

from typing import Any

from pipeline.schema import Task
from workers.envs.base import EnvSession, StepResult, ToolCall
from workers.envs.local import initial_messages


class ToollessSession(EnvSession):
    def __init__(self, task: Task):
        self.task = task
        self.messages = initial_messages(task)
        self.tools: list[dict[str, Any]] = []

    async def step(self, calls: list[ToolCall]) -> StepResult:
        return StepResult(
            messages=[
                {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": f"error: no tool named {c.name!r}"}
                for c in calls
            ]
        )
