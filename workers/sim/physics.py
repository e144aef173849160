"""How long the simulated engine's forward passes take, and how much KV memory it has.

Two step models, both deterministic (no per-request draws: every running request gains one token
per step, and the step's length is set by the whole batch):

- `StepTable`: a model on a GPU, measured. The committed tables (workers/sim/step_tables/, made by
  scripts/gen_step_tables.py) hold aiconfigurator-core's numbers for SGLang on that GPU: the decode
  step latency by batch size and context per request (`AicEngine.decode_step_latency`), a prefill
  step's two parts as its `mixed_step_breakdown` splits a batched prefill (what
  `predict_prefill_latency(batch, isl, prefix)` adds up): the layers outside attention, by the
  batch's new tokens in all, and the context attention per sequence, by the batch's size, the
  sequence's new tokens and its cached prefix; and the memory budget (`estimate_kv_cache`: weights,
  activations + runtime reserve, KV bytes per token). A prefill batch of sequences (new tokens n_i
  over cached p_i) takes shared(sum n_i) + sum_i attention(B, n_i, p_i): a batch of 8 x 1,000
  tokens is aiconfigurator's `predict_prefill_latency(8, 1000, 0)`, not one 8,000-token sequence.
  The context and prefix axes reach the model's context length. Values between grid points are
  interpolated linearly (tests/conformance/test_sim_physics.py checks them against aiconfigurator within 10%).
- `FlatSteps`: every decode step lasts `token_latency_s`, prefill costs nothing: the old simulator's
  speed without its per-request lognormal draw, for tests that only need requests in flight.

The KV pool is sized as SGLang sizes it: `--mem-fraction-static` of the GPU's memory (SGLang's own
default from its memory_hook.py when not given) minus weights and reserve, in KV tokens.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol

TABLE_DIR = Path(__file__).resolve().parent / "step_tables"
AIC_BACKEND = "sglang"
AIC_DATABASE = "0.5.14"  # aiconfigurator-core 0.12.0's SGLang database on h100_sxm / h200_sxm
DECODE_BATCHES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024]
# the context and prefix axes go on to the model's context length (scripts/gen_step_tables.py adds it)
DECODE_CONTEXTS = [64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
PREFILL_TOKENS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_PREFIXES = [0, 512, 2048, 8192, 16384, 32768]
PREFILL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GIB = 1 << 30


class StepModel(Protocol):
    def decode_s(self, batch: int, kv_tokens: int) -> float:
        """Seconds of one decode step of `batch` requests holding `kv_tokens` KV tokens in all."""
        ...

    def prefill_s(self, seqs: Sequence[tuple[int, int]]) -> float:
        """Seconds of one prefill step over `seqs`: per sequence, (new tokens, cached prefix tokens)."""
        ...


@dataclass(frozen=True)
class FlatSteps:
    """Every decode step lasts `token_latency_s`; prefill is free (tests, never benchmarks)."""

    token_latency_s: float

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        return self.token_latency_s

    def prefill_s(self, seqs: Sequence[tuple[int, int]]) -> float:
        return 0.0


@dataclass(frozen=True)
class ScaledSteps:
    """Another step model's steps, each `factor` times as long: a slower engine per token (the
    learning bench stretches the tiny answers' generation to a real run's share of a step,
    docs/benchmarks.md "The user's clock")."""

    steps: StepModel
    factor: float

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        return self.steps.decode_s(batch, kv_tokens) * self.factor

    def prefill_s(self, seqs: Sequence[tuple[int, int]]) -> float:
        return self.steps.prefill_s(seqs) * self.factor


def table_path(model: str, gpu: str, tp: int) -> Path:
    return TABLE_DIR / f"{model.replace('/', '--')}--{gpu}--tp{tp}.json"


def available_tables() -> list[str]:
    return sorted(p.stem for p in TABLE_DIR.glob("*.json"))


@cache
def load_table(model: str, gpu: str, tp: int = 1) -> StepTable:
    path = table_path(model, gpu, tp)
    if not path.exists():
        raise ValueError(f"no step-time table for model {model!r} on {gpu!r} with tp {tp} ({path.name} is not in "
                         f"workers/sim/step_tables/: {', '.join(available_tables())}); "
                         "make one with scripts/gen_step_tables.py")
    raw = json.loads(path.read_text())
    return StepTable(
        model=raw["model"], gpu=raw["gpu"], tp=int(raw["tp"]), source=raw["source"],
        gpu_memory_bytes=int(raw["gpu_memory_bytes"]), weights_bytes=int(raw["weights_bytes"]),
        reserved_bytes=int(raw["reserved_bytes"]), kv_bytes_per_token=int(raw["kv_bytes_per_token"]),
        decode_batches=tuple(raw["decode_batches"]), decode_contexts=tuple(raw["decode_contexts"]),
        decode_ms=tuple(tuple(row) for row in raw["decode_ms"]),
        context_length=int(raw["context_length"]),
        prefill_tokens=tuple(raw["prefill_tokens"]), prefill_prefixes=tuple(raw["prefill_prefixes"]),
        prefill_batches=tuple(raw["prefill_batches"]), prefill_shared_ms=tuple(raw["prefill_shared_ms"]),
        prefill_attn_ms=tuple(tuple(tuple(row) for row in plane) for plane in raw["prefill_attn_ms"]),
    )


@dataclass(frozen=True)
class StepTable:
    model: str
    gpu: str
    tp: int
    source: str
    gpu_memory_bytes: int  # per GPU
    weights_bytes: int  # per GPU (the model's shard under tp)
    reserved_bytes: int  # activations + runtime overhead, per GPU
    kv_bytes_per_token: int  # per GPU
    context_length: int  # the model's (max_position_embeddings): where the context and prefix axes end
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_ms: tuple[tuple[float, ...], ...]  # [batch][context]
    prefill_tokens: tuple[int, ...]
    prefill_prefixes: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    prefill_shared_ms: tuple[float, ...]  # [the batch's new tokens in all]: every layer but attention
    prefill_attn_ms: tuple[tuple[tuple[float, ...], ...], ...]  # [batch][tokens][prefix]: attention, per sequence

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        context = kv_tokens / batch
        return _bilinear(self.decode_batches, self.decode_contexts, self.decode_ms, batch, context) / 1000.0

    def prefill_s(self, seqs: Sequence[tuple[int, int]]) -> float:
        seqs = [(n, p) for n, p in seqs if n > 0]
        if not seqs:
            return 0.0
        shared = _linear(self.prefill_tokens, self.prefill_shared_ms, sum(n for n, _ in seqs))
        # attention per sequence, read at this batch's size (a batch's kernels share the GPU)
        i, t = _segment(self.prefill_batches, len(seqs), extrapolate=False)
        low, high = self.prefill_attn_ms[i], self.prefill_attn_ms[i + 1]
        attn = sum((1 - t) * _bilinear(self.prefill_tokens, self.prefill_prefixes, low, n, p)
                   + t * _bilinear(self.prefill_tokens, self.prefill_prefixes, high, n, p) for n, p in seqs)
        return (shared + attn) / 1000.0

    @property
    def model_bytes(self) -> int:
        """The whole model's weights (every tp shard): what a weight push moves."""
        return self.weights_bytes * self.tp

    def default_mem_fraction(self, chunked_prefill_size: int) -> float:
        return sglang_mem_fraction_static(self.gpu_memory_bytes, chunked_prefill_size, self.tp)

    def kv_pool_tokens(self, mem_fraction: float) -> int:
        """SGLang's `max_total_num_tokens`: the KV pool left by weights and reserve."""
        free = self.gpu_memory_bytes * mem_fraction - self.weights_bytes - self.reserved_bytes
        if free <= 0:
            raise ValueError(f"{self.model} does not fit on {self.gpu} x tp {self.tp} at mem fraction {mem_fraction}")
        return int(free // self.kv_bytes_per_token)


def sglang_mem_fraction_static(gpu_memory_bytes: int, chunked_prefill_size: int, tp: int) -> float:
    """SGLang 0.5.23's default --mem-fraction-static (arg_groups/memory_hook.py,
    `_handle_gpu_memory_settings`, a GPU of 60-160 GB with CUDA graphs, no DP attention):
    reserve 512 MB + 1.5 MB per activation token + tp/8 GB + 2 MB per CUDA-graph batch slot
    (256 below tp 4, else 512), at least 10 GB."""
    gpu_mb = gpu_memory_bytes / (1 << 20)
    graph_bs = 256 if tp < 4 else 512
    reserved = 512 + max(chunked_prefill_size, 2048) * 1.5 + tp / 8 * 1024 + graph_bs * 2
    if gpu_mb > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mb - reserved) / gpu_mb, 3)


