"""Small timing helpers shared by the benchmark sections."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def best_per_call(fn: Callable[[], Any], *, calls: int, repeats: int = 5) -> float:
    """Seconds per call of `fn`: the best of `repeats` loops of `calls` calls (least noisy on a shared box)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("inf")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, int(q) - 1))]
