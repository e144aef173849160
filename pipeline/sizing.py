"""The batch size that fills the engines: `rollout plan`'s advice (scripts/bench/sizing.py), as the
pipeline's start and the launcher read it back.

The planner simulates the ideal schedule (scripts/bench/ideal.py) of the workload at eta on N
engines and writes the smallest B (groups per step) at which it trains >= `goal` of N x one
engine's capacity, or that the trainer binds first (its own limit is below that). A run whose
configured B is below the advice leaves the engines partly idle whatever the scheduling: the
producer (`rollout enqueue`, where B is read from `{ns}:trainer`) and scripts/run_slime_grpo.sh
say so once, with the numbers. This module only reads and compares: it runs no simulation.

    python -m pipeline.sizing ADVICE.json --batch 2 --eta 2 --n 16   # prints the advice if B is below it
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec


class SizingAdvice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `rollout plan --save PATH` writes."""

    batch: int  # the smallest B that reaches `goal`; 0: none does (the trainer binds first)
    eta: int
    n: int  # answers per group the workload was planned with
    engines: int
    capacity_tokens_per_s: float  # one engine saturated (simulated), engine clock
    ideal_tokens_per_s: float  # the bound's ideal at `batch` (at the largest B tried where none reaches)
    trainer_tokens_per_s: float  # the trainer's own limit at `batch` (tokens a step / its step and push)
    goal: float = 0.95  # of N x capacity
    workload: str = ""  # what it was planned for (model, GPU, lengths)
    command: str = ""  # the planner's command line

    @property
    def trainer_binds(self) -> bool:
        return self.batch == 0

    def summary(self) -> str:
        full = self.engines * self.capacity_tokens_per_s
        if self.trainer_binds:
            return (f"the trainer binds first at eta {self.eta} on {self.engines} engine(s): its limit "
                    f"{self.trainer_tokens_per_s:,.0f} tok/s is below {self.goal:g} x N x capacity "
                    f"({self.goal * full:,.0f} of {full:,.0f} tok/s); no B fills the engines ({self.workload})")
        return (f"B >= {self.batch} groups per step fills {self.engines} engine(s) at eta {self.eta}: the bound's ideal "
                f"{self.ideal_tokens_per_s:,.0f} tok/s = {self.ideal_tokens_per_s / full:.2f} of N x capacity "
                f"({full:,.0f} tok/s; the trainer's limit {self.trainer_tokens_per_s:,.0f}) ({self.workload})")


def load_advice(path: str | Path) -> SizingAdvice:
    """The advice at `path`; a ValueError naming the file and what is wrong."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=SizingAdvice)
    except OSError as exc:
        raise ValueError(f"sizing advice {path}: {exc.strerror or exc}") from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"sizing advice {path}: not `rollout plan --save` output: {exc}") from exc


def below_advice(advice: SizingAdvice, *, batch: int, eta: int, n: int) -> str | None:
    """A line to print when a run at (batch, eta, n) is sized below the advice (or the advice was
    planned for another eta or n); None when B reaches it."""
    if (advice.eta, advice.n) != (eta, n):
        return (f"the sizing advice was planned for eta {advice.eta}, n {advice.n}; this run has eta {eta}, n {n}: "
                f"plan again (rollout plan --eta {eta}); it said: {advice.summary()}")
    if advice.trainer_binds:
        return f"rollout_batch_size {batch}: {advice.summary()}"
    if batch < advice.batch:
        return (f"rollout_batch_size {batch} is below the {advice.batch} that keeps the engines full: "
                f"{advice.summary()}; at {batch} the staleness bound leaves them partly idle")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.sizing", description=__doc__.split("\n\n")[0])
    p.add_argument("advice", help="the JSON `rollout plan --save` wrote")
    p.add_argument("--batch", type=int, required=True, help="the run's rollout_batch_size (B)")
    p.add_argument("--eta", type=int, required=True)
    p.add_argument("--n", type=int, required=True, help="n_samples_per_prompt")
    args = p.parse_args(argv)
    try:
        line = below_advice(load_advice(args.advice), batch=args.batch, eta=args.eta, n=args.n)
    except ValueError as exc:
        print(f"sizing: {exc}")
        return 2
    if line:
        print(f"sizing: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
