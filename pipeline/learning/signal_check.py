"""Fast checks of the training signal: does what the trainer is handed line up token by token
with the policy that generated it? (docs/signal-bugs.md)

They read one step's trainer data (slime's `_convert_samples_to_train_data` output: tokens,
response lengths, loss masks, rollout log-probs) beside the trainer's own recomputed log-probs
of the same tokens under the same policy (slime's `compute_log_prob`, the "old" log-probs).
When nothing is misaligned the two agree to float error on every trained token (3-4e-7 mean on
a CPU in fp32), so one step tells:

- **mismatch**: slime's own `train_rollout_logprob_abs_diff`, i.e. per sample the mean of
  |recomputed - rollout| over its trained tokens, averaged over the step's samples
  (`get_sum_of_sample_mean` with one rollout per sample, divided by the step's sample count as
  slime's `reduce_train_step_metrics` does), overall, for single- and multi-turn samples and per
  model turn. A mask or log-prob shifted by a token, or template tokens trained (their rollout
  log-prob is the 0.0 placeholder), lift it by orders of magnitude.
- **model tokens untrained**: response tokens left out of the loss whose rollout log-prob is
  the policy's own (nonzero and equal to the recompute): tokens the model generated that its
  mask drops (a mask shifted off its turn, a turn lost by the bookkeeping).

What the tokens cannot tell (a reward on the wrong sample, a failed sample trained, a wrong
version stamp) is checked on the samples themselves (`reward_mismatches`, `removal_mismatches`,
`version_mismatches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

# the checks, by the names reports and docs/signal-bugs.md give them
MISMATCH = "mismatch bound"  # train_rollout_logprob_abs_diff over MISMATCH_BOUND
UNTRAINED = "model tokens untrained"  # TokenAudit.model_tokens_untrained
REWARD = "reward check"  # reward_mismatches
REMOVAL = "failed-sample check"  # removal_mismatches
VERSION = "version check"  # version_mismatches
CHECKS = (MISMATCH, UNTRAINED, REWARD, REMOVAL, VERSION)

MISMATCH_BOUND = 1e-5  # sync's measured mismatch is 3-4e-7 (docs/signal-bugs.md): a ~30x margin
TOKEN_MATCH = 1e-4  # one token's |recomputed - rollout| under which its rollout log-prob is the policy's


class TokenAudit(msgspec.Struct, frozen=True):
    """One step's token-level agreement between the trainer's data and its policy."""

    samples: int
    trained_tokens: int
    abs_diff: float  # slime's train_rollout_logprob_abs_diff
    # over the samples whose mask has one trained turn (single-turn episodes, and two-turn ones
    # that ran out of tokens after the first turn's observation) alone (None: none in the step)
    abs_diff_single: float | None
    abs_diff_multi: float | None  # over the samples with more than one trained turn
    abs_diff_by_turn: dict[int, float]  # model turn (1-based run of trained tokens) -> the same mean
    off_policy_trained: int  # trained tokens whose rollout log-prob is not the policy's
    model_tokens_untrained: int  # untrained tokens of kept samples whose rollout log-prob is the policy's

    def failures(self, bound: float = MISMATCH_BOUND) -> dict[str, list[str]]:
        """What this step got wrong, in words, by check ({} when the signal is aligned)."""
        out: dict[str, list[str]] = {}
        figures = {"all samples": self.abs_diff, "one-turn samples": self.abs_diff_single,
                   "multi-turn samples": self.abs_diff_multi,
                   **{f"turn {k}": v for k, v in sorted(self.abs_diff_by_turn.items())}}
        for what, value in figures.items():
            if value is not None and not value <= bound:
                out.setdefault(MISMATCH, []).append(
                    f"train_rollout_logprob_abs_diff over {what} is {value:.3g} > bound {bound:g}")
        if self.model_tokens_untrained:
            out[UNTRAINED] = [f"{self.model_tokens_untrained} model token(s) left out of the loss mask "
                              "(their rollout log-prob is the policy's)"]
        return out


def turn_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of trained tokens: the model turns as the mask marks them."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, v in enumerate([*mask, 0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _sample_mean(diffs: list[tuple[float, int]]) -> float | None:
    """slime's per-rollout mean summed and divided by the sample count: (sum of |d| over the
    sample's trained tokens / its trained-token count, clamped at 1) averaged over samples."""
    if not diffs:
        return None
    return float(sum(total / max(count, 1) for total, count in diffs) / len(diffs))


