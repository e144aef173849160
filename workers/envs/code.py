"""`code`: run the model's Python program against the task's tests in the sandbox.

The program is the last fenced code block (```python ... ``` or ``` ... ```) of the
model's last assistant message. Tests come from `task.metadata["tests"]`, a list
(or its JSON text) whose items are either

- `{"input": "...", "output": "..."}`: run the program with that stdin; its stdout
  must equal `output` up to trailing whitespace on each line, or
- a string (or `{"assert": "..."}`): HumanEval/MBPP style asserts, run against the
  program imported as a module by the sandbox's harness (`workers.envs.sandbox._HARNESS`,
  threat model there). The exit code never passes a test. Two ways:
  - by value (`compare_in_worker: true`, the default) when every statement is
    `assert EXPR == LITERAL` (either side the literal), `assert f(literals)` or
    `assert not f(literals)` (or HumanEval's `def check(candidate)` of such asserts; see
    `value_checks` for the exact rules): the sandbox only
    evaluates EXPR / CALL and hands the value back as plain data (exact builtin types); the
    worker compares it with the literal, which never enters the sandbox. Nothing the
    program does in its own interpreter (exiting, hooks, reading files, impersonating the
    harness, objects with a rigged `__eq__`) can pass such a test without the right value;
  - otherwise the whole snippet runs in the program's namespace and passes only when the
    harness reports this run's secret sentinel after it completed (robust against exits,
    hooks and reading the tests; not against a program written to impersonate the harness).

APPS-style `{"inputs": [...], "outputs": [...]}` is accepted too. Each test is one
sandbox run (`workers.envs.sandbox`). Reward: the fraction of tests passed, or with
`reward: all_pass` 1.0 only when every test passes (it stops at the first failure).

Isolation or an explicit no: with `require_isolation: true` (the default) the environment
refuses to start (`ConfigError`, one line naming what the sandbox lacks here and the setting)
unless the sandbox has its full isolation: network and PID namespaces and a private root
(`workers.envs.sandbox`, level `netns+pidns+mntns+root`). A training run never scores
untrusted code with network access and the host's files unless its config says
`require_isolation: false`. `rollout workers` checks it at start (`check_sandboxes`).
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Union

import msgspec

from pipeline.aio import wait_for
from pipeline.config import ConfigError, EnvConfig, PipelineConfig
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, Environment, EnvSession, EpisodeRecord, Verification
from workers.envs.math import final_answer_text
from workers.envs.options import Options, parse_options
from workers.envs.rewards import shaped
from workers.envs.sandbox import Isolation, Limits, RunResult, probe_isolation, run_python
from workers.envs.toolless import ToollessSession

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


class CodeOptions(Options, frozen=True):
    reward: Literal["fraction", "all_pass"] = "fraction"
    limits: Limits = Limits()
    parallel: int = 2  # sandbox runs at once per episode
    require_isolation: bool = True  # refuse to run without the sandbox's namespaces and private root
    compare_in_worker: bool = True  # simple asserts by value, compared outside the sandbox


class IOTest(msgspec.Struct, kw_only=True):
    input: str = ""
    output: str


class AssertTest(msgspec.Struct, kw_only=True):
    code: str


Test = Union[IOTest, AssertTest]


@dataclass(frozen=True)
class ValueCheck:
    """An assert the worker can judge from one value: `expression`'s value must be `expected`
    (`kind` "eq"), truthy ("true") or falsy ("false")."""

    expression: str
    kind: Literal["eq", "true", "false"]
    expected: Any = None


def value_checks(code: str) -> Union[list[ValueCheck], None]:
    """The ValueChecks of an assert snippet the worker can judge by value, else None.

    Every statement must be `assert EXPR == LITERAL` / `assert LITERAL == EXPR` (when LITERAL
    is True, False or None, EXPR must be `f(literals)` with `f` no builtin: a value anyone can
    guess proves nothing if, say, a rebound `math.isclose` produced it), `assert f(literals)` or
    `assert not f(literals)` (a message is ignored), or the snippet is HumanEval's shape:
    `def check(candidate):` made of such asserts (and a docstring), `METADATA = {...}`, and
    `check(entry_point)`; `candidate` then stands for the entry point."""
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    asserts = [node for node in body if isinstance(node, ast.Assert)]
    if body and len(asserts) == len(body):
        return _checks_of(asserts)
    return _humaneval_checks(body)


def _checks_of(asserts: list[ast.Assert]) -> Union[list[ValueCheck], None]:
    checks = []
    for node in asserts:
        if isinstance(node.test, ast.Constant) and node.test.value:  # `assert True, "..."`: passes anywhere
            continue
        check = _check_of(node)
        if check is None:
            return None
        checks.append(check)
    return checks or None


def _check_of(node: ast.Assert) -> Union[ValueCheck, None]:
    test = node.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        for expression, literal in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
            expected = _literal(literal)
            if expected is _NOT_LITERAL:
                continue
            # A value anyone can guess (True, False, None) proves something only when the program's
            # own function produced it: `math.isclose(f(x), y) == True` would pass a program that
            # rebinds math.isclose. So those need `name(literals)`; others cannot be guessed.
            if isinstance(expected, bool) or expected is None:
                return ValueCheck(ast.unparse(expression), "eq", expected) if _own_call(expression) else None
            return ValueCheck(ast.unparse(expression), "eq", expected)
        return None
    if _own_call(test):
        return ValueCheck(ast.unparse(test), "true")
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _own_call(test.operand):
        return ValueCheck(ast.unparse(test.operand), "false")
    return None


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _own_call(node: ast.expr) -> bool:
    """`name(literal, ..., key=literal)` with a name that is no builtin: the program's function on fixed input."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and not hasattr(builtins, node.func.id)
        and all(_literal(arg) is not _NOT_LITERAL for arg in node.args)
        and all(kw.arg is not None and _literal(kw.value) is not _NOT_LITERAL for kw in node.keywords)
    )


