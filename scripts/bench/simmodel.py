"""The model shared by the async-vs-sync benchmark and the capacity planner.

An engine fleet with a fixed number of generation slots (one episode per slot, a
fixed time per generated token), response lengths drawn from a long-tailed
profile (lognormal, or an empirical list of measured lengths), GRPO groups of n
episodes, B groups per trainer step, and a fixed trainer step time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import numpy as np


class LengthProfile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Response lengths in tokens: lognormal(median, sigma) clipped to [min, max], or `lengths` resampled."""

    median: float = 1500.0
    sigma: float = 0.9
    min_tokens: int = 16
    max_tokens: int = 8192  # max_new_tokens: truncation caps the tail
    lengths: list[int] = []  # measured response lengths; when given, the lognormal is ignored

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.lengths:
            return rng.choice(np.asarray(self.lengths, dtype=np.int64), size=size)
        raw = rng.lognormal(math.log(self.median), self.sigma, size=size)
        return np.clip(np.rint(raw), self.min_tokens, self.max_tokens).astype(np.int64)

    def mean(self) -> float:
        """Expected length (Monte Carlo for the clipped lognormal; exact for an empirical list)."""
        if self.lengths:
            return float(np.mean(self.lengths))
        return float(self.draw(np.random.default_rng(12345), 200_000).mean())

    @classmethod
    def load(cls, path: str | Path) -> LengthProfile:
        """A JSON file: a list of lengths, {"lengths": [...]}, or {"median": .., "sigma": .., "max_tokens": ..}."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"length profile {path}: {exc}") from exc
        if isinstance(data, list):
            data = {"lengths": data}
        try:
            profile = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"length profile {path}: {exc}") from exc
        if profile.lengths and min(profile.lengths) < 1:
            raise ValueError(f"length profile {path}: lengths must be >= 1 token")
        return profile


class SimSetup(msgspec.Struct, kw_only=True):
    slots: int  # generation slots over all engines
    batch_groups: int  # B: groups per trainer step
    n_samples: int  # episodes per group
    token_s: float  # seconds per generated token in one slot
    step_s: float  # trainer step time
    profile: LengthProfile = msgspec.field(default_factory=LengthProfile)

    def mean_episode_s(self) -> float:
        return self.profile.mean() * self.token_s

    def generation_bound(self) -> float:
        """Groups/s the slots can produce when never idle."""
        return self.slots / (self.n_samples * self.mean_episode_s())

    def trainer_bound(self) -> float:
        return self.batch_groups / self.step_s

    def throughput_bound(self) -> float:
        """The work-conserving bound: neither slots nor trainer ever wait."""
        return min(self.generation_bound(), self.trainer_bound())

    def utilisation_bound(self) -> float:
        """Slot utilisation at the work-conserving bound (1.0 when generation is the bottleneck)."""
        return self.throughput_bound() / self.generation_bound()

    def group_lengths(self, group_index: int, seed: int) -> np.ndarray:
        """The lengths of group `k`, the same in every mode compared (seeded per group)."""
        return self.profile.draw(np.random.default_rng([seed, group_index]), self.n_samples)
