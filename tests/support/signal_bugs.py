"""Signal bugs planted in the pipeline's own code, each where it would really sit
(docs/signal-bugs.md is their table; tests/conformance/test_signal_checks.py runs every one).

A bug is a monkeypatch of one pipeline function by a variant that does what the original does
and then gets one thing wrong, at exactly that layer:

- the samples' conversion, `pipeline.slime.samples._to_trainer_group` (the wire group -> slime's
  Samples: the loss mask, rollout log-probs, reward, `remove_sample` and versions it sets);
- the episode's token bookkeeping, `workers.episode._Trace.add_model` / `add_template` (which
  response tokens are the model's, trained, and which the template's or environment's, not);
- the environment's failure (`workers.sim.arith.TwoTurnArithmetic` with `fail_divisor`), where a
  failed episode reaches the conversion to test the failed-sample mask.

Each names the checks it must trip (pipeline/learning/signal_check.py's, as `StepSignal.failures` of
scripts/oracle/run.py reports them); a bug that tripped none would fail its test.

`LEARNING_BUGS` sit where no signal check looks (what slime computes from the samples, not the
samples): `rollout check-signal`'s learning stage must catch them (tests/scripts/test_check_signal.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.learning.signal_check import MISMATCH, REMOVAL, REWARD, UNTRAINED, VERSION

CONVERSION = "pipeline/slime/samples.py `_to_trainer_group`"
TEMPLATE_TOKENS = "workers/episode.py `_Trace.add_template`"
ADVANTAGES = "pipeline/slime/advantages.py `_normalise`"
LEARNING = "DOES NOT LEARN"  # the learning stage's line (scripts/check_learning.py), for a bug no signal check reads
MODEL_TOKENS = "workers/episode.py `_Trace.add_model`"


@dataclass(frozen=True)
class PlantedBug:
    name: str
    layer: str  # the file and function it sits in
    what: str  # the bug, in words
    caught_by: tuple[str, ...]  # the checks it must trip (at least the first)
    plant: Callable[[Any], None]  # plant(monkeypatch)
    needs_failures: bool = False  # the run must contain failed episodes


def _shift(values: list[Any], by: int, fill: Any) -> list[Any]:
    """`values` moved `by` places right (negative: left), `fill` where nothing moved in."""
    if by > 0:
        return [fill] * by + values[:-by]
    return values[-by:] + [fill] * -by


def _converted(edit: Callable[[list[Any]], None]) -> Callable[[Any], None]:
    """A plant that runs the real conversion, then `edit(samples)` on the group it built."""

    def plant(monkeypatch: Any) -> None:
        import sys

        module = sys.modules["pipeline.slime.samples"]  # the copy bound to slime's classes (the slime fixture)
        original = module._to_trainer_group

        def buggy(entry: Any, group_index: int) -> list[Any]:
            samples = original(entry, group_index)
            edit(samples)
            return samples

        monkeypatch.setattr(module, "_to_trainer_group", buggy)

    return plant


def _each(change: Callable[[Any], None]) -> Callable[[list[Any]], None]:
    def edit(samples: list[Any]) -> None:
        for s in samples:
            change(s)
    return edit


def _mask_shift(by: int) -> Callable[[Any], None]:
    def change(s: Any) -> None:
        s.loss_mask = _shift(list(s.loss_mask), by, 0)
    return change


def _log_prob_shift(by: int) -> Callable[[Any], None]:
    def change(s: Any) -> None:
        s.rollout_log_probs = _shift(list(s.rollout_log_probs), by, 0.0)
    return change


def _negate_reward(s: Any) -> None:
    s.reward = -s.reward


def _reward_of_next(samples: list[Any]) -> None:
    rewards = [s.reward for s in samples]
    for s, reward in zip(samples, rewards[1:] + rewards[:1]):
        s.reward = reward


def _failed_kept(s: Any) -> None:
    s.remove_sample = False


def _removal_inverted(s: Any) -> None:
    s.remove_sample = str(getattr(s.status, "value", s.status)) != "failed"


def _versions_shift(by: int) -> Callable[[Any], None]:
    def change(s: Any) -> None:
        s.weight_versions = [str(int(v) + by) for v in s.weight_versions]
    return change


def _episode(method: str, buggy: Callable[..., None]) -> Callable[[Any], None]:
    def plant(monkeypatch: Any) -> None:
        from workers.episode import _Trace

        monkeypatch.setattr(_Trace, method, buggy)

    return plant


def _template_trained(self: Any, ids: list[int]) -> None:
    """add_template marking the template's / environment's tokens as the model's (mask 1)."""
    self.tokens += ids
    self.mask += [1] * len(ids)
    self.log_probs += [0.0] * len(ids)
    self.token_versions += [-1] * len(ids)


