"""`math`: single-turn answer checking with the `math-verify` library.

The answer is read from the model's last assistant message: its last `\\boxed{...}`
first (a self-correction "first \\boxed{3}, final answer \\boxed{4}" answers 4, as
NeMo-Skills' `extract_answer` and lighteval read it; math-verify alone would parse both
into the set {3, 4}), then (with `answer: any`, the default) plain forms math-verify
recognises ("the answer is 1/2", "$x = 0.5$", a last number). The task's `label` is the gold answer
(LaTeX or plain), or a GSM8K answer (the worked solution, then `#### 72`): then the
gold is what follows the last `####` (`gold_answer`). Reward 1.0 when math-verify finds
them equal, else 0.0; the extracted answer and the label go into the components.

math-verify bounds its own parsing with SIGALRM, which only works in a process's
main thread, and sympy can take seconds on adversarial input. So checks run in a
small process pool by default (`check_in: process`): the worker's event loop never
blocks on sympy and every check keeps its timeout. `check_in: inline` runs them in
the caller (fine for tests and tiny runs).
"""

from __future__ import annotations

import re
from typing import Literal, Union

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, Environment, EnvSession, EpisodeRecord, Verification
from workers.envs.checkers import CheckerPool
from workers.envs.options import Options, parse_options
from workers.envs.rewards import call_with_budget, deadline_in, shaped
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


def last_boxed(response: str) -> Union[str, None]:
    """The last `\\boxed{...}` (or `\\fbox{...}`) of a response, braces balanced; None when there
    is none or it never closes (a truncated answer). NeMo-Skills' `extract_answer` reads the last
    one the same way (`rfind`, then brace matching)."""
    start = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(response)):
        if response[i] == "{":
            depth += 1
        elif response[i] == "}":
            depth -= 1
            if depth == 0:
                return response[start : i + 1]
    return None


def check_answer(response: str, gold: str, answer: AnswerForm, timeout_s: int) -> tuple[float, Union[str, None]]:
    """(reward, extracted answer text). `gold` is the task's label (`gold_answer` reads a GSM8K
    one). Top level so a process pool can run it."""
    from math_verify import parse, verify

    gold = gold_answer(gold)

    if answer == "boxed" and "\\boxed" not in response:
        return 0.0, None
    # Under a non-main thread SIGALRM is unavailable: fall back to no timeout there.
    import threading

    timeout: Union[int, None] = timeout_s if threading.current_thread() is threading.main_thread() else None
    # the last box alone: math-verify parses every box of a text into one set
    predicted = parse(f"${boxed}$" if (boxed := last_boxed(response)) else response, parsing_timeout=timeout)
    if not predicted:
        return 0.0, None
    extracted = str(predicted[-1])
    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=timeout)
    if not gold_parsed:
        gold_parsed = parse(gold, parsing_timeout=timeout)
    correct = bool(gold_parsed) and verify(gold_parsed, predicted, timeout_seconds=timeout)
    return (1.0 if correct else 0.0), extracted


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

    async def check(self, response: str, gold: str) -> tuple[float, Union[str, None]]:
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
        reward, extracted = await call_with_budget(
            lambda: self.env.check(final_answer_text(episode), gold),
            timeouts.verify,
            f"math env {self.env.name!r}: check",
            deadline=deadline_in(timeouts.verify_deadline_s),
        )
        components = {"answer": extracted, "gold": gold, "correct": reward == 1.0}
        return shaped(self.env.config, [reward], terminal=episode.status == Status.COMPLETED, components=components)
