"""math-verify's give-ups told apart from its verdicts, one rule for every grader that uses it
(the `math` and `nemo_skills` kinds; docs/environments.md "Undecided answers").

math-verify hides some of its give-ups: its LaTeX extraction swallows every error of the parser
(`extract_latex`, math_verify 0.9: a RecursionError on a 200-deep fraction becomes "no answer"),
and `parse`/`verify` without `raise_on_error` turn a timeout into a WARNING line and any other
error into a DEBUG line. `watching()` sees all three while a check runs: it wraps the parser
math-verify calls and listens on its loggers (never printing them).

The rule:
- an answer whose own size exhausts the verifier's budget (its timeout, its recursion or memory
  limit, an error inside it on that answer) is `Undecided`: the environment's `on_undecided`
  says whether it scores 0 with its reason (default) or fails the measurement
  (`rewards.settle_undecided`);
- a gold math-verify cannot read (no expression, or it gave up on it) is `TaskUngradable`: no
  answer could score 1 (`read_gold`; `rollout prepare` rejects such a row, workers/validate.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any, Union

from workers.envs.base import MeasurementFailed, TaskUngradable, Undecided

_LOGGER = "math_verify"


class Watch(logging.Handler):
    """What math-verify gave up on during one check, in its own words."""

    def __init__(self, answer: Union[str, None]) -> None:
        super().__init__(logging.DEBUG)
        self.answer = answer  # the text being checked, carried by an `Undecided` on it
        self.gave_up: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("Timeout during"):  # "Timeout during parsing: <the text>", "Timeout during comparison"
            self.gave_up.append(text.split(":", 1)[0])
        elif text.startswith(("Error parsing", "Error during comparison")) and record.exc_info:
            what = "parsing" if text.startswith("Error parsing") else "comparison"
            self.gave_up.append(f"{type(record.exc_info[1]).__name__} during {what}")

    def parser_gave_up(self, exc: BaseException) -> None:
        self.gave_up.append(f"{type(exc).__name__} in its LaTeX parser")

    def raise_if_gave_up(self) -> None:
        if self.gave_up:
            raise Undecided(f"math-verify gave up: {self.gave_up[0]}", self.answer)


@contextlib.contextmanager
def watching(answer: Union[str, None] = None) -> Iterator[Watch]:
    """A `Watch` over math-verify while the block runs (one check at a time: a checker process,
    or inline in the caller's thread); `answer`, the text checked, for its `Undecided`."""
    import math_verify.parser as parser

    watch = Watch(answer)
    original = parser.latex2sympy

    def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except (RecursionError, MemoryError) as exc:  # swallowed by extract_latex: told here
            watch.parser_gave_up(exc)
            raise

    logger = logging.getLogger(_LOGGER)
    level, propagate = logger.level, logger.propagate
    parser.parse_latex_cached.cache_clear()  # a cached None would hide a give-up on the same text
    parser.latex2sympy = watched
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # counted here, never printed
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
        logger.propagate = propagate
        parser.latex2sympy = original


@contextlib.contextmanager
def undecided_on_give_up(timeout_s: Union[int, None], answer: str) -> Iterator[Watch]:
    """`watching(answer)`, and an exception math-verify raised on `answer` (asked with
    `raise_on_error`) as `Undecided` naming it."""
    from math_verify.errors import TimeoutException

    with watching(answer) as watch:
        try:
            yield watch
        except MeasurementFailed:
            raise
        except TimeoutException as exc:  # a BaseException: math-verify's SIGALRM bound
            during = str(exc).split(":", 1)[0] or "Timeout"  # "Timeout during parsing: <the whole text>"
            raise Undecided(f"math-verify gave up: timed out after {timeout_s}s ({during})", answer) from None
        except (RecursionError, MemoryError) as exc:
            raise Undecided(f"math-verify gave up: {type(exc).__name__}", answer) from None
        except Exception as exc:  # noqa: BLE001 - raise_on_error: an error inside math-verify on this answer
            raise Undecided(f"math-verify failed: {type(exc).__name__}: {exc}"[:300], answer) from None


_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")  # an escaped \$ (a price) is no delimiter


def as_latex(text: str) -> str:
    """`text` inside `$...$` unless it already has a math delimiter (math-verify reads LaTeX
    only between delimiters; `\\$18.90` is a price, not one)."""
    return text if _MATH_DELIMITER.search(text) else f"${text}$"


def read_gold(gold: str, timeout_s: Union[int, None]) -> list[Any]:
    """math-verify's parse of a gold answer; `TaskUngradable` when it reads no expression from it
    or gives up on it (then no answer could score 1)."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    shown = gold if len(gold) <= 80 else gold[:80] + "..."
    try:
        with watching() as watch:
            parsed = parse(as_latex(gold), parsing_timeout=timeout_s, raise_on_error=True)
            if not any(not isinstance(p, str) for p in parsed) and as_latex(gold) != gold:  # as plain text
                parsed = parse(gold, parsing_timeout=timeout_s, raise_on_error=True) or parsed
    except TimeoutException:
        raise TaskUngradable(f"math-verify cannot read the gold answer {shown!r}: timed out after {timeout_s}s") from None
    except Exception as exc:  # noqa: BLE001 - RecursionError, MemoryError, an error inside it
        raise TaskUngradable(f"math-verify cannot read the gold answer {shown!r}: {type(exc).__name__}") from None
    if watch.gave_up:
        raise TaskUngradable(f"math-verify cannot read the gold answer {shown!r}: {watch.gave_up[0]}")
    if not any(not isinstance(p, str) for p in parsed):
        raise TaskUngradable(f"math-verify reads no expression from the gold answer {shown!r}")
    return list(parsed)


def gold_problem(gold: str, timeout_s: Union[int, None]) -> Union[str, None]:
    """Why math-verify cannot grade against `gold` (None when it can); for `rollout prepare`.
    A plain number is read without parsing (GSM8K's golds are all numbers)."""
    import threading

    if _PLAIN_NUMBER.fullmatch(gold.strip()):
        return None
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None  # math-verify's SIGALRM bound works in the main thread only
    try:
        read_gold(gold, timeout_s)
    except TaskUngradable as exc:
        return str(exc)
    return None
