"""GRPO reward normalisation that leaves removed samples out, for slime's
`--custom-reward-post-process-path pipeline.slime.data_source.post_process_rewards`.

slime's default normalisation takes every sample of a group into the mean and std,
including the ones handed over with `remove_sample=True` (our failed episodes: an
environment or engine down past its budget). Their tokens get no loss, but their reward
0 still shifts the baseline of their siblings: a group of [1, 1, failed] trains the two
good answers with advantage +0.58 instead of 0. This function computes the same
normalisation as slime (`RolloutManager._post_process_rewards`: mean-centred, divided by
the unbiased std + 1e-6 for grpo/gspo/cispo, only the mean for
reinforce_plus_plus_baseline, nothing when normalisation is off) over the kept samples
of each group; a removed sample gets advantage 0 (its loss mask is zero anyway).

Groups are the runs of equal `group_index` (the data source numbers them contiguously);
samples without one fall back to consecutive runs of `n_samples_per_prompt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

import numpy as np

CENTRED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_SCALED = ("grpo", "gspo", "cispo")
STD_EPS = 1e-6  # slime's


def post_process_rewards(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards to train on), both in `samples`' order, as slime expects."""
    raw = [_reward_value(args, s) for s in samples]
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator not in CENTRED or not getattr(args, "rewards_normalization", True):
        return raw, list(raw)
    scale = estimator in STD_SCALED and getattr(args, "grpo_std_normalization", True)
    out: list[float] = []
    for start, stop in _group_bounds(samples, int(getattr(args, "n_samples_per_prompt", 1) or 1)):
        kept = [not getattr(s, "remove_sample", False) for s in samples[start:stop]]
        out += _normalise(np.asarray(raw[start:stop], dtype=np.float64), np.asarray(kept), scale)
    return raw, out


def _normalise(rewards: np.ndarray, kept: np.ndarray, scale: bool) -> list[float]:
    result = np.zeros_like(rewards)
    if kept.any():
        centred = rewards[kept] - rewards[kept].mean()
        if scale:  # torch's Tensor.std is unbiased; one kept sample has no spread (0, not nan)
            std = centred.std(ddof=1) if kept.sum() > 1 else 0.0
            centred = centred / (std + STD_EPS)
        result[kept] = centred
    return result.tolist()


def _group_bounds(samples: Sequence[Any], n: int) -> list[tuple[int, int]]:
    indices = [getattr(s, "group_index", None) for s in samples]
    if any(i is None for i in indices):
        return [(start, min(start + n, len(samples))) for start in range(0, len(samples), n)]
    bounds, start = [], 0
    for _index, run in groupby(indices):
        size = len(list(run))
        bounds.append((start, start + size))
        start += size
    return bounds


def _reward_value(args: Any, sample: Any) -> float:
    """slime's `Sample.get_reward_value`: a dict reward is read at `--reward-key`."""
    key = getattr(args, "reward_key", None)
    return float(sample.reward[key] if key else sample.reward)
