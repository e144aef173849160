"""`nemo_skills`: NeMo-Skills prompts and NeMo-Skills' math scoring, in-process.

The prompt of each task is rendered by NeMo-Skills' own code: `get_prompt(prompt_config,
examples_type=..., system_message=..., code_tags=...)` once per environment, then
`.fill(input_dict)` per task with no tokenizer, which returns the chat messages
(`[{"role": "system", ...}, {"role": "user", ...}]`). The runner tokenizes those messages
once with the policy's chat template, so the prompt tokens are exactly what NeMo-Skills'
`fill(..., tokenizer=<the same tokenizer>)` would give as text, and no text is re-tokenized.

`input_dict` is the task's metadata (the whole NeMo-Skills row when `rollout prepare` read it
with `source: nemo_skills`) plus `problem` = the task's prompt text when the row has none.

Scoring (`scoring: math`) is what NeMo-Skills' NeMo-RL math environment
(`nemo_skills/training/nemo_rl/environments/math_environment.py`) does per sample:
`math_equal(expected_answer, extract_answer("".join(assistant contents)))`, reward 1.0 / 0.0;
the gold is the task's label (or `metadata.expected_answer`). Checks run in a small process pool
(math-verify's timeouts need a main thread), as the `math` kind does. The same rule as `math`
for what math-verify does not decide (`workers/envs/mathverify.py`): an answer it gives up on is
undecided (by default a 0 with its reason, `on_undecided`), a gold it cannot read (neither text
`math_equal` compares literally nor LaTeX it parses) is `TaskUngradable`, a checker process that
died is a failed measurement.

nemo_skills is not a dependency: it must be importable (an installed package or a checkout on
PYTHONPATH) when the environment is built; otherwise a ConfigError says so.

NeMo-Skills' proxy server (`/v1/chat/completions`) is not used as an engine: it answers text,
and training here is token in, token out (the engine's own token ids and log-probs); re-tokenizing
its text could change the tokens the policy sampled.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from workers.envs import mathverify
from workers.envs.base import (
    EnvError,
    Environment,
    EnvSession,
    EpisodeRecord,
    Message,
    TaskUngradable,
    Undecided,
    Verification,
)
from workers.envs.checkers import CheckerPool
from workers.envs.options import Options, parse_options
from workers.envs.rewards import call_with_budget, deadline_in, settle_undecided, shaped
from workers.envs.toolless import ToollessSession

INSTALL_HINT = (
    "the nemo_skills package is not importable: install NeMo-Skills (pip install nemo-skills, or "
    "pip install git+https://github.com/NVIDIA-NeMo/Skills) or put a checkout holding nemo_skills/ on PYTHONPATH"
)


class NemoSkillsOptions(Options, frozen=True):
    # a NeMo-Skills prompt config: a name (`generic/math`), a path to a .yaml, or the config
    # itself as a mapping ({user: ..., system: ..., few_shot_examples: {...}})
    prompt_config: Union[str, dict[str, Any]] = "generic/math"
    examples_type: Union[str, None] = None  # few-shot examples (nemo_skills.prompt.few_shot_examples)
    system_message: Union[str, None] = None  # replaces the config's system message
    code_tags: Union[str, dict[str, Any], None] = None  # code tags config (e.g. `qwen`), for templates that use them
    config_dir: Union[str, None] = None  # where named prompt configs live (NeMo-Skills' own by default)
    scoring: Literal["math"] = "math"  # NeMo-Skills' math grader (extract_answer + math_equal)
    check_in: Literal["process", "inline"] = "process"
    processes: int = 2


def import_prompt_utils() -> Any:
    try:
        from nemo_skills.prompt import utils
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc
    return utils


def build_prompt(name: str, options: NemoSkillsOptions) -> Any:
    """NeMo-Skills' `Prompt` for the options (its own `get_prompt`); ConfigError naming the key."""
    utils = import_prompt_utils()
    config = options.prompt_config
    try:
        return utils.get_prompt(
            dict(config) if isinstance(config, dict) else config,
            tokenizer=None,
            code_tags=dict(options.code_tags) if isinstance(options.code_tags, dict) else options.code_tags,
            examples_type=options.examples_type,
            system_message=options.system_message,
            config_dir=options.config_dir,
        )
    except (OSError, TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"environments.{name}.options.prompt_config: {type(exc).__name__}: {exc}") from exc


def input_dict(task: Task) -> dict[str, Any]:
    """What `fill` formats the templates with: the row's fields, and `problem` from the prompt."""
    values = dict(task.metadata)
    if "problem" not in values and isinstance(task.prompt, str):
        values["problem"] = task.prompt
    return values