def _first_model_token_masked(self: Any, ids: list[int], log_probs: list[float], versions: list[int]) -> None:
    """add_model leaving each turn's first token out of the loss (an off-by-one on the turn's start)."""
    self.tokens += ids
    self.mask += [0] * min(1, len(ids)) + [1] * max(0, len(ids) - 1)
    self.log_probs += log_probs
    self.token_versions += versions


def _log_probs_one_late(self: Any, ids: list[int], log_probs: list[float], versions: list[int]) -> None:
    """add_model appending each turn's log-probs one token late (the first slot a placeholder)."""
    self.tokens += ids
    self.mask += [1] * len(ids)
    self.log_probs += _shift(list(log_probs), 1, 0.0)
    self.token_versions += versions


BUGS: tuple[PlantedBug, ...] = (
    PlantedBug("mask-right", CONVERSION, "loss mask one token late (right)", (UNTRAINED,),
               _converted(_each(_mask_shift(1)))),
    PlantedBug("mask-left", CONVERSION, "loss mask one token early (left)", (UNTRAINED,),
               _converted(_each(_mask_shift(-1)))),
    PlantedBug("logprobs-right", CONVERSION, "rollout log-probs one token late (right)", (MISMATCH,),
               _converted(_each(_log_prob_shift(1)))),
    PlantedBug("logprobs-left", CONVERSION, "rollout log-probs one token early (left)", (MISMATCH,),
               _converted(_each(_log_prob_shift(-1)))),
    PlantedBug("reward-negated", CONVERSION, "reward of the wrong sign", (REWARD,),
               _converted(_each(_negate_reward))),
    PlantedBug("reward-next-sample", CONVERSION, "each sample gets the next sample's reward (its group's)",
               (REWARD,), _converted(_reward_of_next)),
    PlantedBug("failed-trained", CONVERSION, "a failed sample kept in the loss (`remove_sample` not set)",
               (REMOVAL,), _converted(_each(_failed_kept)), needs_failures=True),
    PlantedBug("good-removed", CONVERSION, "`remove_sample` inverted: good samples out, failed ones in",
               (REMOVAL,), _converted(_each(_removal_inverted)), needs_failures=True),
    PlantedBug("versions-older", CONVERSION, "versions one older than the policy that generated", (VERSION,),
               _converted(_each(_versions_shift(-1)))),
    PlantedBug("versions-newer", CONVERSION, "versions one newer than the policy that generated", (VERSION,),
               _converted(_each(_versions_shift(1)))),
    PlantedBug("template-trained", TEMPLATE_TOKENS, "template / observation tokens marked trained (add_template)",
               (MISMATCH,), _episode("add_template", _template_trained)),
    PlantedBug("model-token-masked", MODEL_TOKENS, "each turn's first model token masked (add_model)", (UNTRAINED,),
               _episode("add_model", _first_model_token_masked)),
    PlantedBug("turn-logprobs-late", MODEL_TOKENS, "each turn's log-probs one token late (add_model)", (MISMATCH,),
               _episode("add_model", _log_probs_one_late)),
)



def _advantages_negated(monkeypatch: Any) -> None:
    """The launcher's reward post-processing (`--custom-reward-post-process-path
    pipeline.slime.data_source.post_process_rewards`) normalising each group to the wrong sign."""
    from pipeline.slime import advantages

    original = advantages._normalise

    def buggy(rewards: Any, kept: Any, scale: bool) -> list[float]:
        return [-a for a in original(rewards, kept, scale)]

    monkeypatch.setattr(advantages, "_normalise", buggy)


LEARNING_BUGS: tuple[PlantedBug, ...] = (
    PlantedBug("advantages-negated", ADVANTAGES, "GRPO advantages of the wrong sign (the group-normalised rewards "
               "slime trains on)", (LEARNING,), _advantages_negated),
)
