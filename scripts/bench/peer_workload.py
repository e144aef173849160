"""What the peer benchmark (scripts/bench/peer.py) runs and what it counts: the workload every
contender runs (`Workload`, `WORKLOADS`), the contenders' names, and one run's counts (`Result`).
The contenders themselves: scripts/bench/peer_contenders.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONTENDERS = {
    "a": "slime sync generate_rollout",
    "b": "slime partial rollout + over-sampling",
    "c": "slime fully_async_rollout",
    "d": "this pipeline (Redis, arq workers)",
    "e": "in-process mode (slime sync + workers.inslime.generate)",
}


@dataclass
class Workload:
    """What every contender runs: Workload() is issue 25's (32 slots, 4 ms a token, lognormal
    lengths, 0.4 s trainer step); WORKLOADS["areal-7b"], the bench's default, is taken from a
    published 7B run (docs/benchmarks.md, "The workload and its sources"). Times are real seconds;
    `time_scale` divides the engine's per-token time and the trainer's step alike (the only
    thing it changes), and every figure printed with it says so."""

    steps: int = 12
    batch: int = 8  # B groups per step
    n: int = 4  # samples per group
    train_step_s: float = 0.4
    token_latency_s: float = 0.004  # per output token of one request, at time scale 1
    latency_sigma: float = 0.5  # the per-request speed draw of the simulator (0: none)
    length_mu: float = 4.0  # lognormal filler tokens: median exp(4) ~ 55
    length_sigma: float = 1.0
    max_filler_tokens: int = 2048
    max_response_len: int = 1024
    slots: int = 32  # engine: concurrent generations
    concurrency: int = 32  # slime: sglang_server_concurrency (x 1 engine)
    eta: int = 2  # the pipeline's staleness bound
    # the pipeline's worker concurrency in groups (0: 4 x slots / n = 128 requests for 32 slots; at
    # eta 8 over 36 steps, 16 groups: 4315 trained tok/s, 32: 5188, 48: 4721, one run each; a group
    # holds its worker while its last sample runs, so 16 left the engine at 0.72 slot use)
    groups_in_flight: int = 0
    # the engine's --enable-priority-scheduling (every contender's engine): slime's requests carry
    # no priority (FCFS as without it), the pipeline's carry their group's clock (due first)
    priority_scheduling: bool = True
    seed: int = 0
    time_scale: float = 1.0
    name: str = "issue25"
    # the model and GPU the engine plays, where the engine has measured physics (SimConfig.model:
    # SGLang's step loop with aiconfigurator's step times and KV pool; issue 31); there the
    # engine's --max-running-requests is `engine_max_running` (0: SGLang's default from the KV
    # pool) and `slots` stays the unit of fully async's concurrency; an engine without it runs
    # `token_latency_s` per token of each request and caps running requests at `slots`
    model: str = ""
    gpu: str = "h100_sxm"
    engine_max_running: int = 0
    # engines behind one router (issue 38 item 4): 1 is the engine itself; more run one process
    # each behind sglang-router (slime's router), every contender's requests through it
    engines: int = 1
    # how every contender's weight push treats running requests (pipeline/slime/weight_push.py): abort
    # (slime's default: answered, resumed by the client, re-prefilled), retract or in_place (kept)
    push_mode: str = "abort"

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"Workload.time_scale must be > 0, got {self.time_scale!r}")

    @property
    def train_sleep_s(self) -> float:
        """The trainer's step as the bench sleeps it: train_step_s on the scaled clock."""
        return self.train_step_s / self.time_scale

    @property
    def request_timeout_s(self) -> float:
        """Client timeout: 60 s, or ten times the longest answer's decode on the scaled clock."""
        return max(60.0, 10 * self.max_response_len * self.token_latency_s / self.time_scale)

    @property
    def measured_physics(self) -> bool:
        """True where the engine plays `model` on its measured step times (it has SimConfig.model)."""
        from dataclasses import fields

        from workers.sim.engine import SimConfig

        return bool(self.model) and "model" in {f.name for f in fields(SimConfig)}

    def engine_args(self, tasks: str) -> list[str]:
        common = ["--length-mu", str(self.length_mu), "--length-sigma", str(self.length_sigma),
                  "--max-filler-tokens", str(self.max_filler_tokens), "--weight-version", "0",
                  "--seed", str(self.seed), "--tasks", tasks,
                  *(["--enable-priority-scheduling"] if self.priority_scheduling else [])]
        if self.measured_physics:
            return [*common, "--model", self.model, "--gpu", self.gpu, "--time-scale", str(self.time_scale),
                    "--slots", str(self.engine_max_running)]
        return [*common, "--token-latency-s", str(self.token_latency_s / self.time_scale),
                "--latency-sigma", str(self.latency_sigma), "--slots", str(self.slots)]

    def describe(self) -> str:
        scale = f"time scale {self.time_scale:g}x (engine and trainer alike)" if self.time_scale != 1 else "time scale 1x"
        engine = (f"engine: SGLang's step loop playing {self.model} on {self.gpu} (aiconfigurator step times, KV pool; "
                  f"--max-running-requests {self.engine_max_running or 'default'}), {self.slots} requests the unit of "
                  "fully async's concurrency" if self.measured_physics else
                  f"engine: per-request speed, {self.slots} slots, {self.token_latency_s * 1e3:.1f} ms a token "
                  f"(speed draw sigma {self.latency_sigma:g}), prefill free")
        return (f"workload {self.name}: B={self.batch} groups x n={self.n} per step, {self.steps} steps, trainer step "
                f"{self.train_step_s:g} s then a weight push ({self.push_mode} mode); {engine}; lognormal lengths median "
                f"{math.exp(self.length_mu):.0f} sigma {self.length_sigma:g} capped at {self.max_response_len}; {scale}")

    def pipeline_groups(self) -> int:
        """Groups the pipeline's workers hold at once: 4 x slots / n per engine, as a user sizes the
        pool to the fleet (fully async's concurrency is per engine too: slime multiplies it)."""
        return self.groups_in_flight or max(1, 4 * self.slots * self.engines // self.n)


# The default benchmark workload, from AReaL's published 7B math run (AReaL v0.2 "boba" recipe:
# R1-Distill-Qwen-7B, 512 prompts x 16 responses a step, max generation 27K tokens, truncation
# below 5 %; AReaL v0.3: the same model and data, 1000 PPO steps on 24 nodes in 57.7 h synchronous,
# 25.4 h asynchronous), scaled down in prompts per step (512 prompts on 192 GPUs: 2.7 per GPU; one
# simulated engine is one GPU: B = 3) and in steps, never in lengths. Sources, the numbers and the
# assumptions (the trainer step, the length median, the slots): docs/benchmarks.md.
AREAL_7B_MAX_RESPONSE = 27 * 1024
WORKLOADS: dict[str, Workload] = {
    "issue25": Workload(),
    "areal-7b": Workload(
        name="areal-7b", steps=12, batch=3, n=16,
        train_step_s=91.4,  # 25.4 h / 1000 steps, asynchronous AReaL (trainer-paced: balanced workers)
        token_latency_s=0.0275,  # aiconfigurator 0.12 Qwen/Qwen3-8B h100_sxm sglang decode step, batch 48 x 9,000 context
        latency_sigma=0.0,  # no per-request speed draw (issue 31)
        length_mu=math.log(AREAL_7B_MAX_RESPONSE / math.exp(1.645)),  # median 5,336: 5 % above 27K at sigma 1
        length_sigma=1.0, max_filler_tokens=AREAL_7B_MAX_RESPONSE, max_response_len=AREAL_7B_MAX_RESPONSE,
        slots=36, concurrency=36,  # ~330k KV tokens (H100, Qwen3-8B bf16) / ~9k tokens a request
        model="Qwen/Qwen3-8B", gpu="h100_sxm", time_scale=50.0),
}


@dataclass
class Result:
    contender: str
    name: str
    label: str = ""  # the frontier point ("sync", "fa 2x", "eta 4")
    eta: int = -1  # the pipeline's bound (-1: none)
    concurrency: int = 0
    repeat: int = 0
    ran: bool = False
    reason: str = ""  # why it could not run
    steps: int = 0
    groups_per_step: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    groups_per_s: float = 0.0
    trained_tokens_per_s: float = 0.0
    engine_tokens: int = 0
    trained_tokens: int = 0
    carried_tokens: int = 0
    untrained_tokens: int = 0
    lags: list[int] = field(default_factory=list)  # one per trained generate call
    trained_lengths: list[int] = field(default_factory=list)
    planned_lengths: list[int] = field(default_factory=list)  # the engine's plan, first fresh requests in start order
    samples_without_tokens: int = 0
    samples_without_log_probs: int = 0
    slot_samples: list[tuple[float, int]] = field(default_factory=list)  # (s since the loop began, busy slots)
    push_times: list[float] = field(default_factory=list)  # s since the loop began
    resumed_requests: int = 0  # requests that resumed an aborted turn (re-prefill)
    resumed_input_tokens: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, over the loop
    counters: dict[str, int] = field(default_factory=dict)  # the pipeline's Redis counters
    # the engine's own scalar counters at the end (GET /sim/stats): KV pool use, preemptions,
    # retractions, prefill charged, where the engine keeps them (`bench_peer.ENGINE_COUNTERS`)
    engine_stats: dict[str, float] = field(default_factory=dict)
    # the pipeline, per step: the longest episode of the groups it trained (s), and the trainer's
    # step plus weight push (s) (`ceiling_tokens_per_s`)
    cohort_tails_s: list[float] = field(default_factory=list)
    step_overheads_s: list[float] = field(default_factory=list)
    # the engine's simulated seconds per wall second over busy 0.5-s windows (`SlotSampler`)
    clock_rates: list[float] = field(default_factory=list)
    # the steady-state marks (scripts/bench/peer_steady.py): one before the first step and one
    # after each step's rollout: [wall s since the loop began, trained tokens so far, the
    # engines' generated tokens so far, their busy simulated seconds so far]
    step_marks: list[list[float]] = field(default_factory=list)
    # the stock after each step's rollout, in tokens (scripts/bench/peer_steady.py, issue 46): output
    # held by the engines' requests plus what the contender holds finished or requeued, not trained
    stocks: list[float] = field(default_factory=list)
    # `SlotSampler`: [wall s (the marks' clock), the first engine's simulated clock, its busy seconds]
    clock_samples: list[list[float]] = field(default_factory=list)
    # the same for the fleet's other engines (engines 2..N), one list each
    engine_slot_samples: list[list[tuple[float, int]]] = field(default_factory=list)
    engine_clock_samples: list[list[list[float]]] = field(default_factory=list)
    # the steady-state window's own counts (`peer_steady.apply_window`); the whole run's rates
    window: dict[str, float] = field(default_factory=dict)
    run_tokens_per_s: float = 0.0
    run_groups_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)


END_RULE = ("the run ends after its last step for every contender alike: nothing is drained; the engines' "
            "counts are read at once (a request still running is counted on no side), finished groups not yet "
            "trained are carried over, and finished answers of unfinished groups count as never trained")
