"""The one report type of the benches: a `Figure` (one measured figure with its baseline, ratio
and goal; printed as one line, stored as JSON), and the `Report` of a `rollout bench` run (its
figures, the machine, the time). Every section returns Figures; every bench's JSON file is
written by `write_json`."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec


class Figure(msgspec.Struct, kw_only=True):
    section: str
    name: str  # what was measured
    value: float
    unit: str
    baseline: str = ""  # what it is compared with, measured in the same run
    baseline_value: float = 0.0
    ratio: float = 0.0  # value vs baseline, oriented so that larger is better
    goal: str = ""  # the anchor, in words ("ratio >= 100")
    met: bool | None = None  # None: no goal
    details: dict[str, Any] = {}

    def line(self) -> str:
        text = f"[{self.section}] {self.name}: {self.value:.4g} {self.unit}"
        if self.baseline:
            text += f" | {self.baseline}: {self.baseline_value:.4g} {self.unit} | ratio {self.ratio:.3g}x"
        if self.goal:
            verdict = "MET" if self.met else "NOT MET"
            text += f" | goal {self.goal}: {verdict}"
        return text

    @classmethod
    def failed(cls, section: str, exc: BaseException) -> Figure:
        """What a section that raised reports: one figure with the error (the others still run)."""
        return cls(section=section, name="section failed", value=float("nan"), unit="",
                   details={"error": f"{type(exc).__name__}: {exc}"})


def print_figures(figures: Iterable[Figure]) -> None:
    for figure in figures:
        print(figure.line(), flush=True)


def write_json(path: str | Path, data: Any, *, indent: int | None = 2) -> None:
    """A bench's JSON file: figures (any msgspec Struct) as their fields, anything else JSON cannot
    say as text."""
    Path(path).write_text(json.dumps(data, indent=indent, default=_builtin))


def _builtin(obj: Any) -> Any:
    return msgspec.to_builtins(obj) if isinstance(obj, msgspec.Struct) else str(obj)


class Report(msgspec.Struct, kw_only=True):
    """A `rollout bench` run: its figures, whether it was --quick, its seconds, the machine."""

    quick: bool
    seconds: float
    machine: dict[str, Any]
    figures: list[Figure]

    @property
    def missed(self) -> list[Figure]:
        return [f for f in self.figures if f.met is False]

    def write(self, path: str | Path) -> None:
        write_json(path, self)


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": cpus()}


def cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