def render_messages(prompt: Any, task: Task) -> list[Message]:
    """The task's chat messages as NeMo-Skills renders them (`Prompt.fill`, no tokenizer)."""
    try:
        messages = prompt.fill(input_dict(task))
    except KeyError as exc:
        raise EnvError(f"nemo_skills prompt: task {task.id!r} has no field {exc} the prompt template uses") from exc
    except (IndexError, ValueError) as exc:
        raise EnvError(f"nemo_skills prompt: task {task.id!r} cannot fill the template: {exc}") from exc
    return [dict(m) for m in messages]


def gold_answer(task: Task) -> Union[str, None]:
    if task.label is not None and str(task.label).strip():
        return str(task.label)
    value = task.metadata.get("expected_answer")
    return None if value is None or not str(value).strip() else str(value)


_LITERAL = re.compile(r"[a-zA-Z ,]+|[0-9 ]+")  # what `math_equal` compares as text (NeMo-Skills' math_grader)


def gold_problem(gold: str) -> Union[str, None]:
    """Why NeMo-Skills' grader cannot grade against `gold` (None when it can): not text it compares
    literally (letters or digits) and not LaTeX math-verify reads (`mathverify.read_gold`)."""
    if _LITERAL.fullmatch(gold.strip()):
        return None
    return mathverify.gold_problem(gold, PARSE_TIMEOUT_S)


def grade_math(response: str, gold: str) -> tuple[float, Union[str, None]]:
    """NeMo-Skills' math environment on one sample: (reward, extracted answer). A 0 that math-verify
    did not decide (its timeout, its LaTeX parser's recursion limit, an error it logged and
    swallowed) is `Undecided`; a gold it cannot read is `TaskUngradable`. NeMo-Skills' `math_equal`
    calls `parse`/`verify` without `raise_on_error`, so their give-ups come out as a False plus a
    line on the `math_verify` loggers, or nothing at all (`mathverify.watching` sees both).
    Top level for a pool."""
    import contextlib
    import io

    from math_verify.errors import TimeoutException
    from nemo_skills.evaluation.math_grader import extract_answer, math_equal

    problem = gold_problem(gold)
    if problem:
        raise TaskUngradable(problem)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        extracted = extract_answer(response)
        with mathverify.watching(extracted) as watch:
            try:
                score = float(math_equal(gold, extracted))
            except TimeoutException as exc:
                raise Undecided(f"math-verify gave up: timed out ({str(exc).split(':', 1)[0]})", extracted) from None
            except (RecursionError, MemoryError) as exc:
                raise Undecided(f"math-verify gave up: {type(exc).__name__}", extracted) from None
    if score == 0.0:
        watch.raise_if_gave_up()
    return score, extracted


PARSE_TIMEOUT_S = 5  # math-verify's own default, as NeMo-Skills' math_equal calls it


def assistant_text(episode: EpisodeRecord) -> str:
    """All assistant contents joined, as NeMo-Skills' math environment reads a conversation."""
    return "".join(
        str(m.get("content") or "") for m in episode.messages if m.get("role") == "assistant"
    )


class NemoSkillsEnvironment(Environment):
    options_type = NemoSkillsOptions

    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, NemoSkillsOptions)
        self.prompt = build_prompt(name, self.options)
        self._checkers = CheckerPool(self.options.processes, f"nemo_skills env {name!r}")

    @staticmethod
    def check_task(task: Task) -> Union[str, None]:
        if gold_answer(task) is None:
            return "no label / expected_answer (the gold answer NeMo-Skills' math grader checks against)"
        return None

    async def start(self, task: Task) -> EnvSession:
        gold = gold_answer(task)
        if gold is None:
            raise EnvError(f"nemo_skills env {self.name!r}: task {task.id!r} has no label or expected_answer")
        return NemoSkillsSession(self, task, render_messages(self.prompt, task), gold)

    async def grade(self, response: str, gold: str) -> tuple[float, Union[str, None]]:
        if self.options.check_in == "inline":
            return grade_math(response, gold)
        return await self._checkers.run(grade_math, response, gold)

    async def aclose(self) -> None:
        self._checkers.close()


class NemoSkillsSession(ToollessSession):
    def __init__(self, env: NemoSkillsEnvironment, task: Task, messages: list[Message], gold: str):
        super().__init__(task)
        self.env = env
        self.messages = messages
        self.gold = gold

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        terminal = episode.status == Status.COMPLETED
        try:
            reward, extracted = await call_with_budget(
                lambda: self.env.grade(assistant_text(episode), self.gold),
                timeouts.verify,
                f"nemo_skills env {self.env.name!r}: math grade",
                deadline=deadline_in(timeouts.verify_deadline_s),
            )
        except Undecided as undecided:
            return settle_undecided(self.env.config, undecided, terminal=terminal, components={"gold": self.gold})
        components = {"answer": extracted, "gold": self.gold, "correct": reward == 1.0}
        return shaped(self.env.config, [reward], terminal=terminal, components=components)
