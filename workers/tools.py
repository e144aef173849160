"""Tool-call parsers: the model's text of one turn -> tool calls (+ what was malformed).

A parser is any callable `(text: str) -> ParsedTurn`; an environment picks one with
`options.tool_parser` (default "hermes"). Built-in formats (names as in `PARSERS`; the
aliases are SGLang's `--tool-call-parser` names):

  hermes (qwen, qwen25)      <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  qwen3_coder                <tool_call><function=f><parameter=x>...</parameter></function></tool_call>
  llama3_json (llama3)       [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
  mistral                    [TOOL_CALLS] [{"name": ..., "arguments": {...}}]  and
                             [TOOL_CALLS]f[ARGS]{...}  ([CALL_ID]id before [ARGS] accepted)
  deepseek_v3 (deepseekv3)   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
                             ```json {...} ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  deepseek_v31 (deepseekv31) the same section, each call  <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
  glm45 (glm4_moe)           <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>
  kimi_k2                    <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                             <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>
  gpt_oss (gpt-oss, harmony) <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json
                             <|message|>{...}<|call|>

`get_parser` also takes a dotted path `package.module:function` (or
`package.module.function`) to plug in another format.

Every built-in parser returns the same shape: `content` is the turn's text with the call
markup cut out (text before, between and after calls), `calls` carry an id unique in
the turn (`call_<i>`; Kimi-K2's own `functions.f:<i>`; for Mistral the model's id, else a
9-character one, which Mistral's templates require) and the arguments decoded from JSON
(an object), and each malformed call is one line in `errors`, never an exception, so the
episode runner can answer it with an error observation. Reasoning (`<think>...</think>`,
also a leading `...</think>` whose `<think>` was in the prompt, and harmony's analysis
channel) is never searched for calls.

The XML-style formats (qwen3_coder, glm45) carry argument values as text. Built-in parsers
take an optional `tools=` (the session's OpenAI tool schemas) to type them by the schema;
without it qwen3_coder keeps every value a string and glm45 decodes values that are JSON
(as SGLang does).

The markers of several formats (`<|python_tag|>`, `[TOOL_CALLS]`, Kimi's and harmony's
`<|...|>` tokens) are special tokens for their tokenizers: the text given to the parser
must be decoded with special tokens kept. End-of-turn tokens at the end of the text are
dropped from `content`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

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
Tools = Union[Sequence[dict[str, Any]], None]

DEFAULT_PARSER = "hermes"

# ------------------------------------------------------------------ shared pieces

_END_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>",
    "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>", "<|end|>", "<|user|>", "<|observation|>",
)
_MASK = "\x00"  # stands in for reasoning text while searching for markers (keeps indices)


def _mask_reasoning(text: str) -> str:
    """`text` with `<think>...</think>` (and a leading `...</think>`, and an unclosed
    `<think>...`) overwritten by _MASK, so no marker inside reasoning is found."""
    if "think>" not in text:
        return text
    chars = list(text)
    first_open, first_close = text.find("<think>"), text.find("</think>")
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        # the prompt ended with "<think>": everything up to the first "</think>" is reasoning
        chars[: first_close + len("</think>")] = _MASK * (first_close + len("</think>"))
        start = first_close + len("</think>")
    else:
        start = 0
    for match in re.finditer(r"<think>.*?(?:</think>|$)", text[start:], re.DOTALL):
        a, b = start + match.start(), start + match.end()
        chars[a:b] = _MASK * (b - a)
    return "".join(chars)


def _strip_end(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for token in _END_TOKENS:
            if text.endswith(token):
                text = text[: -len(token)].rstrip()
                changed = True
    return text


def _content(text: str, cuts: Iterable[tuple[int, int]]) -> str:
    """`text` without the spans in `cuts` (call markup), trimmed, end-of-turn tokens dropped."""
    parts, pos = [], 0
    for a, b in sorted(cuts):
        if a > pos:
            parts.append(text[pos:a].strip())
        pos = max(pos, b)
    parts.append(text[pos:].strip())
    return _strip_end("\n\n".join(p for p in parts if p))


_NAME = re.compile(r"[^\s<>{}\[\]\"'`]+")


def _json_args(raw: Any, where: str) -> tuple[Union[dict[str, Any], None], str]:
    """Decoded arguments (an object) or an error line. `raw` is JSON text or already decoded."""
    value = raw
    if isinstance(raw, str):
        if not raw.strip():
            return {}, ""
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            return None, f"{where}: invalid JSON arguments ({exc.msg} at char {exc.pos})"
    if isinstance(value, str):  # some models emit the arguments as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, f"{where}: the arguments are a string that is not JSON"
    if value is None:
        return {}, ""
    if not isinstance(value, dict):
        return None, f"{where}: the arguments must be a JSON object, got {type(value).__name__}"
    return value, ""


class _Builder:
    """Collects calls and errors of one turn; numbers calls and keeps their ids unique."""

    def __init__(self) -> None:
        self.turn = ParsedTurn(content="")
        self.index = 0  # calls attempted so far (valid or not)
        self.ids: set[str] = set()

    def where(self, name: str = "") -> str:
        return f"tool call {self.index}" + (f" ({name})" if name else "")

    def add(self, name: Any, arguments: Any, call_id: Any = None, id_format: str = "call_{}") -> None:
        where = self.where(name if isinstance(name, str) else "")
        if not isinstance(name, str) or not _NAME.fullmatch(name.strip()):
            self.error(f"{where}: missing or invalid function name {str(name)[:60]!r}")
            return
        args, error = _json_args(arguments, where)
        if args is None:
            self.error(error)
            return
        if not isinstance(call_id, str) or not call_id or call_id in self.ids:
            call_id = id_format.format(self.index)
        self.ids.add(call_id)
        self.turn.calls.append(ToolCall(id=call_id, name=name.strip(), arguments=args))
        self.index += 1

    def error(self, message: str) -> None:
        self.turn.errors.append(message)
        self.index += 1

    def done(self, text: str, cuts: Iterable[tuple[int, int]]) -> ParsedTurn:
        self.turn.content = _content(text, cuts)
        return self.turn


def _schema_types(tools: Tools, name: str) -> Union[dict[str, Any], None]:
    """{parameter: JSON schema type} of tool `name`, None when the schema is unknown."""
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters") or {}
            props = params.get("properties", {}) if isinstance(params, dict) else {}
            types: dict[str, Any] = {}
            for key, schema in props.items():
                kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
                if isinstance(kind, list):  # ["integer", "null"] -> "integer"
                    kind = next((k for k in kind if k != "null"), "string")
                types[key] = str(kind).lower()
            return types
    return None


def _typed(raw: str, kind: Union[str, None]) -> Any:
    """A text argument value converted to its schema type; left as text when it does not fit."""
    if kind is None or kind in ("string", "str", "text", "enum"):
        return raw
    text = raw.strip()
    if text.lower() == "null":
        return None
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return raw
    if kind in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return raw
        return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", text) else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.lower(), raw)
    try:  # object, array, anything else: JSON, then a Python literal ({'a': 1}, [1, 2])
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw


# ------------------------------------------------------------------ hermes / Qwen2.5 / Qwen3

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)  # hermes, Qwen3-Coder, GLM-4.5


def _tool_call_blocks(text: str, out: _Builder, cuts: list[tuple[int, int]]) -> Iterator[str]:
    """The bodies of `<tool_call>...</tool_call>` blocks outside reasoning; each block's span is
    cut from the content, and an unclosed block is an error, not a call."""
    for match in _TOOL_CALL_BLOCK.finditer(_mask_reasoning(text)):
        cuts.append(match.span())
        if not match.group(2):
            out.error(f"{out.where()}: missing </tool_call>")
            continue
        yield text[match.start(1) : match.end(1)]


def parse_hermes(text: str, tools: Tools = None) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks; an unclosed block is malformed."""
    out, cuts = _Builder(), list[tuple[int, int]]()
    for body in _tool_call_blocks(text, out, cuts):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            out.error(f"{out.where()}: invalid JSON ({exc.msg} at char {exc.pos})")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            out.error(f'{out.where()}: expected {{"name": <string>, "arguments": <object>}}')
            continue
        out.add(data["name"], data.get("arguments", data.get("parameters", {})))
    return out.done(text, cuts)


