"""Two local environments that need no server: the demo's and the tests' defaults.

- `arithmetic`: single-turn; the reward is 1.0 when the number after the last
  "Answer:" (else the last number in the response) equals the task's label.
- `calculator`: the same check, plus a `calculator` tool the model may call any
  number of times. Expressions are evaluated by walking a Python AST restricted to
  numbers and + - * / // % ** (no names, no calls), so model text never runs as code.

Task prompt: a string (one user turn) or chat messages. `task.label`: the expected
number as text.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

from pipeline.schema import Task
from workers.envs.base import Environment, EnvSession, EpisodeRecord, Message, StepResult, ToolCall, Verification

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}


def extract_answer(text: str) -> str | None:
    """The number after the last "Answer:", else the last number in `text`."""
    answers = _ANSWER.findall(text)
    if answers:
        return answers[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def numbers_match(answer: str | None, label: str | None) -> bool:
    if answer is None or label is None:
        return False
    try:
        return abs(float(answer) - float(label)) < 1e-6
    except ValueError:
        return answer.strip() == label.strip()


def initial_messages(task: Task) -> list[Message]:
    if isinstance(task.prompt, str):
        return [{"role": "user", "content": task.prompt}]
    return [dict(m) for m in task.prompt]


class ArithmeticSession(EnvSession):
    def __init__(self, task: Task, tools: list[dict[str, Any]]):
        self.task = task
        self.messages = initial_messages(task)
        self.tools = tools

    async def step(self, calls: list[ToolCall]) -> StepResult:
        return StepResult(messages=[_tool_message(c, f"error: no tool named {c.name!r}") for c in calls])

    async def verify(self, episode: EpisodeRecord) -> Verification:
        answer = extract_answer(_final_assistant_text(episode.messages))
        correct = numbers_match(answer, self.task.label)
        return Verification(reward=1.0 if correct else 0.0, components={"answer": answer, "correct": correct})


class CalculatorSession(ArithmeticSession):
    async def step(self, calls: list[ToolCall]) -> StepResult:
        return StepResult(messages=[_tool_message(c, _run_calculator(c)) for c in calls])


class ArithmeticEnvironment(Environment):
    async def start(self, task: Task) -> EnvSession:
        return ArithmeticSession(task, tools=[])


class CalculatorEnvironment(Environment):
    async def start(self, task: Task) -> EnvSession:
        return CalculatorSession(task, tools=[CALCULATOR_TOOL])


def _tool_message(call: ToolCall, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def _final_assistant_text(messages: list[Message]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def _run_calculator(call: ToolCall) -> str:
    if call.name != "calculator":
        return f"error: no tool named {call.name!r}"
    expression = call.arguments.get("expression")
    if not isinstance(expression, str):
        return "error: argument 'expression' (string) is required"
    try:
        value = evaluate_arithmetic(expression)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate_arithmetic(expression: str) -> float:
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return _eval(ast.parse(expression, mode="eval").body)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent larger than 64")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")