def audit_tokens(recomputed: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]],
                 loss_masks: Sequence[Sequence[int]], *, match: float = TOKEN_MATCH) -> TokenAudit:
    """One step's audit. Each argument has one entry per sample over its response tokens (slime's
    layout); a sample whose mask is all 0 (removed: slime zeroes a failed sample's mask) counts
    in the mean as slime counts it and is not searched for untrained model tokens."""
    if not len(recomputed) == len(rollout) == len(loss_masks):
        raise ValueError(f"audit_tokens: {len(recomputed)} recomputed, {len(rollout)} rollout and "
                         f"{len(loss_masks)} mask rows: one per sample")
    every: list[tuple[float, int]] = []
    single: list[tuple[float, int]] = []  # samples with one trained turn
    multi: list[tuple[float, int]] = []  # with more than one
    by_turn: dict[int, list[tuple[float, int]]] = {}
    off_policy = untrained = trained = 0
    for i, (new, old, mask) in enumerate(zip(recomputed, rollout, loss_masks)):
        new_a, old_a, mask_a = (np.asarray(x, dtype=np.float64) for x in (new, old, mask))
        if not new_a.shape == old_a.shape == mask_a.shape:
            raise ValueError(f"audit_tokens: sample {i} has {new_a.size} recomputed log-probs, {old_a.size} "
                             f"rollout log-probs and {mask_a.size} mask entries (its response length each)")
        diff = np.abs(new_a - old_a)
        on = mask_a > 0
        entry = (float((diff * mask_a).sum()), int(on.sum()))
        every.append(entry)
        runs = turn_runs(mask_a.tolist())
        (multi if len(runs) > 1 else single).append(entry)
        for k, (begin, end) in enumerate(runs, start=1):
            by_turn.setdefault(k, []).append((float(diff[begin:end].sum()), end - begin))
        trained += entry[1]
        off_policy += int((diff[on] > match).sum())
        if on.any():  # kept samples only: a removed one is masked whole on purpose
            policy_made = (diff <= match) & (old_a != 0.0)
            untrained += int((policy_made & ~on).sum())
    mean = _sample_mean(every)
    return TokenAudit(
        samples=len(every), trained_tokens=trained, abs_diff=mean if mean is not None else 0.0,
        abs_diff_single=_sample_mean(single), abs_diff_multi=_sample_mean(multi),
        abs_diff_by_turn={k: v for k, d in sorted(by_turn.items()) if (v := _sample_mean(d)) is not None},
        off_policy_trained=off_policy, model_tokens_untrained=untrained)


def reward_mismatches(samples: Sequence[Any], grade: Callable[[Any], float]) -> list[str]:
    """Samples whose reward is not what `grade` (the task's grader on the sample's own response
    tokens and label) gives it: a reward negated or attached to another sample."""
    out = []
    for s in samples:
        if getattr(s, "remove_sample", False):
            continue
        expected = grade(s)
        if float(s.reward) != expected:
            out.append(f"sample {s.index}: reward {s.reward}, its response grades {expected}")
    return out


def removal_mismatches(samples: Sequence[Any], loss_masks: Sequence[Sequence[int]]) -> list[str]:
    """A failed sample must be out of the loss (slime's `remove_sample`, mask all 0) and no other
    sample may be: a failed episode's reward 0 says nothing about the policy."""
    out = []
    for s, mask in zip(samples, loss_masks):
        failed = _status(s) == "failed"
        if failed and any(mask):
            out.append(f"sample {s.index}: failed, yet {sum(mask)} of its tokens are trained")
        if not failed and (getattr(s, "remove_sample", False) or not any(mask)):
            out.append(f"sample {s.index}: {_status(s)}, yet removed from the loss")
    return out


def version_mismatches(samples: Sequence[Any], expected: int, *, eta: int = 0) -> list[str]:
    """Under a sync loop at eta 0 every generate call of step r's samples ran on policy version
    r: the versions the samples carry (slime's `weight_versions`) must say so; under eta k, a
    version from r - k to r."""
    out = []
    for s in samples:
        versions = list(getattr(s, "weight_versions", None) or [])
        if not versions or any(not str(v).isdigit() or not 0 <= expected - int(v) <= eta for v in versions):
            seen = f"policy version {expected}" if eta == 0 else f"policy versions {max(0, expected - eta)}..{expected}"
            out.append(f"sample {s.index}: versions {versions}, generated at {seen}")
    return out


def _status(sample: Any) -> str:
    status = sample.status
    return str(getattr(status, "value", status))
