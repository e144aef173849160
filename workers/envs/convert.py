"""Conversions between the OpenAI Responses shapes (NeMo Gym rows, OpenReward tool lists)
and the chat-template shapes the episode runner works in (base.py `Message`).

Prompt side (`prompt_messages`): a row's `responses_create_params` as chat messages, the
way NeMo Gym's own model servers down-convert a Responses request
(`nemo_gym.responses_converter.ResponsesConverter`): `instructions` become the leading
system message (folded with any leading system/developer messages), `reasoning`,
assistant `message` and `function_call` items that follow each other become one assistant
message (`reasoning_content`, `content`, `tool_calls`), and `function_call_output` items
become tool messages.

Episode side (`responses_output`): the model's turns as Responses output items, split the
way NeMo Gym's reasoning parser splits them (`<think>...</think>` -> a `reasoning` item
before the message; the final answer's `output_text` never holds think tags).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Union

from workers.envs.base import Message

# Item types a NeMo Gym row's `input` may hold that the prompt can render.
INPUT_ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK_PAIR = re.compile(r"<think>(.*?)</think>", re.DOTALL)


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


# ------------------------------------------------------------------ reasoning


def split_reasoning(text: str) -> tuple[list[str], str]:
    """(reasoning parts, answer text) of one assistant turn.

    NeMo Gym's parser (`ResponsesConverter._parse_think_tags`) takes every
    `<think>...</think>` pair out of the content. Two more shapes come from templates that
    open the think block in the generation prompt, which vLLM's reasoning parsers (and
    SGLang's) read as reasoning too: a leading `...</think>` with no `<think>` before it,
    and an unclosed `<think>...` at the end (the turn was cut off while thinking). Stray
    tags beyond those stay in the answer, as they do in NeMo Gym (code_gen penalises them).
    """
    if THINK_CLOSE not in text and THINK_OPEN not in text:
        return [], text.strip()
    reasoning: list[str] = []
    head, sep, tail = text.partition(THINK_CLOSE)
    if sep and THINK_OPEN not in head:
        reasoning.append(head)
        text = tail
    reasoning += _THINK_PAIR.findall(text)
    text = _THINK_PAIR.sub("", text)
    unclosed = text.find(THINK_OPEN)
    if unclosed >= 0 and THINK_CLOSE not in text[unclosed:]:
        reasoning.append(text[unclosed + len(THINK_OPEN) :])
        text = text[:unclosed]
    return [part.strip() for part in reasoning if part.strip()], text.strip()


# ------------------------------------------------------------------ prompt side


def prompt_messages(params: dict[str, Any]) -> list[Message]:
    """`responses_create_params` (`instructions` and `input`) as chat messages for the template.

    `developer` becomes `system` (chat templates know no developer role). Tool-call ids of
    the history are kept, so each tool message pairs with its call.
    """
    messages = chat_messages(params.get("input"))
    instructions = params.get("instructions")
    if isinstance(instructions, str) and instructions:
        parts = [instructions]
        while messages and messages[0]["role"] == "system":
            parts.append(content_text(messages.pop(0)["content"]))
        messages.insert(0, {"role": "system", "content": "\n\n".join(parts)})
    return messages


def chat_messages(responses_input: Any) -> list[Message]:
    """A Responses `input` (a string, or items) as chat messages (see `prompt_messages`)."""
    if isinstance(responses_input, str):
        return [{"role": "user", "content": responses_input}]
    messages: list[Message] = []
    assistant: Union[Message, None] = None  # the assistant turn being gathered
    names: dict[str, str] = {}  # call_id -> tool name, for the tool messages

    def gather() -> Message:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            messages.append(assistant)
        return assistant

    for item in responses_input or []:
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "assistant":
                turn = gather()
                turn["content"] += content_text(item.get("content"))
                continue
            assistant = None
            messages.append({"role": role, "content": content_text(item.get("content"))})
        elif kind == "reasoning":
            if assistant is not None and (assistant["content"] or assistant.get("tool_calls")):
                assistant = None  # reasoning opens the next assistant turn
            turn = gather()
            text = "\n".join(s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict))
            if text:
                turn["reasoning_content"] = "\n".join(filter(None, [turn.get("reasoning_content"), text]))
        elif kind == "function_call":
            turn = gather()
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": _arguments(item.get("arguments"))}}
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            assistant = None
            call_id = item["call_id"]
            message = {"role": "tool", "tool_call_id": call_id, "content": content_text(item.get("output"))}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
    return messages


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as the runner keeps them (an object), when the string is JSON."""
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return arguments
        return decoded if isinstance(decoded, dict) else arguments
    return arguments if arguments is not None else {}