def _humaneval_checks(body: list[ast.stmt]) -> Union[list[ValueCheck], None]:
    rest = [
        node
        for node in body
        if not (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["METADATA"])
        and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
    ]
    if len(rest) != 2 or not isinstance(rest[0], ast.FunctionDef) or not isinstance(rest[1], ast.Expr):
        return None
    check, call = rest[0], rest[1].value
    params = check.args
    if (
        len(params.args) != 1
        or params.posonlyargs
        or params.kwonlyargs
        or params.vararg
        or params.kwarg
        or check.decorator_list
        or not isinstance(call, ast.Call)
        or not isinstance(call.func, ast.Name)
        or call.func.id != check.name
        or len(call.args) != 1
        or call.keywords
        or not isinstance(call.args[0], ast.Name)
    ):
        return None
    parameter, entry = params.args[0].arg, call.args[0].id
    asserts = [node for node in check.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    if not asserts or not all(isinstance(node, ast.Assert) for node in asserts):
        return None
    return _checks_of([_Rename(parameter, entry).visit(node) for node in asserts])


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id=self.new, ctx=node.ctx) if node.id == self.old else node


def extract_program(text: str) -> Union[str, None]:
    """The last fenced block that is Python (or untagged)."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


def parse_tests(task: Task) -> list[Test]:
    raw: Any = task.metadata.get("tests")
    if isinstance(raw, str):
        raw = json.loads(raw)
    if isinstance(raw, dict) and "inputs" in raw:  # APPS input_output
        raw = [{"input": i, "output": o} for i, o in zip(raw["inputs"], raw["outputs"])]
    if not isinstance(raw, list) or not raw:
        raise ValueError("metadata.tests must be a non-empty list")
    tests: list[Test] = []
    for index, item in enumerate(raw):
        if isinstance(item, str):
            tests.append(AssertTest(code=item))
        elif isinstance(item, dict) and "assert" in item:
            tests.append(AssertTest(code=str(item["assert"])))
        elif isinstance(item, dict) and "output" in item:
            tests.append(IOTest(input=str(item.get("input", "")), output=str(item["output"])))
        else:
            raise ValueError(f"metadata.tests[{index}] is neither an assert string nor {{input, output}}")
    return tests


def _normalise(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def judge(test: Test, result: RunResult) -> tuple[bool, str]:
    """(passed, why not)."""
    if result.timed_out:
        return False, "wall timeout"
    if result.output_exceeded:
        return False, "output limit"
    if isinstance(test, AssertTest):
        if result.passed:
            return True, ""
        return False, (result.harness or result.reason or _tail(result) or "the harness reported no pass")[:300]
    if result.returncode != 0:
        return False, (result.reason or _tail(result) or f"exit {result.returncode}")[:300]
    if isinstance(test, IOTest) and _normalise(result.stdout) != _normalise(test.output):
        return False, "wrong output"
    return True, ""


def expression_of(checks: list[ValueCheck]) -> str:
    """One expression for the sandbox: the tuple of the checks' expressions, evaluated in order."""
    return "(" + "".join(f"({check.expression}), " for check in checks) + ")"


def judge_value(checks: list[ValueCheck], result: RunResult) -> tuple[bool, str]:
    """(passed, why not) for by-value asserts: the comparison happens here, in the worker."""
    if result.timed_out:
        return False, "wall timeout"
    if result.output_exceeded:
        return False, "output limit"
    if not result.evaluated:
        return False, (result.harness or result.reason or _tail(result) or "no value came back")[:300]
    values = result.value
    if type(values) is not tuple or len(values) != len(checks):
        return False, "wrong value"
    for index, (check, value) in enumerate(zip(checks, values)):
        try:
            if check.kind == "eq":
                ok = bool(value == check.expected)
            else:
                ok = bool(value) == (check.kind == "true")
        except Exception as exc:  # plain data compares without raising; be safe all the same
            return False, f"comparison failed: {type(exc).__name__}"
        if not ok:
            return False, "wrong value" if len(checks) == 1 else f"wrong value (assert {index})"
    return True, ""


