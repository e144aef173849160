"""How far the policy moved between generating a token and training on it: the drift per lag.

Per trained token, its lag is the trainer's version (the steps it has taken when it trains the
token) minus the policy version that generated the token (the token's own version, from
`Sample.token_version_runs`: a call that lived through a weight update has tokens of two
versions, so the per-call label is not used where the per-token one exists). Per lag it reports
what a real run's drift is measured by (docs/benchmarks.md "Learning"):

- `mean_abs_dlogp`: the mean |rollout log-prob - the trainer's current log-prob| per token (at
  lag 0 it is the train/inference mismatch; slime's `train_rollout_logprob_abs_diff` is the same
  difference averaged per sample);
- `share_outside`: the share of tokens whose importance ratio w = exp(current - rollout) lies
  outside |w - 1| <= 0.2 (PPO's usual clip band);
- `tis_clipped`: the share slime's TIS clamps (`vanilla_tis_function`: w clamped to
  [--tis-clip-low, --tis-clip], slime's defaults 0 and 2);
- `ess`: the effective sample size of the weights, (sum w)^2 / (n sum w^2), in (0, 1]: 1 when
  every weight is equal (on-policy), small when a few tokens carry the weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

BAND = 0.2  # |ratio - 1| beyond it counts as outside (PPO's eps_clip)
TIS_CLIP, TIS_CLIP_LOW = 2.0, 0.0  # slime's --tis-clip / --tis-clip-low defaults (slime/utils/arguments.py)


class LagDrift(msgspec.Struct, frozen=True):
    """The drift of the trained tokens of one lag."""

    lag: int
    tokens: int
    mean_abs_dlogp: float
    share_outside: float
    tis_clipped: float
    ess: float


class DriftTally:
    """Trained tokens' (current - rollout) log-prob differences by lag, over any number of steps."""

    def __init__(self) -> None:
        self._by_lag: dict[int, list[np.ndarray]] = {}

    def add_step(self, trainer_version: int, recomputed: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]],
                 loss_masks: Sequence[Sequence[int]], token_versions: Sequence[Sequence[int] | None]) -> None:
        """One step's samples (one entry each, over its response tokens, slime's layout). A
        sample's `token_versions` (one per response token, -1 for tokens no policy generated) may
        be None: its tokens are not counted (no version known)."""
        if not len(recomputed) == len(rollout) == len(loss_masks) == len(token_versions):
            raise ValueError(f"DriftTally.add_step: {len(recomputed)} recomputed, {len(rollout)} rollout, "
                             f"{len(loss_masks)} mask and {len(token_versions)} version rows: one per sample")
        for i, (new, old, mask, versions) in enumerate(zip(recomputed, rollout, loss_masks, token_versions)):
            if versions is None:
                continue
            new_a, old_a, mask_a, ver_a = (np.asarray(x, dtype=np.float64) for x in (new, old, mask, versions))
            if not new_a.shape == old_a.shape == mask_a.shape == ver_a.shape:
                raise ValueError(f"DriftTally.add_step: sample {i} has {new_a.size} recomputed, {old_a.size} rollout "
                                 f"log-probs, {mask_a.size} mask entries and {ver_a.size} token versions")
            keep = (mask_a > 0) & (ver_a >= 0)
            lags = trainer_version - ver_a[keep].astype(np.int64)
            diffs = (new_a - old_a)[keep]
            for lag in np.unique(lags).tolist():
                self._by_lag.setdefault(int(lag), []).append(diffs[lags == lag])

    def table(self, *, band: float = BAND, tis_clip: float = TIS_CLIP, tis_clip_low: float = TIS_CLIP_LOW) -> list[LagDrift]:
        return [lag_drift(lag, np.concatenate(parts), band=band, tis_clip=tis_clip, tis_clip_low=tis_clip_low)
                for lag, parts in sorted(self._by_lag.items())]


def lag_drift(lag: int, diffs: np.ndarray, *, band: float = BAND, tis_clip: float = TIS_CLIP,
              tis_clip_low: float = TIS_CLIP_LOW) -> LagDrift:
    """The figures of one lag from its tokens' (current - rollout) log-prob differences."""
    if diffs.size == 0:
        return LagDrift(lag=lag, tokens=0, mean_abs_dlogp=0.0, share_outside=0.0, tis_clipped=0.0, ess=1.0)
    weights = np.exp(diffs)
    clamped = np.clip(weights, tis_clip_low, tis_clip)
    ess = float(weights.sum() ** 2 / (diffs.size * (weights**2).sum()))
    return LagDrift(lag=lag, tokens=int(diffs.size), mean_abs_dlogp=float(np.abs(diffs).mean()),
                    share_outside=float((np.abs(weights - 1.0) > band).mean()),
                    tis_clipped=float((clamped != weights).mean()), ess=ess)


def token_versions(response_length: int, runs: Sequence[Sequence[int]] | None,
                   call_versions: Sequence[str | int] | None, loss_mask: Sequence[int]) -> list[int] | None:
    """Each response token's policy version: from the per-token runs ((version, count) pairs,
    `Sample.token_version_runs`) where recorded, else one version per model turn (the runs of 1s
    in the mask) from the per-call versions when there is one per turn; None when neither."""
    if runs:
        out = [int(v) for v, n in runs for _ in range(int(n))]
        if len(out) != response_length:
            raise ValueError(f"token_versions: runs cover {len(out)} tokens of a {response_length}-token response")
        return out
    from pipeline.learning.signal_check import turn_runs

    turns = turn_runs(list(loss_mask))
    calls = [int(v) for v in call_versions or [] if str(v).lstrip("-").isdigit()]
    if not turns or len(calls) != len(turns):
        return None
    out = [-1] * response_length
    for version, (begin, end) in zip(calls, turns):
        out[begin:end] = [version] * (end - begin)
    return out


def format_table(rows: Sequence[LagDrift]) -> str:
    """The drift per lag as a markdown table."""
    lines = ["| lag | trained tokens | mean abs dlogp | share outside abs(ratio-1) > 0.2 | TIS-clipped share | ESS / n |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.lag} | {r.tokens} | {r.mean_abs_dlogp:.4f} | {r.share_outside:.2%} | {r.tis_clipped:.2%} | "
                     f"{r.ess:.3f} |")
    return "\n".join(lines)
