"""slime's Sample on one side, the wire SampleGroup on the other: the conversions the data
source (pipeline/slime/data_source.py) and slime's add_samples hand-back use.

slime is imported lazily: without it, samples are `LocalSample` (same field names as
`slime.utils.types.Sample`) and rollout output is `LocalRolloutOutput` (same fields as
`RolloutFnTrainOutput`), so local runs and tests need no slime.
"""

from __future__ import annotations

import enum
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from pipeline.schema import Sample, SampleGroup, Status, Task
from pipeline.store.buffer import Entry

# ------------------------------------------------------------ lazy slime import

def _slime_classes() -> tuple[Any, Any, Any] | None:
    """(Sample, DataSource, RolloutFnTrainOutput) from slime, or None when absent."""
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput
        from slime.rollout.data_source import DataSource
        from slime.utils.types import Sample as SlimeSample
    except ImportError:
        return None
    return SlimeSample, DataSource, RolloutFnTrainOutput


_SLIME = _slime_classes()


@dataclass
class LocalSample:
    """No-slime fallback with the field names of `slime.utils.types.Sample`."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: LocalSample.Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    remove_sample: bool = False


@dataclass
class LocalRolloutOutput:
    """No-slime fallback with the fields of `RolloutFnTrainOutput`."""

    samples: list[list[Any]]
    metrics: dict[str, Any] | None = None


SampleClass: Any = _SLIME[0] if _SLIME else LocalSample
_DataSourceBase: Any = _SLIME[1] if _SLIME else object
_OutputClass: Any = _SLIME[2] if _SLIME else LocalRolloutOutput


# -------------------------------------------------------------- conversion

@contextmanager
def _gc_paused() -> Iterator[None]:
    """Build many acyclic containers without the cyclic GC walking them.

    A converted 4k-token sample is three Python lists of ~11k elements in all (slime's Sample
    wants lists), and the GC's traversal of a list visits every element: the gen-0 and gen-1
    collections that the build triggers (one per ~700 tracked objects) walked each new list
    about twice, a quarter to a third of get_samples' CPU time (docs/benchmarks.md, trainer hand-off).
    Nothing built here can form a cycle (lists of ints and floats, fresh dicts), so collections
    are paused for the build and what was built is then moved to the oldest generation without
    a walk (`gc.freeze()` + `gc.unfreeze()`: two list splices), where only a full collection
    looks at it; it is freed by reference counting either way. The process's other young
    objects move with it (a cycle among them waits for the next full collection). Skipped when
    the process has frozen objects of its own: unfreeze would thaw them too. Once seen, that is
    remembered: `gc.get_freeze_count()` walks the frozen list (O(n)), and a process whose arq
    workers froze their ~1M startup objects (workers/settings.py) spent ~25 ms a group in it
    (the learning harness: ~40% of a run's wall time went to this one call).
    """
    global _foreign_freeze
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        # our own freeze + unfreeze leaves the frozen list empty, so the count is O(1) until
        # somebody else freezes
        _foreign_freeze = _foreign_freeze or gc.get_freeze_count() > 0
        if not _foreign_freeze:
            gc.freeze()
            gc.unfreeze()
        gc.enable()


_foreign_freeze = False  # this process was seen holding frozen objects of its own (they stay frozen)


def to_trainer_group(entry: Entry, group_index: int) -> list[Any]:
    """One wire group -> n trainer Samples with contiguous group_index/index."""
    with _gc_paused():
        return _to_trainer_group(entry, group_index)


def _to_trainer_group(entry: Entry, group_index: int) -> list[Any]:
    group = entry.group
    n = group.n_samples
    pipeline_meta = {
        "group_id": group.group_id,
        "task_id": group.task_id,
        "env": group.env,
        "admission_version": group.admission_version,
        "stream_id": entry.stream_id,
        "worker_id": group.worker_id,
        "epoch": group.epoch,
        "attempt": group.attempt,
        "policy_run": next((x.policy_run for x in group.samples if x.policy_run), 0),
        # the whole task (label, metadata): a group slime hands back may still be requeued
        "task": msgspec.to_builtins(group.task),
    }
    out = []
    for j, s in enumerate(group.samples):
        metadata = dict(s.metadata)
        metadata["pipeline"] = pipeline_meta
        metadata["reward_components"] = s.reward_components
        metadata["source_name"] = group.env  # slime's per-source rollout metrics group by it
        metadata["engine_weight_versions"] = list(s.weight_versions)  # the engine's own labels
        # each response token's policy version (run-length pairs): the drift per lag reads it (pipeline/learning/drift.py)
        metadata["token_version_runs"] = [list(run) for run in s.token_version_runs]
        sample = SampleClass(
            group_index=group_index,
            index=group_index * n + j,
            prompt=s.prompt,
            tokens=s.token_array().tolist(),
            response=s.response,
            response_length=s.response_length,
            label=s.label,
            reward=s.reward,
            loss_mask=mask_list(s.loss_mask_array()),
            # policy versions (steps) per generate call, not the engine's push counter: what
            # staleness and importance weights are about (docs/architecture.md)
            weight_versions=[str(v) for v in s.policy_versions] or list(s.weight_versions),
            rollout_log_probs=s.log_prob_array().tolist(),
            status=SampleClass.Status(s.status.value),
            metadata=metadata,
        )
        # A failed episode (environment or engine down past its budget) says nothing about the
        # policy: slime zeroes the loss mask of a removed sample, so its tokens are not trained
        # on with the reward 0 they got. (slime's own normalisation still counts its reward in
        # the group's mean/std; `post_process_rewards` leaves it out.)
        sample.remove_sample = s.status is Status.FAILED
        out.append(sample)
    return out


def mask_list(mask: np.ndarray) -> list[int]:
    """`mask.tolist()` built from its runs: a loss mask is a few runs of 1s (model turns) and
    0s (observations), and `[v] * run` costs a fraction of one int object per element."""
    if mask.size == 0:
        return []
    if mask.all():  # single-turn episodes: one run
        return [1] * mask.size
    bounds = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), mask.size]
    out: list[int] = []
    for begin, end in zip(bounds, bounds[1:]):
        out += [int(mask[begin])] * (end - begin)
    return out


def from_trainer_group(samples: list[Any]) -> SampleGroup:
    """Trainer Samples handed back by slime (add_samples) -> a wire group."""
    meta = samples[0].metadata.get("pipeline", {})
    wire = []
    for s in samples:
        metadata = {
            k: v for k, v in s.metadata.items()
            if k not in ("pipeline", "reward_components", "source_name", "engine_weight_versions", "token_version_runs")
        }
        status = s.status.value if isinstance(s.status, enum.Enum) else str(s.status)
        wire.append(
            Sample.build(
                tokens=s.tokens,
                response_length=s.response_length,
                loss_mask=s.loss_mask if s.loss_mask is not None else [1] * s.response_length,
                rollout_log_probs=s.rollout_log_probs or [0.0] * s.response_length,
                reward=float(s.reward or 0.0),
                status=status if status != "pending" else Status.ABORTED,
                reward_components=s.metadata.get("reward_components", {}),
                weight_versions=list(s.metadata.get("engine_weight_versions", s.weight_versions)),
                policy_versions=[int(v) for v in s.weight_versions if str(v).lstrip("-").isdigit()]
                if "engine_weight_versions" in s.metadata else [],
                policy_run=int(meta.get("policy_run", 0)),
                token_version_runs=[(int(v), int(n)) for v, n in s.metadata.get("token_version_runs", [])],
                prompt=s.prompt,
                response=s.response,
                label=s.label,
                metadata=metadata,
            )
        )
    task = _task_of(meta, samples[0].prompt)
    return SampleGroup(
        group_id=meta.get("group_id", f"returned:{time.time_ns()}"),
        task=task,
        admission_version=int(meta.get("admission_version", 0)),
        n_samples=len(wire),
        samples=wire,
        worker_id=meta.get("worker_id", ""),
        epoch=int(meta.get("epoch", 0)),
        attempt=int(meta.get("attempt", 0)),
    )


def _task_of(meta: dict[str, Any], prompt: Any) -> Task:
    if "task" in meta:
        return msgspec.convert(meta["task"], Task)
    return Task(id=meta.get("task_id", "unknown"), env=meta.get("env", "unknown"), prompt=prompt or "?")
