"""`rollout plan`: the smallest B (groups per step) at which the engines stay full (issue 46 item 3).

For a workload (the answer lengths, the model and GPU of the engine's step table, n answers per
group), eta, N engines and the trainer's step, it simulates the staleness bound's ideal schedule
(scripts/bench/ideal.py: the engines' own scheduler and physics, instant admission, due-first)
at growing B, doubling then bisecting, and prints the smallest B at which it trains >= 0.95 of N x
one engine's capacity (simulated the same way), or that the trainer binds first: its own limit,
B x n x the mean answer over its step and push, stays below that whatever B. `--step-batch B0`
says the trainer's step was timed at B0 groups and grows with B (a real trainer); without it the
step is the same at every B (the bench's trainer, a sleep), so a large enough B always fills.

    rollout plan --workload areal-7b --eta 2 --engines 1
    rollout plan --model Qwen/Qwen3-8B --gpu h100_sxm --lengths profile.json --n 16 --eta 2 \\
        --engines 4 --step-time 91.4 --step-batch 12 --save advice.json

`--save` writes the advice (pipeline/sizing.py `SizingAdvice`) for `rollout.sizing_advice`: the
producer then warns once when the trainer's B is below it, and scripts/run_slime_grpo.sh does with
ROLLOUT_SIZING_ADVICE.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pipeline.sizing import SizingAdvice
from scripts.bench.ideal import IdealResult, IdealSetup, capacity_tokens_per_s, ideal
from scripts.bench.simmodel import LengthProfile

GOAL = 0.95
MOST_GROUPS = 4096  # the search gives up past this B
PLAN_STEPS = 16  # trainer steps simulated per B tried


@dataclass(frozen=True)
class Trial:
    batch: int
    result: IdealResult
    full_tokens_per_s: float  # N x one engine's capacity

    @property
    def fill(self) -> float:
        return self.result.tokens_per_s / self.full_tokens_per_s

    @property
    def trainer_tokens_per_s(self) -> float:
        s = self.result.setup
        return s.batch * s.n * s.lengths.mean() / s.tau_s

    def row(self) -> str:
        r = self.result
        return (f"| {self.batch} | {r.tokens_per_s:,.0f} | {self.fill:.2f} | {self.trainer_tokens_per_s:,.0f} | "
                f"{r.trainer_idle:.0%} | {r.mean_running:.1f} |")


def at_batch(base: IdealSetup, batch: int, step_batch: int) -> IdealSetup:
    """`base` at B = `batch`; its trainer's step scaled from `step_batch` groups (0: as it is)."""
    step = base.train_step_s * batch / step_batch if step_batch else base.train_step_s
    return dataclasses.replace(base, batch=batch, train_step_s=step)


def trainer_ceiling(base: IdealSetup, step_batch: int) -> float:
    """The most the trainer can train whatever B (tokens/s): its step grows with B from
    `step_batch`, its push does not; infinite where the step is the same at every B."""
    if not step_batch:
        return float("inf")
    return step_batch * base.n * base.lengths.mean() / base.train_step_s


def plan(base: IdealSetup, *, step_batch: int = 0, goal: float = GOAL, capacity: float = 0.0,
         workload: str = "", command: str = "",
         progress: Callable[[Trial], None] | None = None) -> tuple[SizingAdvice, list[Trial]]:
    """The smallest B at which the ideal reaches `goal` of N x capacity (doubling from N, then
    bisecting), with every B tried (`progress` hears of each as it ends); or the advice that the
    trainer binds first."""
    capacity = capacity or capacity_tokens_per_s(base)
    full = base.engines * capacity
    advice = functools.partial(SizingAdvice, eta=base.eta, n=base.n, engines=base.engines,
                               capacity_tokens_per_s=capacity, goal=goal, workload=workload, command=command)
    if trainer_ceiling(base, step_batch) < goal * full:
        return advice(batch=0, ideal_tokens_per_s=0.0, trainer_tokens_per_s=trainer_ceiling(base, step_batch)), []
    trials: dict[int, Trial] = {}

    def fills(batch: int) -> bool:
        trials[batch] = Trial(batch, ideal(at_batch(base, batch, step_batch)), full)
        if progress is not None:
            progress(trials[batch])
        return trials[batch].fill >= goal

    low, high = 0, max(1, base.engines)
    while not fills(high):
        low, high = high, high * 2
        if high > MOST_GROUPS:
            best = max(trials.values(), key=lambda t: t.fill)
            return advice(batch=0, ideal_tokens_per_s=best.result.tokens_per_s,
                          trainer_tokens_per_s=best.trainer_tokens_per_s), sorted_trials(trials)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fills(middle) else (middle, high)
    chosen = trials[high]
    return advice(batch=high, ideal_tokens_per_s=chosen.result.tokens_per_s,
                  trainer_tokens_per_s=chosen.trainer_tokens_per_s), sorted_trials(trials)


