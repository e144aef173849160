"""Off-policy control: the admission bound and the consumption-side staleness check.

With batch size B (groups per step), staleness bound eta and policy version v
(training steps done), at most (eta + v + 1) * B groups may ever be admitted for
training; groups that left without training (stale, filtered, failed) give their
slot back. eta = 0 is synchronous training.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Set
from typing import TypeVar

GroupId = TypeVar("GroupId", bound=Hashable)


class StalePolicy(str, enum.Enum):
    REQUEUE = "requeue"  # hand the task back to the producer for a fresh group
    DROP = "drop"  # discard the group
    KEEP = "keep"  # train on it anyway, but count it


class ConsumeOrder(str, enum.Enum):
    """Which groups a training step takes (docs/architecture.md "Off-policy control")."""

    # A group admitted at clock a is due at step a + eta: each step takes every due group first
    # (waiting, bounded, for those still generating), then the oldest others. With the admission
    # bound this trains every group within eta versions and discards none.
    DUE_FIRST = "due-first"
    # First come, first served; a group past eta at consumption goes to `StalePolicy`. Long
    # groups finish last and are the ones discarded: wasted tokens and a length bias.
    ARRIVAL = "arrival"


def due_clock(rollout_id: int, eta: int) -> int:
    """The highest admission clock due at step `rollout_id`: a group admitted against
    `{ns}:version` = a is due at step a + eta, the last step whose lag stays <= eta."""
    return rollout_id - eta


def places_to_keep(clock_of: Mapping[GroupId, int], ready: Set[GroupId], *, rollout_id: int, batch_size: int, eta: int) -> int:
    """Due-first: how many places step `rollout_id` keeps for groups still generating. A group of
    admission clock t must be trained by step t + eta and each later step takes `batch_size`, so
    of the R(t) open groups with clock <= t, at least R(t) - (t + eta - rollout_id) * batch_size
    must come from this step; the places kept are the most, over t, of those not `ready` yet.
    `clock_of`: open group id -> admission clock; `ready`: the ids this step could take now."""
    by_clock: dict[int, tuple[int, int]] = {}
    for gid, clock in clock_of.items():
        total, here = by_clock.get(clock, (0, 0))
        by_clock[clock] = (total + 1, here + (gid in ready))
    reserve = total = here = 0
    for clock in sorted(by_clock):
        total += by_clock[clock][0]
        here += by_clock[clock][1]
        must = total - max(0, clock + eta - rollout_id) * batch_size
        reserve = max(reserve, must - here)
    return reserve


def admission_headroom(*, eta: int, version: int, batch_size: int, admitted: int, discarded: int) -> int:
    """How many more groups a producer may admit now (never negative)."""
    if eta < 0 or batch_size < 1:
        raise ValueError(f"need eta >= 0 and batch_size >= 1, got eta={eta} batch_size={batch_size}")
    live = admitted - discarded  # accepted + in flight (queued, running, buffered)
    return max(0, (eta + version + 1) * batch_size - live)


def staleness(version: int, oldest_version: int) -> int:
    return version - oldest_version


def is_stale(*, version: int, oldest_version: int, eta: int) -> bool:
    return staleness(version, oldest_version) > eta


# ---------------------------------------------------------------- policy versions
#
# A token's version is the policy version (optimizer steps applied) of the weights that
# generated it. The engine's own `weight_version` label cannot tell it: slime's updaters
# count weight pushes of the current trainer process (0, +1 per push, sent as str(n)), so
# the labels restart at "1" after every resume and advance once per push, not per step.
# Instead the slime side publishes, at every rollout, which policy version the engines
# hold (`engine_policy_version`, derived from slime's loop), and workers stamp each
# generate call with the value they read *before* sending it. Weights only move forward
# while a trainer process lives, so the stamp is a lower bound for every token of that
# call (exact unless a push landed between the publish and the call), never an
# overstatement: the lag it yields is >= the true lag.

class TrainerLoop(str, enum.Enum):
    """How slime interleaves generation and weight pushes (docs/architecture.md)."""

    ASYNC = "async"  # train_async.py: generate(r+1) runs while r trains; push after training r, every `interval` steps
    SYNC = "sync"  # train.py: push after every step, whatever --update-weights-interval; engines hold r at generate(r)


def _pushes_after(step: int, interval: int, loop: TrainerLoop) -> bool:
    """Whether slime pushes weights after training `step`. train_async.py tests
    `(rollout_id + 1) % args.update_weights_interval == 0`; train.py calls
    `actor_model.update_weights()` after every step and never reads the interval."""
    return loop is TrainerLoop.SYNC or (step + 1) % interval == 0


def pushed_versions(rollout_id: int, *, start: int, interval: int = 1, loop: TrainerLoop = TrainerLoop.ASYNC) -> list[int]:
    """The policy versions slime has pushed to the engines, in order, when it calls the rollout
    function for `rollout_id` (the last one is what the engines hold).

    `start` is the first rollout id of this trainer process (slime's start_rollout_id), whose
    weights it pushes once before its loop: they hold `start` steps. After training step r,
    train_async.py pushes when `(r + 1) % interval == 0` (`--update-weights-interval`), giving
    version r + 1, and launches generate(r + 2) only after that push, generate(r + 1) before
    training r; train.py pushes after every step (it ignores the interval) and generates r after
    the push that follows step r - 1. tests/conformance/test_conformance_slime.py (`test_slimes_own_loops_stamp_every_group_with_its_true_version`,
    through scripts/oracle/slime_loop.py) runs both files.
    """
    if interval < 1:
        raise ValueError(f"update interval must be >= 1, got {interval}")
    if rollout_id < start:
        raise ValueError(f"rollout {rollout_id} precedes this trainer's first rollout {start}")
    last_trained = _last_trained(rollout_id, loop)
    return [start, *(r + 1 for r in range(start, last_trained + 1) if _pushes_after(r, interval, loop))]


def engine_policy_version(rollout_id: int, *, start: int, interval: int = 1, loop: TrainerLoop = TrainerLoop.ASYNC) -> int:
    """The policy version the engines hold when slime calls the rollout function for `rollout_id`."""
    return pushed_versions(rollout_id, start=start, interval=interval, loop=loop)[-1]


def label_versions(
    rollout_id: int, *, start: int, interval: int = 1, loop: TrainerLoop = TrainerLoop.ASYNC, first_label: int = 1
) -> dict[str, int]:
    """slime's engine labels -> policy versions, for the weights now on the engines and the next push.

    slime's updaters label the k-th push of a trainer process str(k) (counting from
    `--update-weight-start-version` + 1): the label of an answer then tells its version
    exactly, including for tokens generated after a push the trainer has not published yet.
    """
    pushed = pushed_versions(rollout_id, start=start, interval=interval, loop=loop)
    next_step = max(start, _last_trained(rollout_id, loop) + 1)  # the next push follows the first such step
    while not _pushes_after(next_step, interval, loop):
        next_step += 1
    labels = {str(first_label + k): version for k, version in enumerate(pushed)}
    labels[str(first_label + len(pushed))] = next_step + 1
    return labels


def _last_trained(rollout_id: int, loop: TrainerLoop) -> int:
    """The latest step whose weights slime may have pushed before it calls generate(rollout_id)."""
    return rollout_id - (2 if loop is TrainerLoop.ASYNC else 1)


def lag_floor(*, interval: int = 1, loop: TrainerLoop = TrainerLoop.ASYNC) -> int:
    """The smallest lag slime's own loop imposes: eta below it admits nothing and deadlocks.
    train.py generates every batch on the weights of the step before it: no lag at all."""
    return interval if loop is TrainerLoop.ASYNC else 0


def version_on_branch(version: int, run: int, run_starts: dict[int, int], current_run: int) -> int:
    """A version stamped by trainer run `run`, as seen from `current_run`.

    A resumed run restarts from a checkpoint: versions the earlier run reached past that
    checkpoint belong to a branch that was thrown away. Their tokens count as generated by
    the last version both branches share (the smallest start of every later run), which is
    what makes their lag honest; a stamp of the current run (or of no run: 0) is taken as is.
    """
    if run == 0 or run >= current_run:
        return version
    later_starts = [start for r, start in run_starts.items() if run < r <= current_run]
    return min([version, *later_starts])
