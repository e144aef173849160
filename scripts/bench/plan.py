"""`rollout bench plan`: capacity planner (discrete-event simulation of the pipeline).

    rollout bench plan --lengths profile.json --engines 4 --slots 64 --step-time 30 \
        --batch 32 --n 8 --tokens-per-s 40 --eta 0,1,2,4 --concurrency 32,64,128,0

Simulates the same model as the async benchmark (fixed slots, long-tailed lengths,
admission `(eta + v + 1) * B - live`, consumption check `v - admission <= eta` with
requeue) and prints throughput, trainer idle ratio, slot utilisation and staleness
per (eta, concurrency). concurrency = groups the worker pool runs at once (0 = no cap).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
from collections import deque
from dataclasses import dataclass, field

import msgspec

from scripts.bench.simmodel import LengthProfile, SimSetup


class PlanRow(msgspec.Struct, kw_only=True):
    eta: int
    concurrency: int  # 0 = no cap
    throughput: float  # groups trained per second
    speedup: float  # vs synchronous (eta 0, no cap)
    trainer_idle: float  # fraction of time the trainer waits for data
    utilisation: float  # busy slot fraction
    bound_fraction: float  # throughput / work-conserving bound
    staleness_mean: float
    staleness_max: int
    stale_rejected: float  # fraction of finished groups rejected as too stale


@dataclass
class _State:
    setup: SimSetup
    eta: int
    cap: int
    seed: int
    now: float = 0.0
    version: int = 0
    admitted: int = 0
    discarded: int = 0
    in_flight: int = 0
    free_slots: int = 0
    next_group: int = 0
    waiting: deque = field(default_factory=deque)  # episodes waiting for a slot: (group, seconds)
    remaining: dict = field(default_factory=dict)  # group -> episodes left
    admission: dict = field(default_factory=dict)  # group -> admission version
    buffer: deque = field(default_factory=deque)  # finished groups, in finish order
    batch: list = field(default_factory=list)
    training: bool = False
    busy_slot_s: float = 0.0
    idle_s: float = 0.0
    idle_since: float = 0.0
    staleness: list = field(default_factory=list)
    stale: int = 0
    finished: int = 0
    events: list = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)


def _schedule(st: _State, at: float, kind: str, payload: int) -> None:
    heapq.heappush(st.events, (at, next(st.counter), kind, payload))


def _admit(st: _State) -> None:
    s = st.setup
    headroom = (st.eta + st.version + 1) * s.batch_groups - (st.admitted - st.discarded)
    while headroom > 0 and (st.cap == 0 or st.in_flight < st.cap):
        g = st.next_group
        st.next_group += 1
        st.admitted += 1
        st.in_flight += 1
        headroom -= 1
        st.admission[g] = st.version
        st.remaining[g] = s.n_samples
        st.waiting.extend((g, float(n) * s.token_s) for n in s.group_lengths(g, st.seed))
    while st.free_slots and st.waiting:
        g, seconds = st.waiting.popleft()
        st.free_slots -= 1
        st.busy_slot_s += seconds
        _schedule(st, st.now + seconds, "episode", g)


def _consume(st: _State) -> None:
    s = st.setup
    while not st.training and st.buffer:
        g = st.buffer.popleft()
        if st.version - st.admission[g] > st.eta:
            st.stale += 1
            st.discarded += 1  # requeued: its slot under the bound is given back
            continue
        st.staleness.append(st.version - st.admission[g])
        st.batch.append(g)
        if len(st.batch) == s.batch_groups:
            st.idle_s += st.now - st.idle_since
            st.training = True
            st.batch = []
            _schedule(st, st.now + s.step_s, "trained", 0)


def simulate(setup: SimSetup, *, eta: int, concurrency: int = 0, steps: int = 200, seed: int = 0) -> dict[str, float]:
    st = _State(setup=setup, eta=eta, cap=concurrency, seed=seed, free_slots=setup.slots)
    _admit(st)
    trained = 0
    while trained < steps:
        st.now, _, kind, g = heapq.heappop(st.events)
        if kind == "episode":
            st.free_slots += 1
            st.remaining[g] -= 1
            if st.remaining[g] == 0:
                st.in_flight -= 1
                st.finished += 1
                st.buffer.append(g)
        else:
            st.training = False
            trained += 1
            st.version += 1
            st.idle_since = st.now
        _admit(st)
        _consume(st)
    # busy_slot_s counts whole episodes when they start; take off what runs past the end
    busy = st.busy_slot_s - sum(at - st.now for at, _n, kind, _g in st.events if kind == "episode")
    return {
        "throughput": trained * setup.batch_groups / st.now,
        "trainer_idle": st.idle_s / st.now,
        "utilisation": min(1.0, busy / (setup.slots * st.now)),
        "staleness_mean": sum(st.staleness) / len(st.staleness),
        "staleness_max": max(st.staleness),
        "stale_rejected": st.stale / max(1, st.finished),
    }


def plan(setup: SimSetup, etas: list[int], concurrencies: list[int], *, steps: int = 200, seed: int = 0) -> list[PlanRow]:
    sync = simulate(setup, eta=0, concurrency=0, steps=steps, seed=seed)["throughput"]
    bound = setup.throughput_bound()
    rows = []
    for eta, cap in itertools.product(etas, concurrencies):
        r = simulate(setup, eta=eta, concurrency=cap, steps=steps, seed=seed)
        rows.append(PlanRow(
            eta=eta, concurrency=cap, throughput=r["throughput"], speedup=r["throughput"] / sync,
            trainer_idle=r["trainer_idle"], utilisation=r["utilisation"], bound_fraction=r["throughput"] / bound,
            staleness_mean=r["staleness_mean"], staleness_max=int(r["staleness_max"]),
            stale_rejected=r["stale_rejected"],
        ))
    return rows


def format_table(rows: list[PlanRow]) -> str:
    header = f"{'eta':>3} {'conc':>5} {'groups/s':>9} {'vs sync':>7} {'trainer idle':>12} {'slot util':>9} " \
             f"{'of bound':>8} {'stale mean':>10} {'stale max':>9} {'rejected':>8}"
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.eta:>3} {r.concurrency or 'inf':>5} {r.throughput:>9.3f} {r.speedup:>6.2f}x {r.trainer_idle:>12.1%} "
            f"{r.utilisation:>9.1%} {r.bound_fraction:>8.1%} {r.staleness_mean:>10.2f} {r.staleness_max:>9d} "
            f"{r.stale_rejected:>8.1%}"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", help="JSON length profile (list of lengths, or {median, sigma, max_tokens})")
    parser.add_argument("--engines", type=int, default=1, help="engine (SGLang server) count")
    parser.add_argument("--slots", type=int, required=True, help="generation slots per engine (max running requests)")
    parser.add_argument("--step-time", type=float, required=True, help="trainer step time, seconds")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="decode speed of one slot, tokens/s")
    parser.add_argument("--batch", type=int, default=32, help="groups per step (rollout_batch_size)")
    parser.add_argument("--n", type=int, default=8, help="samples per group (n_samples_per_prompt)")
    parser.add_argument("--eta", default="0,1,2,4", help="staleness bounds to try")
    parser.add_argument("--concurrency", default="0", help="worker-pool group concurrency caps to try (0 = none)")
    parser.add_argument("--steps", type=int, default=200, help="trainer steps simulated per cell")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    try:
        profile = LengthProfile.load(args.lengths) if args.lengths else LengthProfile()
    except ValueError as exc:
        print(f"rollout bench plan: {exc}", file=sys.stderr)
        return 2
    setup = SimSetup(slots=args.engines * args.slots, batch_groups=args.batch, n_samples=args.n,
                     token_s=1.0 / args.tokens_per_s, step_s=args.step_time, profile=profile)
    rows = plan(setup, _ints(args.eta), _ints(args.concurrency), steps=args.steps)
    if args.json:
        print(msgspec.json.encode(rows).decode())
        return 0
    print(f"slots={setup.slots} B={setup.batch_groups} n={setup.n_samples} step={setup.step_s:g}s "
          f"mean episode={setup.mean_episode_s():.2f}s | bounds: generation {setup.generation_bound():.3f} "
          f"groups/s, trainer {setup.trainer_bound():.3f} groups/s")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