def sglang_max_running_requests(pool_tokens: int, context_length: int) -> int:
    """SGLang's default max_running_requests (mem_cache/kv_cache_configurator.py,
    `resolve_max_num_reqs`): pool / context x 512, within [2048, 4096], at most pool / 2."""
    estimated = max(min(int(pool_tokens / context_length * 512), 4096), 2048)
    return max(1, min(estimated, pool_tokens // 2))


def _bilinear(xs: tuple[int, ...], ys: tuple[int, ...], grid: tuple[tuple[float, ...], ...], x: float, y: float) -> float:
    """Linear in each axis; beyond the first axis's last point the last segment's slope goes on
    (latency keeps growing with batch and tokens), the second axis is clamped."""
    i, tx = _segment(xs, x, extrapolate=True)
    j, ty = _segment(ys, y, extrapolate=False)
    row0, row1 = grid[i], grid[i + 1]
    low = row0[j] + (row0[j + 1] - row0[j]) * ty
    high = row1[j] + (row1[j + 1] - row1[j]) * ty
    return max(0.0, low + (high - low) * tx)


def _linear(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Linear between points; beyond the last the last segment's slope goes on."""
    i, t = _segment(xs, x, extrapolate=True)
    return max(0.0, ys[i] + (ys[i + 1] - ys[i]) * t)


def _segment(axis: tuple[int, ...], v: float, *, extrapolate: bool) -> tuple[int, float]:
    """(index of the segment's left point, position in it: 0..1, more when extrapolating)."""
    if v <= axis[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(axis, v) - 1, len(axis) - 2)
    t = (v - axis[i]) / (axis[i + 1] - axis[i])
    return i, t if extrapolate else min(t, 1.0)
