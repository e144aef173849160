"""The staleness bound's own throughput ceiling: what no schedule with lag <= eta can beat.

Why there is one (docs/architecture.md, "What the bound costs at small eta"): with the admission
bound saturated, step r trains the B groups admitted at version r - eta, which could start only
once that version was pushed, at the end of step r - eta - 1's training and push. So step r starts
no earlier than S(r - eta - 1) + tau + D(r): tau the trainer's step plus its weight push, D(r) the
time the cohort's longest answer takes to decode. Summed over a long run, the mean period of a step
is at least (tau + E[D]) / (eta + 1), and at least tau (one trainer). The ceiling is the trained
tokens of a step (B x n x the mean answer) over that period: a cohort's longest answer must decode
within eta + 1 trainer steps.

D is bounded below by the longest answer decoded alone: its prompt's prefill, then one decode step
per token at batch 1 (the engine's measured step time at the growing context; a request gains one
token per step whatever else runs), so the figure is a ceiling for every schedule. `step_batch` > 1
(e.g. the engine's mean running batch at capacity) gives the tighter figure of a schedule that keeps
the engine that full while the tail decodes; it is not a bound (the tail then runs slower than it
could alone).

API (one function, one helper):

    from scripts.bench.ceiling import bound_ceiling, binding
    from scripts.bench.peer_contenders import WORKLOADS
    c = bound_ceiling(WORKLOADS["areal-7b"], eta=2)
    c.tokens_per_s        # trained tokens per ENGINE-CLOCK (simulated) second, as capacity is counted
    c.wall_tokens_per_s   # x the workload's time scale: per wall second of the scaled run
    c.describe()          # one line: the ceiling, the period, the tail, which side sets the period
    ref, which = binding(capacity_tokens_per_s, c)  # the lower of the two; "capacity" or "bound"

`lengths`: answer lengths to use instead of the workload's lognormal (e.g. the engine's own plan,
`peer_contenders.length_plan(wl, tasks)`); `prompt_tokens`: the prompt before the answer (the
math tasks: tens of tokens); `push_s`: the weight push's GPU time (default the simulator's:
model bytes / 25 GB/s; 0 without a model). Workloads without a measured model (`Workload.model`
empty) decode `token_latency_s` a token. `python -m scripts.bench.ceiling [--workload NAME]`
prints the ceiling at eta 0, 1, 2, 4, 8.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scripts.bench.peer_contenders import Workload

QUANTILE_POINTS = 4000  # the lognormal as this many equally likely lengths
CONTEXT_GRID = 64  # tokens between the points the tail's decode time is integrated on
DEFAULT_PUSH_GBPS = 25.0  # workers/sim/engine.py SimConfig.weight_push_gbps


@dataclass(frozen=True)
class Ceiling:
    eta: int
    tokens_per_s: float  # trained tokens per engine-clock second
    period_s: float  # the least mean time per step
    tau_s: float  # the trainer's step plus its weight push
    tail_s: float  # E[the cohort's longest answer: prefill + decode], engine clock
    tail_tokens: float  # E[the cohort's longest answer], tokens
    mean_tokens: float  # E[an answer], tokens
    cohort: int  # answers per step (B x n)
    time_scale: float = 1.0
    step_batch: int = 1

    @property
    def trainer_bound(self) -> bool:
        """True where the trainer's own step sets the period, not the tail's decode."""
        return self.tau_s >= (self.tau_s + self.tail_s) / (self.eta + 1)

    @property
    def wall_tokens_per_s(self) -> float:
        return self.tokens_per_s * self.time_scale

    def describe(self) -> str:
        side = ("the trainer's step (tau)" if self.trainer_bound
                else f"the tail: (tau + tail) / (eta + 1) = ({self.tau_s:.1f} + {self.tail_s:.1f}) / {self.eta + 1}")
        batch = "alone (batch 1)" if self.step_batch == 1 else f"at batch {self.step_batch}"
        return (f"bound ceiling at eta {self.eta}: {self.tokens_per_s:,.0f} tok/s engine clock "
                f"({self.wall_tokens_per_s:,.0f} wall at {self.time_scale:g}x); period {self.period_s:.1f} s set by "
                f"{side}; cohort {self.cohort} answers, mean {self.mean_tokens:,.0f} tok, longest "
                f"E {self.tail_tokens:,.0f} tok decoding {batch} in {self.tail_s:.1f} s")


def binding(capacity_tokens_per_s: float, ceiling: Ceiling) -> tuple[float, str]:
    """The lower of the engine's capacity and the bound's ceiling (same clock), and which it is."""
    if ceiling.tokens_per_s < capacity_tokens_per_s:
        return ceiling.tokens_per_s, "bound"
    return capacity_tokens_per_s, "capacity"


def bound_ceiling(wl: Workload, eta: int, *, lengths: Sequence[int] | None = None, prompt_tokens: int = 0,
                  push_s: float | None = None, step_batch: int = 1) -> Ceiling:
    """The staleness bound's throughput ceiling for workload `wl` at `eta` (module docstring)."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if step_batch < 1:
        raise ValueError(f"step_batch must be >= 1, got {step_batch}")
    values = _answer_lengths(wl, lengths)
    cohort = wl.batch * wl.n
    tail_tokens, tail_s = _expected_tail(values, cohort, _decode_time_fn(wl, prompt_tokens, step_batch, values[-1]))
    tau = wl.train_step_s + (_push_s(wl) if push_s is None else push_s)
    period = max(tau, (tau + tail_s) / (eta + 1))
    mean = float(values.mean())
    return Ceiling(eta=eta, tokens_per_s=cohort * mean / period, period_s=period, tau_s=tau, tail_s=tail_s,
                   tail_tokens=tail_tokens, mean_tokens=mean, cohort=cohort, time_scale=wl.time_scale,
                   step_batch=step_batch)


