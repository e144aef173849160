"""Wire contracts: Task -> PromptJob -> Sample / SampleGroup, and their one codec.

Every object that crosses Redis is a msgspec Struct encoded as msgpack and decoded
with a typed decoder (never pickle). Per-token arrays travel as raw little-endian
bytes (int32 tokens, float32 log-probs, uint8 loss mask): encoding an 8k-token
sample is then a few memcpy's instead of 24k Python objects.

Invariants (docs/architecture.md "Wire contracts") are checked when a group is built
*and* when it is decoded (`SampleGroup.__post_init__` runs in both cases); errors name
the group, the sample index and the field.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np

from pipeline.sampling import sampling_errors, wire_errors
from pipeline.staleness import version_on_branch

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")

Prompt = Union[str, list[dict[str, Any]]]


class SchemaError(ValueError):
    """A wire object violates its contract; the message says which object and field."""


class Status(str, enum.Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class Task(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One line of tasks.jsonl."""

    id: str
    env: str
    prompt: Prompt
    label: Union[str, None] = None
    metadata: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.id:
            raise SchemaError("task: field 'id' is empty")
        if not self.env:
            raise SchemaError(f"task {self.id!r}: field 'env' is empty")
        if isinstance(self.prompt, str):
            if not self.prompt.strip():
                raise SchemaError(f"task {self.id!r}: field 'prompt' is empty")
        elif not self.prompt:
            raise SchemaError(f"task {self.id!r}: field 'prompt' has no messages")
        else:
            for i, message in enumerate(self.prompt):
                if "role" not in message:
                    raise SchemaError(f"task {self.id!r}: prompt[{i}] has no 'role'")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True, frozen=True):
    """SGLang sampling params, restricted to the keys the router forwards (the list:
    docs/configuration.md `rollout.sampling`).

    Types are strict on purpose: SGLang answers 400 to a float where an int belongs; values
    are checked with SGLang's own rules and the router's (pipeline/sampling.py), so a bad one
    fails at load, and a copy made with `msgspec.structs.replace` (which runs `__post_init__`
    but not the type checks) is checked again before it can be sent.
    """

    temperature: Union[float, None] = None
    max_new_tokens: Union[int, None] = None
    top_p: Union[float, None] = None
    top_k: Union[int, None] = None
    min_p: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    presence_penalty: Union[float, None] = None
    repetition_penalty: Union[float, None] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Union[list[int], None] = None
    ignore_eos: Union[bool, None] = None
    skip_special_tokens: Union[bool, None] = None
    no_stop_trim: Union[bool, None] = None
    spaces_between_special_tokens: Union[bool, None] = None  # slime always sends it; SGLang accepts it
    min_new_tokens: Union[int, None] = None
    n: Union[int, None] = None
    sampling_seed: Union[int, None] = None
    json_schema: Union[str, None] = None
    regex: Union[str, None] = None
    ebnf: Union[str, None] = None

    def __post_init__(self) -> None:
        params = self.to_dict()
        errors = wire_errors(params) or sampling_errors(params)  # wire first: SGLang's rules compare numbers
        if errors:  # msgspec reports it with the path (e.g. `$.rollout.sampling`)
            raise SchemaError("; ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        """Only the keys that were set, ready for the `sampling_params` body field."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


def validate_sampling(params: dict[str, Any]) -> list[str]:
    """SGLang's verdict on raw sampling params, plus the pipeline's n == 1 (pipeline/sampling.py)."""
    return sampling_errors(params)


class PromptJob(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One arq job = one GRPO group = one task x n episodes."""

    task: Task
    epoch: int
    n_samples: int
    sampling: SamplingParams = SamplingParams()
    admission_version: int = 0
    enqueued_at: float = 0.0
    attempt: int = 0  # 0 = first admission; k = k-th re-admission of a requeued task (fresh job/group id)

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise SchemaError(f"job {self.job_id}: n_samples must be >= 1, got {self.n_samples}")

    @property
    def job_id(self) -> str:
        """The group id, unique within a namespace (arq's id is `Keys.arq_job_id(job_id)`)."""
        return job_id_for(self.task.id, self.epoch, self.attempt)


def job_id_for(task_id: str, epoch: int, attempt: int = 0) -> str:
    """Deterministic job/group id: arq refuses a second enqueue of a live id.

    A requeued task (its group was rejected stale or failed) is admitted again under
    `{task_id}:{epoch}r{attempt}`: a fresh id, because the old one is also the
    group's dedup key in the buffer and must not block the new group.
    """
    return f"{task_id}:{epoch}" if attempt == 0 else f"{task_id}:{epoch}r{attempt}"


# A failed sample's reward component saying its verifier could not measure it (a checker that died,
# an answer given up on under on_undecided: remove, a gold it cannot read): counted apart from outages.
MEASUREMENT_FAILED = "measurement_failed"


# gc=False on the high-volume wire types: a decoded batch is tens of thousands of structs,
# and tracking them made the cyclic GC re-walk every live group on each full collection
# (the buffer benchmark's read side ran 2-3x slower with them tracked). They never form
# reference cycles: a struct holds strings, numbers, views and plain containers of those.
def _runs_cover(runs: list[tuple[int, int]], response_length: int) -> bool:
    """`Sample.token_version_runs` is empty, or its counts are non-negative and sum to the response."""
    return not runs or (all(count >= 0 for _, count in runs) and sum(count for _, count in runs) == response_length)


class Sample(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One episode, in wire form. Build with `Sample.build(...)` from lists or arrays."""

    # Raw little-endian arrays. Typed memoryview so that decoding is zero-copy: msgspec hands
    # out views into the payload instead of copying ~9 bytes per token (bytes work as input).
    tokens: memoryview  # int32 LE, prompt + response
    response_length: int
    loss_mask: memoryview  # uint8, one per response token
    rollout_log_probs: memoryview  # float32 LE, one per response token (0.0 under mask 0)
    reward: float
    status: Status
    reward_components: dict[str, Any] = {}
    weight_versions: list[str] = []  # the engine's labels, one per generate call (display only)
    # Per generate call, the policy version the engines held (a lower bound, read before the
    # call: pipeline/staleness.py "policy versions"), and the trainer run that published it.
    policy_versions: list[int] = []
    policy_run: int = 0
    # Per response token, the policy version that generated it, run-length encoded in token order:
    # (version, count) pairs covering response_length tokens, version -1 for tokens no policy
    # generated (prompt template, tool output). A call that lived through a weight update under
    # SGLang's in_place / retract pause has tokens of two versions (`meta_info.weight_versions`).
    # Empty: not recorded (no policy clock, or a payload from before issue 32): `token_versions`.
    token_version_runs: list[tuple[int, int]] = []
    prompt: Prompt = ""
    response: str = ""
    label: Union[str, None] = None
    metadata: dict[str, Any] = {}

    @classmethod
    def build(
        cls,
        *,
        tokens: Sequence[int] | np.ndarray,
        response_length: int,
        loss_mask: Sequence[int] | np.ndarray,
        rollout_log_probs: Sequence[float] | np.ndarray,
        reward: float,
        status: Status | str,
        **fields: Any,
    ) -> Sample:
        return cls(
            tokens=memoryview(np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()),
            response_length=int(response_length),
            loss_mask=memoryview(np.asarray(loss_mask, dtype=MASK_DTYPE).tobytes()),
            rollout_log_probs=memoryview(np.asarray(rollout_log_probs, dtype=LOGPROB_DTYPE).tobytes()),
            reward=float(reward),
            status=Status(status),
            **fields,
        )

    # Cheap, zero-copy views. Treat them as read-only.
    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=TOKEN_DTYPE)

    def loss_mask_array(self) -> np.ndarray:
        return np.frombuffer(self.loss_mask, dtype=MASK_DTYPE)

    def log_prob_array(self) -> np.ndarray:
        return np.frombuffer(self.rollout_log_probs, dtype=LOGPROB_DTYPE)

    def token_versions(self) -> np.ndarray:
        """The policy version of each response token (int64; -1: not generated by a policy). A
        sample without runs (older payloads) gives every model token its oldest call stamp."""
        if not self.token_version_runs:
            oldest = min(self.policy_versions, default=-1)
            return np.where(self.loss_mask_array() == 1, oldest, -1).astype(np.int64)
        versions = np.array([v for v, _ in self.token_version_runs], dtype=np.int64)
        counts = np.array([n for _, n in self.token_version_runs], dtype=np.int64)
        if (counts < 0).any() or int(counts.sum()) != self.response_length:
            raise SchemaError(f"field 'token_version_runs' covers {int(counts.sum())} tokens, "
                              f"response_length is {self.response_length}")
        return np.repeat(versions, counts)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_DTYPE.itemsize

    def check(self, where: str) -> None:
        """Raise SchemaError naming `where` (e.g. "group g1 sample 3") on a broken invariant."""
        if len(self.tokens) % TOKEN_DTYPE.itemsize:
            raise SchemaError(f"{where}: field 'tokens' has {len(self.tokens)} bytes, not a multiple of 4 (int32)")
        if len(self.rollout_log_probs) % LOGPROB_DTYPE.itemsize:
            raise SchemaError(
                f"{where}: field 'rollout_log_probs' has {len(self.rollout_log_probs)} bytes, not a multiple of 4 (float32)"
            )
        n = self.response_length
        if n < 0:
            raise SchemaError(f"{where}: field 'response_length' is negative ({n})")
        if n > self.num_tokens:
            raise SchemaError(f"{where}: field 'response_length' is {n} but 'tokens' has only {self.num_tokens}")
        if len(self.loss_mask) != n:
            raise SchemaError(f"{where}: field 'loss_mask' has {len(self.loss_mask)} entries, response_length is {n}")
        n_lp = len(self.rollout_log_probs) // LOGPROB_DTYPE.itemsize
        if n_lp != n:
            raise SchemaError(f"{where}: field 'rollout_log_probs' has {n_lp} entries, response_length is {n}")
        if self.reward != self.reward:  # NaN would poison the group's advantage
            raise SchemaError(f"{where}: field 'reward' is NaN")
        if not _runs_cover(self.token_version_runs, n):
            counts = [count for _, count in self.token_version_runs]
            raise SchemaError(f"{where}: field 'token_version_runs' covers {sum(counts)} tokens with counts {counts[:8]}, "
                              f"response_length is {n} (runs must be non-negative and cover it, or be empty)")


class SampleGroup(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """The unit the buffer stores and the trainer consumes: delivered whole or not at all."""

    group_id: str
    task: Task
    admission_version: int
    n_samples: int
    samples: list[Sample]
    worker_id: str = ""
    timings: dict[str, float] = {}
    epoch: int = 0  # the PromptJob's: a requeued task is re-admitted in the epoch it belongs to
    attempt: int = 0

    def __post_init__(self) -> None:
        samples = self.samples
        if len(samples) != self.n_samples:
            raise SchemaError(
                f"group {self.group_id!r}: field 'samples' has {len(samples)} samples, n_samples is {self.n_samples}"
            )
        # Every invariant of `Sample.check` in one expression per sample (this runs on every decode,
        # ~0.1 us a sample); only a broken group pays for `check`'s per-field message.
        for sample in samples:
            n = sample.response_length
            t = len(sample.tokens)
            if (
                t & 3 or n < 0 or 4 * n > t or len(sample.loss_mask) != n
                or len(sample.rollout_log_probs) != 4 * n or sample.reward != sample.reward
                or (sample.token_version_runs and not _runs_cover(sample.token_version_runs, n))
            ):
                break
        else:
            return
        for i, sample in enumerate(samples):
            sample.check(f"group {self.group_id!r} sample {i}")
        raise AssertionError("SampleGroup: the fast invariant check and Sample.check disagree")  # pragma: no cover

    @property
    def task_id(self) -> str:
        return self.task.id

    @property
    def env(self) -> str:
        return self.task.env

    def token_version_counts(self, run_starts: dict[int, int] | None = None, current_run: int = 0) -> dict[int, int]:
        """Policy version -> how many trained tokens (loss mask 1) of this group it generated,
        each seen from the current run's branch (`version_on_branch`): the per-token lag."""
        counts: dict[int, int] = {}
        starts = run_starts or {}
        for sample in self.samples:
            versions = sample.token_versions()[sample.loss_mask_array() == 1]
            values, numbers = np.unique(versions[versions >= 0], return_counts=True)
            for v, n in zip(values.tolist(), numbers.tolist()):
                seen = version_on_branch(v, sample.policy_run, starts, current_run)
                counts[seen] = counts.get(seen, 0) + n
        return counts

    def oldest_version(self, run_starts: dict[int, int] | None = None, current_run: int = 0) -> int:
        """The oldest policy version that produced any token of this group.

        From the per-call stamps (`Sample.policy_versions`), each seen from the current
        trainer run's branch (`version_on_branch`). A group with no stamp at all (every
        episode failed before generating, or a group built outside the workers) falls back
        to its admission version, the version published when it was admitted.
        """
        starts = run_starts or {}
        versions = [
            version_on_branch(v, sample.policy_run, starts, current_run)
            for sample in self.samples
            for v in sample.policy_versions
        ]
        return min(versions) if versions else self.admission_version

    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


class RequeueReason(str, enum.Enum):
    STALE = "stale"  # the trainer side rejected the group (staleness above eta)
    FAILED = "failed"  # the job ran out of tries for a transient reason (engine down, env budget spent)


class Requeue(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One `{ns}:requeue` entry: a group that left without training, for the producer to re-admit.

    The producer admits `(task, epoch, attempt + 1)`: the task's own epoch, not the one it
    is producing now (else an epoch would miss the task and a later one train it twice),
    and the attempt limit counts per (task, epoch).
    """

    task: Task
    epoch: int
    attempt: int  # of the group handed back
    reason: RequeueReason

    @property
    def group_id(self) -> str:
        return job_id_for(self.task.id, self.epoch, self.attempt)


# ---------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_group_decoder = msgspec.msgpack.Decoder(SampleGroup)
_job_decoder = msgspec.msgpack.Decoder(PromptJob)
_task_decoder = msgspec.msgpack.Decoder(Task)
_requeue_decoder = msgspec.msgpack.Decoder(Requeue)
_task_json_decoder = msgspec.json.Decoder(Task)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # ValidationError is a subclass of DecodeError;
        # msgpack str fields with invalid UTF-8 raise UnicodeDecodeError, which must not crash a reader either
        raise SchemaError(f"undecodable {what}: {exc}") from exc


def decode_group(data: bytes) -> SampleGroup:
    return _decode(_group_decoder, data, "SampleGroup")


def decode_job(data: bytes) -> PromptJob:
    return _decode(_job_decoder, data, "PromptJob")


def decode_task(data: bytes) -> Task:
    return _decode(_task_decoder, data, "Task")


def decode_requeue(data: bytes) -> Requeue:
    return _decode(_requeue_decoder, data, "Requeue")


def decode_task_json(line: str | bytes) -> Task:
    """Decode one tasks.jsonl line; the caller adds file:line to the error."""
    try:
        return _task_json_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise SchemaError(str(exc)) from exc


def encode_task_json(task: Task) -> bytes:
    return msgspec.json.encode(task)
