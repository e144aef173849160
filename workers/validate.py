"""Check environments and tasks before anything is admitted or consumed.

`rollout prepare`, `rollout enqueue` and `rollout workers` call these at start, so a config
mistake (`kind: maths`, an unknown `options` key, a math row with no answer) is one error
line naming the environment and key, or the file and line, instead of a pipeline that
dead-letters its whole dataset.

Nothing here builds an environment (constructors may open pools, read secrets, probe the
sandbox): a kind is resolved (imported), its options are converted with the kind's
`Options` struct, and each task is checked for what the kind's `start` requires.

- Options struct of a kind: the class attribute `options_type` when the class has one,
  else `<Name>Options` beside `<Name>Environment` in its module (the registered kinds'
  convention), else the base `Options` (only `tool_parser`) for the registered kinds that
  take no options; a user class without either is checked for `tool_parser` only.
- Per-task checks: `TASK_CHECKS` for the registered kinds; a user class may define a
  static/class method `check_task(task) -> str | None` (a reason, or None when fine).
- Gold checks (`GOLD_CHECKS`, `rollout prepare` only: a parse per row): whether the `math` and
  `nemo_skills` verifiers can read the task's gold at all; a gold math-verify reads nothing from
  would score every sample of the task 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Union

import msgspec

from pipeline.config import ConfigError, EnvConfig, PipelineConfig
from pipeline.schema import SchemaError, Task, decode_task_json

MAX_SHOWN = 20

TaskCheck = Callable[[Task], Union[str, None]]


def _needs_label(task: Task) -> str | None:
    if task.label is None or not str(task.label).strip():
        return "no label (the gold answer this environment checks the response against)"
    return None


def _code_tests(task: Task) -> str | None:
    from workers.envs.code import parse_tests

    try:
        parse_tests(task)
    except (ValueError, TypeError, KeyError, msgspec.ValidationError) as exc:
        return f"no usable tests: {exc}"
    return None


def _nemo_gym_row(task: Task) -> str | None:
    from workers.envs.convert import input_problems

    params = task.metadata.get("responses_create_params")
    if not isinstance(params, dict):
        return "no metadata.responses_create_params"
    problems = input_problems(params)
    if problems:
        return "; ".join(f"metadata.{where}: {reason}" for where, reason in problems[:3])
    return None


def _openreward_row(task: Task) -> str | None:
    meta = task.metadata
    if "task_spec" in meta or ("split" in meta and "index" in meta):
        return None
    return "neither metadata.task_spec nor metadata.split + metadata.index"


# registered kind -> what its `start` requires of a task
TASK_CHECKS: dict[str, TaskCheck] = {
    "arithmetic": _needs_label,
    "calculator": _needs_label,
    "math": _needs_label,
    "code": _code_tests,
    "nemo_gym": _nemo_gym_row,
    "openreward": _openreward_row,
}
_NO_OPTIONS_KINDS = ("arithmetic", "calculator")
GOLD_TIMEOUT_S = 5  # math-verify's own default bound on one parse


def _math_gold(task: Task) -> str | None:
    from workers.envs.math import gold_answer
    from workers.envs.mathverify import gold_problem

    return gold_problem(gold_answer(str(task.label)), GOLD_TIMEOUT_S)


def _nemo_skills_gold(task: Task) -> str | None:
    from workers.envs.nemo_skills import gold_answer, gold_problem

    gold = gold_answer(task)
    return None if gold is None else gold_problem(gold)


# registered kind -> whether its verifier can read the task's gold (a math-verify parse, ~20 ms a
# LaTeX gold): a gold it cannot read would score every sample of the task 0
GOLD_CHECKS: dict[str, TaskCheck] = {"math": _math_gold, "nemo_skills": _nemo_skills_gold}


def resolve(name: str, env: EnvConfig) -> type:
    """The environment's class; ConfigError naming `environments.<name>.kind` otherwise."""
    from workers.envs.registry import UnknownEnvironmentKind, resolve_kind

    try:
        return resolve_kind(env.kind)
    except UnknownEnvironmentKind as exc:
        import difflib

        from workers.envs.registry import KINDS

        close = difflib.get_close_matches(env.kind, list(KINDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"environments.{name}.kind: {exc}{hint}") from None


def options_type(kind: str, cls: type) -> type | None:
    from workers.envs.options import Options

    declared = getattr(cls, "options_type", None)
    if isinstance(declared, type) and issubclass(declared, Options):
        return declared
    module = sys.modules.get(cls.__module__)
    if cls.__name__.endswith("Environment") and module is not None:
        candidate = getattr(module, cls.__name__[: -len("Environment")] + "Options", None)
        if isinstance(candidate, type) and issubclass(candidate, Options):
            return candidate
    if kind in _NO_OPTIONS_KINDS:
        return Options
    return None


def check_environment(name: str, env: EnvConfig) -> type:
    """Kind resolves, options convert (unknown keys are errors), tool parser known. Returns the class."""
    from workers.envs.options import check_tool_parser, parse_options

    cls = resolve(name, env)
    opts = options_type(env.kind, cls)
    if opts is not None:
        parse_options(name, env, opts)
    else:
        check_tool_parser(name, env)
    return cls


def check_environments(config: PipelineConfig) -> dict[str, type]:
    """`check_environment` for every configured environment; the first error is raised."""
    return {name: check_environment(name, env) for name, env in config.environments.items()}


def task_check(kind: str, cls: type) -> TaskCheck | None:
    own = getattr(cls, "check_task", None)
    if callable(own):
        return own  # type: ignore[no-any-return]
    return TASK_CHECKS.get(kind)


def task_problem(task: Task, config: PipelineConfig, checks: dict[str, TaskCheck | None], *,
                 gold: bool = True) -> str | None:
    """Why `task` cannot run (None when it can); `checks` caches env name -> check. `gold`: also
    whether the verifier reads the task's gold (`GOLD_CHECKS`: `rollout prepare`; the rm-server's
    environment tells an unreadable gold itself, off its event loop)."""
    env = config.environments.get(task.env)
    if env is None:
        known = ", ".join(sorted(config.environments)) or "none"
        return f"task {task.id!r}: environment {task.env!r} is not configured (configured: {known})"
    if task.env not in checks:
        checks[task.env] = task_check(env.kind, resolve(task.env, env))
    check = checks[task.env]
    reason = check(task) if check is not None else None
    if reason is None and gold and env.kind in GOLD_CHECKS:
        reason = GOLD_CHECKS[env.kind](task)
    return f"task {task.id!r} ({task.env}, kind {env.kind}): {reason}" if reason else None


def check_task_lines(path: str | Path, config: PipelineConfig) -> list[str]:
    """`file:line: reason` of every task in tasks.jsonl that its environment could not run."""
    errors: list[str] = []
    checks: dict[str, TaskCheck | None] = {}
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                task = decode_task_json(line)
            except (SchemaError, UnicodeDecodeError) as exc:
                errors.append(f"{path}:{number}: {exc}")
                continue
            reason = task_problem(task, config, checks, gold=False)  # `rollout prepare` read the golds
            if reason:
                errors.append(f"{path}:{number}: {reason}")
    return errors


def check_tasks(path: str | Path, config: PipelineConfig) -> None:
    """ConfigError listing the first bad lines of tasks.jsonl (nothing admitted)."""
    errors = check_task_lines(path, config)
    if errors:
        raise ConfigError(format_errors(str(path), errors))


def format_errors(what: str, errors: Iterable[str]) -> str:
    errors = list(errors)
    shown = "\n  ".join(errors[:MAX_SHOWN])
    more = f"\n  ... and {len(errors) - MAX_SHOWN} more" if len(errors) > MAX_SHOWN else ""
    return f"{what}: {len(errors)} task(s) their environment cannot run:\n  {shown}{more}"

