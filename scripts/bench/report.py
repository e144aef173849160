"""One benchmark figure with its baseline, ratio and goal; printed as one line, stored as JSON."""

from __future__ import annotations

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
