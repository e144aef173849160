"""Conversions between the OpenAI Responses shapes (NeMo Gym rows, OpenReward tool lists)
and the chat-template shapes the episode runner works in (base.py `Message`)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from workers.envs.base import Message


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (`{"type": "function", "name", "parameters", ...}`) as the
    chat templates take it (`{"type": "function", "function": {...}}`); chat-shaped ones pass."""
    if "function" in tool:
        return tool
    function = {"name": tool["name"], "description": tool.get("description") or ""}
    function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def tool_name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"] if "function" in tool else tool["name"]


def content_text(content: Any) -> str:
    """Text of a message content: a string, or a list of text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def chat_messages(responses_input: Any) -> list[Message]:
    """A Responses `input` (string or message items) as chat messages; `developer` -> `system`."""
    if isinstance(responses_input, str):
        return [{"role": "user", "content": responses_input}]
    messages: list[Message] = []
    for item in responses_input or []:
        if item.get("type", "message") != "message" or "role" not in item:
            continue
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": content_text(item.get("content"))})
    return messages


def responses_output(messages: list[Message]) -> list[dict[str, Any]]:
    """The episode's turns (after the prompt) as Responses output items.

    Assistant text -> `message`, each tool call -> `function_call`, each tool reply ->
    `function_call_output`. Tool-call ids are made unique per turn (parsers number them
    from 0 in every turn), so every output pairs with its call.
    """
    items: list[dict[str, Any]] = []
    ids: dict[str, str] = {}
    for turn, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            ids = {}
            text = content_text(message.get("content"))
            calls = message.get("tool_calls") or []
            if text or not calls:
                items.append(_output_message(text))
            for call in calls:
                ids[call.get("id", "")] = call_id = f"call_{turn}_{call.get('id', len(ids))}"
                items.append(_function_call(call, call_id))
        elif role == "tool" and message.get("tool_call_id") in ids:
            items.append(
                {"type": "function_call_output", "call_id": ids[message["tool_call_id"]], "output": content_text(message.get("content"))}
            )
    return items


def _output_message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex[:16]}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _function_call(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex[:16]}",
        "call_id": call_id,
        "name": function["name"],
        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        "status": "completed",
    }


def responses_object(output: list[dict[str, Any]], params: dict[str, Any], model: str) -> dict[str, Any]:
    """A complete Responses API `response` object around `output`."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "completed",
        "output": output,
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "tool_choice": params.get("tool_choice", "auto"),
        "tools": params.get("tools", []),
    }
