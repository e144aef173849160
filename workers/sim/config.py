"""What a simulated engine is told (`SimConfig`: its policy's settings, the hardware it plays,
its limits) and what its hardware makes of that (`engine_physics`: the scheduler's limits, the
step model, a weight push's GPU time). The served engine (workers/sim/core.py) and the schedule
simulations (scripts/bench/ideal.py) both build their physics here."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.sim.physics import FlatSteps, ScaledSteps, StepModel, StepTable, load_table, sglang_max_running_requests
from workers.sim.scheduler import SchedulerConfig

# without a model the pool never limits admission in practice, but stays finite: the prefix cache
# keeps finished requests' tokens until the pool needs them, so its memory is bounded by this
_FLAT_POOL_TOKENS = 1 << 21


@dataclass
class SimConfig:
    accuracy: float = 0.7  # probability that a final answer is right
    tool_use: float = 0.9  # probability to call a tool first when tools are offered
    malformed_rate: float = 0.0  # probability that a tool call is broken JSON
    length_mu: float = 3.5  # lognormal filler length: exp(mu) ~ 33 tokens median
    length_sigma: float = 0.8
    max_filler_tokens: int = 2048
    # Physics (workers/sim/physics.py, workers/sim/scheduler.py). `model` set: SGLang's step loop
    # with that model's measured step times on `gpu` x `tp` (a committed aiconfigurator table);
    # else `token_latency_s` > 0: the same step loop, every decode step that long, prefill free;
    # else instant: every answer at once, no capacity (unit tests).
    model: str = ""  # e.g. Qwen/Qwen3-8B (workers/sim/step_tables/)
    gpu: str = "h100_sxm"  # h100_sxm | h200_sxm
    tp: int = 1
    time_scale: float = 1.0  # simulated seconds per real second (benchmarks on 2 cores run faster clocks)
    token_latency_s: float = 0.0  # without a model: seconds per decode step; 0 = instant
    step_time_factor: float = 1.0  # every step (decode and prefill) this many times as long (ScaledSteps)
    latency_sigma: float = 0.0  # ignored: the per-request speed draw is gone (kept so old configs load)
    slots: int = 256  # --max-running-requests (0: SGLang's default from the KV pool)
    mem_fraction_static: float = 0.0  # 0: SGLang's default for the GPU (physics.sglang_mem_fraction_static)
    kv_pool_tokens: int = 0  # --max-total-tokens; 0: from model, GPU and mem fraction (no model: 2**21)
    chunked_prefill_size: int = 8192  # SGLang's default on 80-160 GB GPUs; -1 = no chunking
    max_prefill_tokens: int = 16384  # SGLang's --max-prefill-tokens default
    # SGLang's --enable-priority-scheduling / --schedule-low-priority-values-first /
    # --priority-scheduling-preemption-threshold
    priority_scheduling: bool = False
    low_priority_values_first: bool = False
    priority_preemption_threshold: int = 10
    weight_push_gbps: float = 25.0  # with a model: a weight update holds the GPU model bytes / this (GB/s); 0 = free
    context_length: int = 32768
    weight_version: str = "default"
    startup_s: float = 0.0  # /health answers 503 (and /generate is refused) this long after start
    seed: int = 0
    tokenizer_path: str = ""  # "" = the shared test tokenizer
    answers: dict[str, str] = field(default_factory=dict)  # question text -> label (from --tasks)
    # the scripted policy plays sliding-puzzle moves (NeMo-RL's SlidingPuzzleEnv games) instead of
    # answering questions (workers/sim/puzzle.py)
    puzzle: bool = False
    # a tiny causal LM checkpoint (workers/sim/tinylm.py) that decides the tokens instead of the
    # scripted policy; "" = the scripted policy. /update_weights_from_disk replaces its weights.
    policy_path: str = ""


@dataclass(frozen=True)
class EnginePhysics:
    """What a `SimConfig` makes of the engine's hardware: the scheduler's limits (KV pool, max
    running requests, chunk budgets, priority rules), the step model and the weight push's GPU
    time. The served engine and the schedule simulations (scripts/bench/ideal.py) build it here."""

    limits: SchedulerConfig
    steps: StepModel
    table: StepTable | None
    mem_fraction: float
    push_s: float  # a weight update's GPU time, simulated seconds (0 without a model)


def engine_physics(c: SimConfig) -> EnginePhysics | None:
    """The physics `c` plays; None in instant mode (no model, no token latency)."""
    table = load_table(c.model, c.gpu, c.tp) if c.model else None
    steps: StepModel | None = table if table is not None else (
        FlatSteps(c.token_latency_s) if c.token_latency_s > 0 else None)
    if steps is None:
        return None
    if c.step_time_factor != 1.0:
        if c.step_time_factor <= 0:
            raise ValueError(f"step_time_factor must be > 0, not {c.step_time_factor}")
        steps = ScaledSteps(steps, c.step_time_factor)
    if c.time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, not {c.time_scale}")
    mem_fraction = c.mem_fraction_static or (table.default_mem_fraction(c.chunked_prefill_size) if table else 0.0)
    pool = c.kv_pool_tokens or (table.kv_pool_tokens(mem_fraction) if table is not None else _FLAT_POOL_TOKENS)
    max_running = c.slots or sglang_max_running_requests(pool, c.context_length)
    limits = SchedulerConfig(kv_pool_tokens=pool, max_running_requests=max_running,
                             chunked_prefill_size=c.chunked_prefill_size, max_prefill_tokens=c.max_prefill_tokens,
                             priority_scheduling=c.priority_scheduling,
                             low_priority_values_first=c.low_priority_values_first,
                             preemption_threshold=c.priority_preemption_threshold, time_scale=c.time_scale)
    push_s = weight_push_s(c, table) if table is not None else 0.0
    return EnginePhysics(limits=limits, steps=steps, table=table, mem_fraction=mem_fraction, push_s=push_s)


def weight_push_s(c: SimConfig, table: StepTable) -> float:
    """A weight update's GPU time: the model's bytes over `weight_push_gbps` (0: free)."""
    return table.model_bytes / (c.weight_push_gbps * 1e9) if c.weight_push_gbps > 0 else 0.0