def sorted_trials(trials: dict[int, Trial]) -> list[Trial]:
    return [trials[b] for b in sorted(trials)]


def report(advice: SizingAdvice, trials: list[Trial]) -> str:
    lines = [f"workload: {advice.workload}",
             f"one engine's capacity (saturated, simulated): {advice.capacity_tokens_per_s:,.0f} tok/s engine clock; "
             f"N x capacity {advice.engines * advice.capacity_tokens_per_s:,.0f}; goal {advice.goal:g} of it"]
    if trials:
        lines += ["| B (groups/step) | bound's ideal tok/s | of N x capacity | trainer's limit tok/s | trainer idle | "
                  "running per engine |", "|---|---|---|---|---|---|", *(t.row() for t in trials)]
    lines.append(f"advice: {advice.summary()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from scripts.bench.peer_contenders import WORKLOADS

    p = argparse.ArgumentParser(prog="rollout plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--workload", default="areal-7b", choices=sorted(WORKLOADS),
                   help="the base workload: engine, lengths, n, trainer step (default %(default)s)")
    p.add_argument("--model", default="", help="the engine's model (a step table in workers/sim/step_tables/)")
    p.add_argument("--gpu", default="", help="its GPU: h100_sxm or h200_sxm")
    p.add_argument("--lengths", default="", help="answer lengths: JSON list, {\"lengths\": [...]} or "
                   "{\"median\", \"sigma\", \"max_tokens\"} (default: the workload's lognormal)")
    p.add_argument("--n", type=int, default=0, help="answers per group (default: the workload's)")
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--step-time", type=float, default=0.0, help="the trainer's step, s, without the push "
                   "(default: the workload's)")
    p.add_argument("--step-batch", type=int, default=0, help="the B the step time was taken at; it then grows "
                   "with B (default 0: the same step at every B)")
    p.add_argument("--goal", type=float, default=GOAL, help="of N x capacity (default %(default)s)")
    p.add_argument("--steps", type=int, default=PLAN_STEPS, help="trainer steps simulated per B (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="write the advice here (rollout.sizing_advice)")
    p.add_argument("--json", action="store_true", help="print the advice as JSON only")
    args = p.parse_args(argv)
    wl = WORKLOADS[args.workload]
    wl = dataclasses.replace(wl, model=args.model or wl.model, gpu=args.gpu or wl.gpu, n=args.n or wl.n,
                             train_step_s=args.step_time or wl.train_step_s)
    try:
        base = IdealSetup.for_workload(wl, eta=args.eta, batch=1, engines=args.engines, steps=args.steps,
                                       seed=args.seed)
        if args.lengths:
            base = dataclasses.replace(base, lengths=LengthProfile.load(args.lengths))
    except ValueError as exc:
        print(f"rollout plan: {exc}", file=sys.stderr)
        return 2
    described = (f"{wl.model or 'flat'} on {wl.gpu}, lengths {_lengths(base.lengths)}, n {base.n}, eta {base.eta}, "
                 f"{base.engines} engine(s), trainer step {base.train_step_s:g} s"
                 + (f" at B {args.step_batch} (grows with B)" if args.step_batch else " at every B")
                 + f" + push {base.physics.push_s:.2f} s; {base.steps} steps simulated, seed {base.seed}")
    command = "rollout plan " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()

    def tried(trial: Trial) -> None:
        print(f"[plan] B {trial.batch}: {trial.fill:.2f} of N x capacity ({time.monotonic() - started:.0f} s)",
              file=sys.stderr, flush=True)

    advice, trials = plan(base, step_batch=args.step_batch, goal=args.goal, workload=described, command=command,
                          progress=tried)
    if args.save:
        with open(args.save, "wb") as fh:
            fh.write(msgspec.json.format(msgspec.json.encode(advice)))
    print(msgspec.json.encode(advice).decode() if args.json else report(advice, trials))
    return 0


def _lengths(profile: LengthProfile) -> str:
    if profile.lengths:
        return f"{len(profile.lengths)} measured (mean {profile.mean():,.0f})"
    return f"lognormal median {profile.median:,.0f} sigma {profile.sigma:g} capped at {profile.max_tokens:,}"


if __name__ == "__main__":
    raise SystemExit(main())
