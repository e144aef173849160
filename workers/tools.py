"""Tool-call parsers: the model's text of one turn -> tool calls (+ what was malformed).

A parser is any callable `(text: str) -> ParsedTurn`. Built-in: "hermes" (alias
"qwen"), the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format of
Hermes and Qwen2.5/3 chat templates. `get_parser` also takes a dotted path
`package.module:function` (or `package.module.function`) to plug in another format.

Malformed calls are not exceptions: they come back in `ParsedTurn.errors` so the
episode runner can feed them to the model as an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from workers.envs.base import ToolCall
from workers.plugins import import_dotted


@dataclass
class ParsedTurn:
    content: str  # the text outside tool calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed call

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.errors)


ToolParser = Callable[[str], ParsedTurn]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Parse `<tool_call>{json}</tool_call>` blocks; an unclosed last block is malformed."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn(content=text[:start].strip())
    for index, match in enumerate(_HERMES_BLOCK.finditer(text, start)):
        if not match.group(0).endswith("</tool_call>"):
            turn.errors.append(f"tool call {index}: missing </tool_call>")
            continue
        call, error = _hermes_call(match.group(1), index)
        if call is not None:
            turn.calls.append(call)
        else:
            turn.errors.append(error)
    return turn


def _hermes_call(body: str, index: int) -> tuple[ToolCall | None, str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call {index}: invalid JSON ({exc.msg} at char {exc.pos})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None, f'tool call {index}: expected {{"name": <string>, "arguments": <object>}}'
    arguments: Any = data.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, f"tool call {index} ({data['name']}): 'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return None, f"tool call {index} ({data['name']}): 'arguments' must be an object"
    return ToolCall(id=f"call_{index}", name=data["name"], arguments=arguments), ""


PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "qwen": parse_hermes}


def get_parser(name: str) -> ToolParser:
    """A registered parser name, or a dotted path `module:function` / `module.function`."""
    if name in PARSERS:
        return PARSERS[name]
    try:
        parser = import_dotted(name)
    except ValueError as exc:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"tool parser {name!r} (registered: {known}): {exc}") from exc
    if not callable(parser):
        raise ValueError(f"tool parser {name!r} is not callable")
    return parser
