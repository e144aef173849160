"""Off-policy control: the admission bound and the consumption-side staleness check.

With batch size B (groups per step), staleness bound eta and policy version v
(training steps done), at most (eta + v + 1) * B groups may ever be admitted for
training; groups that left without training (stale, filtered, failed) give their
slot back. eta = 0 is synchronous training.
"""

from __future__ import annotations

import enum


class StalePolicy(str, enum.Enum):
    REQUEUE = "requeue"  # hand the task back to the producer for a fresh group
    DROP = "drop"  # discard the group
    KEEP = "keep"  # train on it anyway, but count it


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