# ------------------------------------------------------------------ Qwen3-Coder XML

_QWEN3_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|(?=<function=)|$)", re.DOTALL)
_QWEN3_PARAMETER = re.compile(
    r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
)


def parse_qwen3_coder(text: str, tools: Tools = None) -> ParsedTurn:
    """`<tool_call><function=f><parameter=x>\\nvalue\\n</parameter></function></tool_call>`."""
    out, cuts = _Builder(), list[tuple[int, int]]()
    for body in _tool_call_blocks(text, out, cuts):
        functions = list(_QWEN3_FUNCTION.finditer(body))
        if not functions:
            out.error(f"{out.where()}: expected <function=name> inside <tool_call>")
            continue
        for function in functions:
            name = function.group(1).strip()
            types = _schema_types(tools, name)
            arguments: dict[str, Any] = {}
            for parameter in _QWEN3_PARAMETER.finditer(function.group(2)):
                value = parameter.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                key = parameter.group(1).strip()
                arguments[key] = _typed(value, None if types is None else types.get(key, "string"))
            out.add(name, arguments)
    return out.done(text, cuts)


# ------------------------------------------------------------------ Llama 3.x JSON

_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, tools: Tools = None) -> ParsedTurn:
    """`{"name": f, "parameters": {...}}` (or "arguments"), after `<|python_tag|>` or as the
    whole answer; several separated by `;` or in a JSON array. Without the tag, text that is
    not a call object is plain content."""
    masked = _mask_reasoning(text)
    out = _Builder()
    tag = masked.find(_PYTHON_TAG)
    if tag >= 0:
        start = tag + len(_PYTHON_TAG)
        cut_from = tag
    else:
        stripped = masked.lstrip(_MASK + " \t\r\n")
        start = len(masked) - len(stripped)
        if not re.match(r'\[?\s*\{\s*"name"\s*:', stripped):
            return out.done(text, [])
        cut_from = start
    body = _strip_end(text[start:])
    pos, decoder, objects = 0, json.JSONDecoder(), []
    while pos < len(body):
        while pos < len(body) and body[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(body) or body[pos] not in "{[":
            break
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            out.error(f"{out.where()}: invalid JSON ({exc.msg} at char {exc.pos})")
            pos = len(body)
            break
        objects += value if isinstance(value, list) else [value]
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.error(f'{out.where()}: expected {{"name": <string>, "parameters": <object>}}')
            continue
        out.add(obj["name"], obj.get("parameters", obj.get("arguments", {})))
    if not out.turn.wants_tools and tag >= 0:
        out.error(f"{out.where()}: {_PYTHON_TAG} not followed by a JSON call")
    trailing = body[pos:].strip()
    turn = out.done(text[:cut_from], [])
    turn.content = "\n\n".join(p for p in (turn.content, _strip_end(trailing)) if p)
    return turn


# ------------------------------------------------------------------ Mistral

_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_COMPACT = re.compile(r"\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9_\-]+)\s*)?\[ARGS\]\s*")


def parse_mistral(text: str, tools: Tools = None) -> ParsedTurn:
    """`[TOOL_CALLS] [{"name": f, "arguments": {...}, "id": ...}, ...]` (v0.3 style) and
    `[TOOL_CALLS]f[ARGS]{...}` (v11+ tokenizers; `[CALL_ID]id` before `[ARGS]` accepted),
    one marker per call."""
    masked = _mask_reasoning(text)
    out, cuts, decoder = _Builder(), [], json.JSONDecoder()
    pos = masked.find(_MISTRAL_CALLS)
    ids = "call{:05d}"  # 9 alphanumerics: what Mistral's templates require of a tool_call_id
    while pos >= 0:
        start, pos = pos, pos + len(_MISTRAL_CALLS)
        following = masked.find(_MISTRAL_CALLS, pos)
        limit = following if following >= 0 else len(masked)
        array = re.match(r"\s*\[", masked[pos:limit])
        compact = None if array else _MISTRAL_COMPACT.match(masked, pos, limit)
        try:
            if array:
                value, end = decoder.raw_decode(text, pos + array.end() - 1)
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, dict) and isinstance(item.get("name"), str):
                        out.add(item["name"], item.get("arguments", item.get("parameters", {})), item.get("id"), ids)
                    else:
                        out.error(f'{out.where()}: expected {{"name": <string>, "arguments": <object>}}')
            elif compact:
                value, end = decoder.raw_decode(text, compact.end())
                out.add(compact.group(1), value, compact.group(2), ids)
            else:
                out.error(f"{out.where()}: {_MISTRAL_CALLS} not followed by a call")
                end = limit
        except json.JSONDecodeError as exc:
            out.error(f"{out.where()}: invalid JSON ({exc.msg})")
            end = limit
        cuts.append((start, max(end, pos)))
        pos = masked.find(_MISTRAL_CALLS, max(end, pos))
    return out.done(text, cuts)