def _tail(result: RunResult) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def missing_isolation(isolation: Isolation) -> list[str]:
    """What the sandbox lacks on this host of its full isolation (empty: nothing)."""
    return [what for what, have in (
        ("network namespace (programs would have network access)", isolation.network),
        ("PID namespace (programs would see the host's processes)", isolation.pid_namespace),
        ("private root (programs would read the host's files)", isolation.private_root),
    ) if not have]


def isolation_refusal(name: str, options: CodeOptions, isolation: Isolation) -> str | None:
    """The one-line refusal of code environment `name` on this host, or None when it may run."""
    missing = missing_isolation(isolation)
    if not options.require_isolation or not missing:
        return None
    return (f"environments.{name}: the code sandbox has no {'; no '.join(missing)} here (isolation: "
            f"{isolation.summary}); refusing to score untrusted code unisolated: set "
            f"environments.{name}.options.require_isolation: false to allow it")


def check_sandboxes(config: PipelineConfig) -> None:
    """`ConfigError` for the first `code` environment that would refuse to start on this host
    (`rollout workers` at start: one line instead of every job of the environment failing)."""
    for name, env in config.environments.items():
        if env.kind == "code":
            refusal = isolation_refusal(name, parse_options(name, env, CodeOptions), probe_isolation())
            if refusal:
                raise ConfigError(refusal)


class CodeEnvironment(Environment):
    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, CodeOptions)
        self.isolation = probe_isolation()
        refusal = isolation_refusal(name, self.options, self.isolation)
        if refusal:
            raise ConfigError(refusal)

    async def start(self, task: Task) -> EnvSession:
        try:
            tests = parse_tests(task)
        except (ValueError, msgspec.ValidationError) as exc:
            raise EnvError(f"code env {self.name!r}: task {task.id!r}: {exc}") from exc
        return CodeSession(self, task, tests)

    async def run_tests(self, program: str, tests: list[Test]) -> list[tuple[bool, str]]:
        gate = asyncio.Semaphore(self.options.parallel)
        failed = asyncio.Event()
        stop_early = self.options.reward == "all_pass"

        async def one(test: Test) -> tuple[bool, str]:
            async with gate:
                if stop_early and failed.is_set():
                    return False, "not run (an earlier test failed)"
                checks = value_checks(test.code) if isinstance(test, AssertTest) and self.options.compare_in_worker else None
                if checks is not None:
                    result = await run_python(program, "", self.options.limits, evaluate=expression_of(checks))
                    verdict = judge_value(checks, result)
                elif isinstance(test, AssertTest):
                    result = await run_python(program, "", self.options.limits, test=test.code)
                    verdict = judge(test, result)
                else:
                    result = await run_python(program, test.input, self.options.limits)
                    verdict = judge(test, result)
                if result.sandbox_error:  # not the program's doing: fail the episode, do not score it
                    raise EnvError(f"code env {self.name!r}: sandbox failed: {result.sandbox_error}")
                if not verdict[0]:
                    failed.set()
                return verdict

        return list(await asyncio.gather(*(one(t) for t in tests)))


class CodeSession(ToollessSession):
    def __init__(self, env: CodeEnvironment, task: Task, tests: list[Test]):
        super().__init__(task)
        self.env = env
        self.tests = tests

    async def verify(self, episode: EpisodeRecord) -> Verification:
        config = self.env.config
        terminal = episode.status == Status.COMPLETED
        program = extract_program(final_answer_text(episode))
        base = {"isolation": self.env.isolation.summary, "total": len(self.tests)}
        if program is None:
            return shaped(config, [0.0], terminal=terminal, components={**base, "passed": 0, "error": "no code block"})
        try:
            verdicts = await wait_for(
                self.env.run_tests(program, self.tests), config.timeouts.verify_deadline_s
            )
        except asyncio.TimeoutError as exc:
            raise EnvError(
                f"code env {self.env.name!r}: {len(self.tests)} tests exceeded the verification deadline "
                f"({config.timeouts.verify_deadline_s}s)"
            ) from exc
        passed = sum(ok for ok, _ in verdicts)
        if self.env.options.reward == "all_pass":
            reward = 1.0 if passed == len(verdicts) else 0.0
        else:
            reward = passed / len(verdicts)
        failures = [f"test {i}: {why}" for i, (ok, why) in enumerate(verdicts) if not ok]
        components = {**base, "passed": passed, "failures": failures[:5]}
        return shaped(config, [reward], terminal=terminal, components=components)