def _answer_lengths(wl: Workload, lengths: Sequence[int] | None) -> np.ndarray:
    """Equally likely answer lengths, sorted, capped at max_response_len."""
    if lengths is not None:
        values = np.sort(np.minimum(np.asarray(lengths, dtype=np.float64), wl.max_response_len))
        if values.size == 0 or values[0] < 0:
            raise ValueError("lengths must be a non-empty list of token counts >= 0")
        return values
    normal = NormalDist()
    quantiles = [(i + 0.5) / QUANTILE_POINTS for i in range(QUANTILE_POINTS)]
    draws = [math.exp(wl.length_mu + wl.length_sigma * normal.inv_cdf(q)) for q in quantiles]
    return np.minimum(np.asarray(draws), min(wl.max_response_len, wl.max_filler_tokens or wl.max_response_len))


def _expected_tail(values: np.ndarray, cohort: int, decode_time) -> tuple[float, float]:
    """E[the longest of `cohort` answers] and E[its time], each answer one of `values` (sorted,
    equally likely): P(max = values[i]) = ((i+1)/N)^m - (i/N)^m."""
    n = values.size
    cdf = np.arange(1, n + 1, dtype=np.float64) / n
    weights = cdf ** cohort - np.concatenate(([0.0], cdf[:-1])) ** cohort
    return float(weights @ values), float(weights @ decode_time(values))


def _decode_time_fn(wl: Workload, prompt_tokens: int, batch: int, longest: float):
    """Seconds (engine clock) to prefill the prompt and decode x tokens, as a vectorised function:
    the measured step table where the workload plays a model, else `token_latency_s` a token."""
    if not wl.measured_physics:
        return lambda x: np.asarray(x, dtype=np.float64) * wl.token_latency_s
    from workers.sim.physics import load_table

    table = load_table(wl.model, wl.gpu)
    grid = np.arange(0.0, longest + CONTEXT_GRID, CONTEXT_GRID)
    steps = np.array([table.decode_s(batch, int(batch * (prompt_tokens + g))) for g in grid])
    cumulative = np.concatenate(([0.0], np.cumsum((steps[1:] + steps[:-1]) / 2 * CONTEXT_GRID)))
    prefill = table.prefill_s([(prompt_tokens, 0)])  # per sequence since i38s (131afe0)
    return lambda x: prefill + np.interp(np.asarray(x, dtype=np.float64), grid, cumulative)


def _push_s(wl: Workload) -> float:
    """The simulator's weight push: model bytes / 25 GB/s where it plays a model, else 0."""
    if not wl.measured_physics:
        return 0.0
    from workers.sim.physics import load_table

    return load_table(wl.model, wl.gpu).model_bytes / (DEFAULT_PUSH_GBPS * 1e9)


def main(argv: list[str] | None = None) -> int:
    from scripts.bench.peer_contenders import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="areal-7b", choices=sorted(WORKLOADS))
    p.add_argument("--etas", default="0,1,2,4,8")
    p.add_argument("--step-batch", type=int, default=1)
    args = p.parse_args(argv)
    wl = WORKLOADS[args.workload]
    for eta in (int(e) for e in args.etas.split(",")):
        print(bound_ceiling(wl, eta, step_batch=args.step_batch).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