# ------------------------------------------------------------------ DeepSeek V3 / V3.1

_DS_SECTION = re.compile(r"<｜tool▁calls▁begin｜>(.*?)(?:<｜tool▁calls▁end｜>|$)", re.DOTALL)
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)(<｜tool▁call▁end｜>|(?=<｜tool▁call▁begin｜>)|$)", re.DOTALL)
_DS_SEP = "<｜tool▁sep｜>"
_DS_FENCE = re.compile(r"^([^\n]*)\n\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


def parse_deepseek(text: str, tools: Tools = None) -> ParsedTurn:
    """DeepSeek-V3 (`function<｜tool▁sep｜>f\\n```json\\n{...}\\n````) and V3.1
    (`f<｜tool▁sep｜>{...}`) calls, each in `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`
    inside `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`; both shapes are accepted."""
    masked = _mask_reasoning(text)
    out, cuts = _Builder(), []
    sections = [m.span() for m in _DS_SECTION.finditer(masked)]
    if not sections and "<｜tool▁call▁begin｜>" in masked:  # calls without the section markers
        sections = [(masked.find("<｜tool▁call▁begin｜>"), len(masked))]
    for start, end in sections:
        cuts.append((start, end))
        for call in _DS_CALL.finditer(masked, start, end):
            body = text[call.start(1) : call.end(1)]
            if not call.group(2):
                out.error(f"{out.where()}: missing <｜tool▁call▁end｜>")
                continue
            if _DS_SEP not in body:
                out.error(f"{out.where()}: missing <｜tool▁sep｜> between type/name and arguments")
                continue
            left, right = body.split(_DS_SEP, 1)
            fenced = _DS_FENCE.match(right.strip("\r "))
            if left.strip() == "function" and fenced:  # V3
                out.add(fenced.group(1).strip(), fenced.group(2))
            elif left.strip() == "function" and "```" in right:
                out.error(f"{out.where()}: expected the name, a newline and a ```json block")
            else:  # V3.1
                out.add(left.strip(), right.strip())
    return out.done(text, cuts)


# ------------------------------------------------------------------ GLM-4.5 / 4.6

_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm45(text: str, tools: Tools = None) -> ParsedTurn:
    """`<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>`."""
    out, cuts = _Builder(), list[tuple[int, int]]()
    for body in _tool_call_blocks(text, out, cuts):
        name_end = min((i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0), default=len(body))
        name, rest = body[:name_end].strip(), body[name_end:]
        pairs = _GLM_PAIR.findall(rest)
        if rest.count("<arg_key>") != len(pairs) or _GLM_PAIR.sub("", rest).strip():
            out.error(f"{out.where(name)}: expected <arg_key>k</arg_key><arg_value>v</arg_value> pairs")
            continue
        types = _schema_types(tools, name)
        arguments: dict[str, Any] = {}
        for key, value in pairs:
            key = key.strip()
            if types is not None:
                arguments[key] = _typed(value, types.get(key, "string"))
            else:
                try:  # GLM's template writes non-string values as JSON
                    arguments[key] = json.loads(value)
                except json.JSONDecodeError:
                    arguments[key] = value
        out.add(name, arguments)
    return out.done(text, cuts)


# ------------------------------------------------------------------ Kimi-K2

_KIMI_SECTION = re.compile(
    r"<\|tool_calls?_section_begin\|>(.*?)(?:<\|tool_calls?_section_end\|>|$)", re.DOTALL
)
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)(<\|tool_call_end\|>|(?=<\|tool_call_begin\|>)|$)", re.DOTALL)
_KIMI_ID = re.compile(r"^(?:functions\.)?([\w.\-]+):(\d+)$")