def input_problems(params: Any) -> list[tuple[str, str]]:
    """What NeMo Gym (or the prompt rendering) would refuse in `responses_create_params`:
    `(field path, reason)` pairs; empty when the row is fine.

    Checked before an episode runs, because /verify validates the same object only after
    a whole episode: `input` items of the types above with their required fields;
    `instructions` a string; `tools` function tools with a name; `tool_choice` and
    `parallel_tool_calls`, when present, not null (NeMo Gym's Responses object requires
    both; leave them out for the defaults `auto` / `true`).
    """
    where = "responses_create_params"
    if not isinstance(params, dict):
        return [(where, f"must be an object, got {type(params).__name__}")]
    problems: list[tuple[str, str]] = []
    items = params.get("input")
    if items is None:
        problems.append((f"{where}.input", "missing"))
    elif isinstance(items, str):
        if not items.strip():
            problems.append((f"{where}.input", "is empty"))
    elif not isinstance(items, list) or not items:
        problems.append((f"{where}.input", "must be a string or a non-empty list of items"))
    else:
        calls: set[str] = set()
        for i, item in enumerate(items):
            problems += [(f"{where}.input[{i}]{p}", r) for p, r in _item_problems(item, calls)]
    if "instructions" in params and params["instructions"] is not None and not isinstance(params["instructions"], str):
        problems.append((f"{where}.instructions", "must be a string"))
    for key, expected in (("tool_choice", "'auto', 'none', 'required' or a tool object"), ("parallel_tool_calls", "true or false")):
        if key in params and params[key] is None:
            problems.append((f"{where}.{key}", f"is null: give {expected}, or leave the key out"))
    if "parallel_tool_calls" in params and params["parallel_tool_calls"] is not None and not isinstance(params["parallel_tool_calls"], bool):
        problems.append((f"{where}.parallel_tool_calls", "must be true or false"))
    tools = params.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            problems.append((f"{where}.tools", "must be a list"))
        else:
            for i, tool in enumerate(tools):
                if not isinstance(tool, dict):
                    problems.append((f"{where}.tools[{i}]", "must be an object"))
                elif tool.get("type", "function") == "function" and not isinstance(
                    tool.get("name") or (tool.get("function") or {}).get("name"), str
                ):
                    problems.append((f"{where}.tools[{i}].name", "missing"))
    return problems


def _item_problems(item: Any, calls: set[str]) -> list[tuple[str, str]]:
    if not isinstance(item, dict):
        return [("", "must be an object")]
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind not in INPUT_ITEM_TYPES:
        return [(".type", f"{kind!r} is not supported (supported: {', '.join(INPUT_ITEM_TYPES)})")]
    if kind == "message":
        if item.get("role") not in MESSAGE_ROLES:
            return [(".role", f"{item.get('role')!r} is not one of {', '.join(MESSAGE_ROLES)}")]
        content = item.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return [(".content", "must be a string or a list of text parts")]
        return []
    if kind == "reasoning":
        summary = item.get("summary", [])
        if not isinstance(summary, list) or not all(isinstance(s, dict) and isinstance(s.get("text"), str) for s in summary):
            return [(".summary", "must be a list of {type: summary_text, text}")]
        return []
    problems = [(f".{key}", "missing or not a string") for key in ("call_id",) if not isinstance(item.get(key), str)]
    if kind == "function_call":
        if not isinstance(item.get("name"), str):
            problems.append((".name", "missing or not a string"))
        if not isinstance(item.get("arguments"), str):
            problems.append((".arguments", "must be a JSON string"))
        if isinstance(item.get("call_id"), str):
            calls.add(item["call_id"])
    else:
        if not isinstance(item.get("output"), (str, list)):
            problems.append((".output", "must be a string or a list of input_text parts"))
        if isinstance(item.get("call_id"), str) and item["call_id"] not in calls:
            problems.append((".call_id", f"{item['call_id']!r} has no function_call before it"))
    return problems


# ------------------------------------------------------------------ episode side


def responses_output(messages: list[Message]) -> list[dict[str, Any]]:
    """The episode's turns (after the prompt) as Responses output items.

    Per assistant turn, as NeMo Gym's model servers emit them: a `reasoning` item (the
    turn's think text, or its `reasoning_content`), a `message` with the answer text (when
    there is any, or when the turn has nothing else), a `function_call` per tool call; each
    tool reply -> `function_call_output`. Tool-call ids are made unique per turn (parsers
    number them from 0 in every turn), so every output pairs with its call.
    """
    items: list[dict[str, Any]] = []
    ids: dict[str, str] = {}
    for turn, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            ids = {}
            reasoning, text = split_reasoning(content_text(message.get("content")))
            if message.get("reasoning_content"):
                reasoning.insert(0, str(message["reasoning_content"]))
            calls = message.get("tool_calls") or []
            if reasoning:
                items.append(_reasoning_item(reasoning))
            if text or not (calls or reasoning):
                items.append(_output_message(text))
            for call in calls:
                ids[call.get("id", "")] = call_id = f"call_{turn}_{call.get('id', len(ids))}"
                items.append(_function_call(call, call_id))
        elif role == "tool" and message.get("tool_call_id") in ids:
            items.append(
                {"type": "function_call_output", "call_id": ids[message["tool_call_id"]], "output": content_text(message.get("content"))}
            )
    return items


def _reasoning_item(parts: list[str]) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex[:16]}",
        "summary": [{"type": "summary_text", "text": part} for part in parts],
        "status": "completed",
    }


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
    tool_choice = params.get("tool_choice")
    parallel = params.get("parallel_tool_calls")
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True if parallel is None else parallel,
        "tool_choice": "auto" if tool_choice is None else tool_choice,
        "tools": params.get("tools") or [],
    }
