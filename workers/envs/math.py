"""`math`: single-turn answer checking with the `math-verify` library.

The answer is read from the model's last assistant message: its last `\\boxed{...}` or
`\\fbox{...}` first (a self-correction "first \\boxed{3}, final answer \\boxed{4}" answers 4;
math-verify alone would parse both into the set {3, 4}), then (with `answer: any`, the default)
plain forms math-verify recognises ("the answer is 1/2", "$x = 0.5$", a last number). The task's
`label` is the gold answer (LaTeX or plain), or a GSM8K answer (the worked solution, then
`#### 72`): then the gold is what follows the last `####` (`gold_answer`). Reward 1.0 when
math-verify finds them equal, else 0.0; the extracted answer and the label go into the components.

The box is read as NeMo-Skills' `extract_answer` reads it (the last one, braces matched; a last
box cut off or without braces is no answer) except in three places, where this kind reads more
(`tests/workers/test_env_math.py` pins each against NeMo-Skills' own code):
- `\\fbox{3}` with no `\\boxed` anywhere: 3 here; None there (it looks for `\\fbox` only
  after finding a `\\boxed`);
- `\\boxed {4}` (a space before the brace, valid LaTeX): 4 here; None there;
- `\\boxed{3} hmm \\fbox{4}`: 4 here (the last box of either command); 3 there (the last
  `\\boxed`).

Only decided answers are graded. A last box that cannot be read (cut off by the length limit,
`\\boxed 4` without braces) scores 0 with `components.reason: "unreadable final box"`: never an
earlier box or the whole text. An answer math-verify gives up on (its timeout, its LaTeX parser's
recursion or memory limit, an error inside it), boxed or not, is undecided
(`workers/envs/mathverify.py`): by default a 0 with its reason and `undecided: true`
(`on_undecided: zero`; `remove` fails the episode instead). A gold math-verify cannot read is
`TaskUngradable` (the episode fails, removed; `rollout prepare` rejects the row first). A checker
process that died is a failed measurement.

math-verify bounds its own parsing with SIGALRM, which only works in a process's
main thread, and sympy can take seconds on adversarial input. So checks run in a
small process pool by default (`check_in: process`): the worker's event loop never
blocks on sympy and every check keeps its timeout. `check_in: inline` runs them in
the caller (fine for tests and tiny runs).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple, Union

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, Environment, EnvSession, EpisodeRecord, Undecided, Verification
from workers.envs.checkers import CheckerPool
from workers.envs.mathverify import read_gold, undecided_on_give_up
from workers.envs.options import Options, parse_options
from workers.envs.rewards import call_with_budget, deadline_in, settle_undecided, shaped
from workers.envs.toolless import ToollessSession

AnswerForm = Literal["boxed", "any"]


class MathOptions(Options, frozen=True):
    answer: AnswerForm = "any"  # "boxed": only \boxed{...} counts
    check_in: Literal["process", "inline"] = "process"
    processes: int = 2
    parse_timeout_s: int = 5  # math-verify's own bound per parse/verify (whole seconds)


_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def gold_answer(label: str) -> str:
    """The gold answer a label states. GSM8K's labels are a worked solution whose last line is
    `#### <answer>` ("Natalia sold 48/2 = 24 clips in May. ... #### 72"): the answer is the text
    after the last `####` (thousands separators dropped: "1,000" is 1000), not the solution's
    numbers. Any other label is the answer itself."""
    if "####" not in label:
        return label
    answer = label.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    if not answer:
        return label
    return answer.replace(",", "") if _THOUSANDS.fullmatch(answer) else answer


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def final_box(response: str) -> tuple[bool, Union[str, None]]:
    """(whether the response has a `\\boxed`/`\\fbox`, the last one with its braces when it can
    be read). A last box that never closes (a truncated answer) or has no braces (`\\boxed 4`)
    cannot be read: (True, None). NeMo-Skills' `extract_answer` reads the last one the same way
    (`rfind`, then brace matching) and answers None for both."""
    start, command = max((response.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return False, None
    brace = start + len(command)
    while brace < len(response) and response[brace].isspace():
        brace += 1
    if not response.startswith("{", brace):
        return True, None
    depth = 0
    for i in range(brace, len(response)):
        if response[i] == "{":
            depth += 1
        elif response[i] == "}":
            depth -= 1
            if depth == 0:
                return True, response[start : i + 1]
    return True, None


def last_boxed(response: str) -> Union[str, None]:
    """The last `\\boxed{...}` (or `\\fbox{...}`) of a response, braces balanced; None when there
    is none or it cannot be read (`final_box`)."""
    return final_box(response)[1]


UNREADABLE_BOX = "unreadable final box"


class Grade(NamedTuple):
    """One checked answer: the reward, the answer read (math-verify's form) and, for a 0 given
    without a comparison, why (`UNREADABLE_BOX`, "no boxed answer", "no answer found")."""

    reward: float
    answer: Union[str, None]
    reason: Union[str, None] = None


def check_answer(response: str, gold: str, answer: AnswerForm, timeout_s: int) -> Grade:
    """The response graded against `gold`, the task's label (`gold_answer` reads a GSM8K one).
    Only the final box counts when there is one: a last box that cannot be read ends the grading
    at 0 (`UNREADABLE_BOX`), never an earlier box or the whole text. `Undecided` when math-verify
    gave up on the answer (its timeout, its recursion limit, an error inside it);
    `TaskUngradable` when it cannot read the gold. Top level so a process pool can run it."""
    import threading

    from math_verify import parse, verify

    # Under a non-main thread SIGALRM is unavailable: fall back to no timeout there.
    timeout: Union[int, None] = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold_parsed = read_gold(gold_answer(gold), timeout)
    has_box, boxed = final_box(response)
    if has_box and boxed is None:
        return Grade(0.0, None, UNREADABLE_BOX)
    if answer == "boxed" and boxed is None:
        return Grade(0.0, None, "no boxed answer")
    with undecided_on_give_up(timeout_s, boxed or response) as watch:
        # the last box alone: math-verify parses every box of a text into one set
        predicted = parse(f"${boxed}$" if boxed else response, parsing_timeout=timeout, raise_on_error=True)
        watch.raise_if_gave_up()  # its parser's RecursionError, swallowed inside `parse`
        if not predicted:
            return Grade(0.0, None, "no answer found")
        correct = verify(gold_parsed, predicted, timeout_seconds=timeout, raise_on_error=True)
    return Grade(1.0 if correct else 0.0, str(predicted[-1]))


def final_answer_text(episode: EpisodeRecord) -> str:
    """The model's last assistant message (earlier turns may hold scratch work)."""
    for message in reversed(episode.messages):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    return episode.response_text


class MathEnvironment(Environment):
    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, MathOptions)
        self._checkers = CheckerPool(self.options.processes, f"math env {name!r}")

    async def start(self, task: Task) -> EnvSession:
        if task.label is None:
            raise EnvError(f"math env {self.name!r}: task {task.id!r} has no label (the gold answer)")
        return MathSession(self, task)

    async def check(self, response: str, gold: str) -> Grade:
        args = (response, gold, self.options.answer, self.options.parse_timeout_s)
        if self.options.check_in == "inline":
            return check_answer(*args)
        return await self._checkers.run(check_answer, *args)

    async def aclose(self) -> None:
        self._checkers.close()


class MathSession(ToollessSession):
    def __init__(self, env: MathEnvironment, task: Task):
        super().__init__(task)
        self.env = env

    async def verify(self, episode: EpisodeRecord) -> Verification:
        gold = self.task.label or ""
        timeouts = self.env.config.timeouts
        terminal = episode.status == Status.COMPLETED
        try:
            grade = await call_with_budget(
                lambda: self.env.check(final_answer_text(episode), gold),
                timeouts.verify,
                f"math env {self.env.name!r}: check",
                deadline=deadline_in(timeouts.verify_deadline_s),
            )
        except Undecided as undecided:
            return settle_undecided(self.env.config, undecided, terminal=terminal, components={"gold": gold})
        components = {"answer": grade.answer, "gold": gold, "correct": grade.reward == 1.0}
        if grade.reason:
            components["reason"] = grade.reason
        return shaped(self.env.config, [grade.reward], terminal=terminal, components=components)