def parse_kimi_k2(text: str, tools: Tools = None) -> ParsedTurn:
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|>...<|tool_calls_section_end|>`; the call id is the model's `functions.f:0`."""
    masked = _mask_reasoning(text)
    out, cuts = _Builder(), []
    for section in _KIMI_SECTION.finditer(masked):
        cuts.append(section.span())
        for call in _KIMI_CALL.finditer(masked, section.start(1), section.end(1)):
            body = text[call.start(1) : call.end(1)]
            if not call.group(2):
                out.error(f"{out.where()}: missing <|tool_call_end|>")
                continue
            head, sep, arguments = body.partition("<|tool_call_argument_begin|>")
            ident = _KIMI_ID.match(head.strip())
            if not sep or not ident:
                out.error(f"{out.where()}: expected functions.<name>:<index><|tool_call_argument_begin|>{{...}}")
                continue
            out.add(ident.group(1), arguments.strip(), head.strip())
    return out.done(text, cuts)


# ------------------------------------------------------------------ gpt-oss (harmony)

_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>)?(?P<header>(?:(?!<\|start\|>|<\|message\|>).)*)<\|message\|>"
    r"(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)
_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def parse_harmony(text: str, tools: Tools = None) -> ParsedTurn:
    """gpt-oss harmony messages: a message with a recipient `to=functions.f` (in the role or
    the channel header) is a call with its JSON body; `final` and recipient-less
    `commentary` messages are the content; `analysis` (reasoning) is neither."""
    out, content = _Builder(), []
    if "<|message|>" not in text:
        return out.done(text, [])
    for message in _HARMONY_MESSAGE.finditer(text):
        header, body = message.group("header"), message.group("body")
        recipient = _HARMONY_RECIPIENT.search(header)
        channel = _HARMONY_CHANNEL.search(header)
        if recipient:
            name = recipient.group(1)
            out.add(name[len("functions.") :] if name.startswith("functions.") else name, body.strip())
        elif channel is None or channel.group(1) != "analysis":
            content.append(body.strip())
    out.turn.content = _strip_end("\n\n".join(c for c in content if c))
    return out.turn


# ------------------------------------------------------------------ registry

PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,
    "qwen": parse_hermes,
    "qwen25": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "llama3_json": parse_llama3_json,
    "llama3": parse_llama3_json,
    "mistral": parse_mistral,
    "deepseek_v3": parse_deepseek,
    "deepseekv3": parse_deepseek,
    "deepseek_v31": parse_deepseek,
    "deepseekv31": parse_deepseek,
    "glm45": parse_glm45,
    "glm4_moe": parse_glm45,
    "kimi_k2": parse_kimi_k2,
    "gpt_oss": parse_harmony,
    "gpt-oss": parse_harmony,
    "harmony": parse_harmony,
}


@functools.lru_cache(maxsize=64)
def _takes_tools(parser: ToolParser) -> bool:
    try:
        params = inspect.signature(parser).parameters
    except (TypeError, ValueError):
        return False
    return "tools" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def run_parser(parser: ToolParser, text: str, tools: Tools = None) -> ParsedTurn:
    """`parser(text, tools=tools)` when the parser takes the session's tool schemas (all
    built-ins do: qwen3_coder and glm45 type argument values by them), else `parser(text)`."""
    if tools and _takes_tools(parser):
        return parser(text, tools=tools)  # type: ignore[call-arg]
    return parser(text)


def parser_names() -> str:
    return ", ".join(sorted(PARSERS))


def get_parser(name: str) -> ToolParser:
    """A registered parser name, or a dotted path `module:function` / `module.function`."""
    if name in PARSERS:
        return PARSERS[name]
    if "." not in name and ":" not in name:
        raise ValueError(
            f"unknown tool parser {name!r}; valid names: {parser_names()} "
            "(or a dotted path package.module:function)"
        )
    try:
        parser = import_dotted(name)
    except ValueError as exc:
        raise ValueError(f"tool parser {name!r} (valid names: {parser_names()}): {exc}") from exc
    if not callable(parser):
        raise ValueError(f"tool parser {name!r} is not callable")
    return parser
