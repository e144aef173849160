"""The staleness bound's ideal: the most any scheduler could train at that eta and B (issue 46 item 2).

A discrete-event simulation (no clock, no network: deterministic for a seed) of the schedule an
ideal pipeline would run on the SAME engines the bench plays: each engine is the simulated
engine's own scheduler (workers/sim/scheduler.py: SGLang's admission by KV pool and chunk
budget, priority queue, decode retraction, prefix cache) with its own physics
(workers/sim/config.py `engine_physics`: the aiconfigurator step table, the KV pool, the weight
push's GPU time), stepped here instead of in real time. Under the same rules as the pipeline:

- **Admission bound** (pipeline/staleness.py `admission_headroom`): at most (eta + v + 1) x B
  groups admitted ever at version v; nothing is ever discarded here, so each publish admits B more.
- **Lag rule**: a group trained at step s has its oldest token's version >= s - eta (a token's
  version: the weights its engine held when the step that made it began).
- **Ideal scheduler**: admission is instant (a group's n requests reach the engines at the
  publish that admits it, each to the engine with the fewest requests in it); the engines run
  the groups due soonest first (SGLang's priority scheduling by the admission clock, as the
  pipeline's requests carry it); the trainer starts step s as soon as B groups are finished and
  the due-first rule (`places_to_keep`) keeps no place for a group still generating, taking the
  finished groups oldest first. A step trains for `train_step_s`, then pushes: every engine stops
  after its step in flight for the push's GPU time (in place: running requests keep their KV),
  and the version moves on when the last engine has its new weights.

The figure is trained tokens (the groups' whole answers) per engine-clock second between the
start of step `warmup` and the start of the last step: the same window the bench reads.
`capacity_tokens_per_s` is the other reference: one engine saturated with the workload's
requests (`outstanding` in flight, a new one as each finishes), generated tokens per second.

    from scripts.bench.ideal import IdealSetup, ideal, capacity_tokens_per_s
    setup = IdealSetup.for_workload(WORKLOADS["areal-7b"], eta=2, batch=2)
    r = ideal(setup)       # r.tokens_per_s, r.describe()
    capacity_tokens_per_s(setup)

`python -m scripts.bench.ideal --workload areal-7b --etas 1,2,4 --batch 2` prints both.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.staleness import places_to_keep
from scripts.bench.simmodel import LengthProfile
from workers.sim.engine import EnginePhysics, SimConfig, config_from_args, engine_physics, parse_args
from workers.sim.scheduler import BatchScheduler, SimReq

if TYPE_CHECKING:
    from scripts.bench.peer_contenders import Workload

DEFAULT_STEPS = 24  # trainer steps simulated
VOCAB_SPAN = 50_000  # outputs use distinct token ids per request (no false prefix sharing in the cache)


@dataclass(frozen=True)
class IdealSetup:
    physics: EnginePhysics  # one engine's (all alike)
    lengths: LengthProfile  # answer lengths, tokens
    prompts: tuple[tuple[int, ...], ...]  # group g asks prompts[g % len]
    batch: int  # B: groups per step
    n: int  # answers per group
    eta: int
    train_step_s: float  # the trainer's step, without the push (engine-clock seconds)
    engines: int = 1
    max_new_tokens: int = 32768  # what every request asks for (admission reserves from it)
    steps: int = DEFAULT_STEPS
    warmup: int = -1  # first step of the window; -1: eta + 2 (the bench's warm-up)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.eta < 0 or min(self.batch, self.n, self.engines) < 1:
            raise ValueError(f"IdealSetup needs eta >= 0, batch, n, engines >= 1; got eta {self.eta}, batch "
                             f"{self.batch}, n {self.n}, engines {self.engines}")
        if not self.prompts or not all(self.prompts):
            raise ValueError("IdealSetup.prompts must be non-empty token lists")
        if self.window()[1] - self.window()[0] < 1:
            raise ValueError(f"IdealSetup: {self.steps} steps leave no window after warm-up step {self.window()[0]}")

    def window(self) -> tuple[int, int]:
        """(first, end): the rate is read from the start of step `first` to the start of step `end`."""
        first = self.warmup if self.warmup >= 0 else self.eta + 2
        return first, self.steps - 1

    @property
    def tau_s(self) -> float:
        return self.train_step_s + self.physics.push_s

    @classmethod
    def for_workload(cls, wl: Workload, *, eta: int | None = None, batch: int | None = None,
                     engines: int | None = None, steps: int = DEFAULT_STEPS, seed: int | None = None) -> IdealSetup:
        """The bench's workload as its engine plays it: the engine's own arguments (`engine_args`),
        its prompts (the math tasks under the chat template), its lengths (lognormal, capped)."""
        return cls(physics=workload_physics(wl), lengths=workload_lengths(wl), prompts=bench_prompts(),
                   batch=wl.batch if batch is None else batch, n=wl.n, eta=wl.eta if eta is None else eta,
                   train_step_s=wl.train_step_s, engines=wl.engines if engines is None else engines,
                   max_new_tokens=wl.max_response_len, steps=steps, seed=wl.seed if seed is None else seed)


def workload_physics(wl: Workload) -> EnginePhysics:
    """The engine the bench starts for `wl` (its command line through the engine's own parser), at time scale 1."""
    from scripts.bench.peer_contenders import TASKS

    config = dataclasses.replace(config_from_args(parse_args(wl.engine_args(str(TASKS)))), time_scale=1.0)
    return physics_of(config)


def physics_of(config: SimConfig) -> EnginePhysics:
    physics = engine_physics(config)
    if physics is None:
        raise ValueError("the ideal schedule needs an engine with physics: a --model or a --token-latency-s")
    return physics


def workload_lengths(wl: Workload) -> LengthProfile:
    """The engine's filler lengths for `wl` (lognormal), capped at what a request may produce."""
    return LengthProfile(median=math.exp(wl.length_mu), sigma=wl.length_sigma, min_tokens=1,
                         max_tokens=min(wl.max_filler_tokens, wl.max_response_len))


@cache
def bench_prompts() -> tuple[tuple[int, ...], ...]:
    from scripts.bench.peer_contenders import TASKS

    return tuple(tuple(p) for p in task_prompts(TASKS))


def task_prompts(tasks: Path) -> list[list[int]]:
    """The tasks' prompts as the engine sees them (the chat template, as every contender sends)."""
    from workers.sim.tokenizer import load_test_tokenizer

    tok = load_test_tokenizer()
    rows = [json.loads(line) for line in tasks.read_text().splitlines() if line.strip()]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for r in rows]


_IDEALS: dict[tuple[str, int], tuple[IdealResult, float]] = {}


def bound_ideal(wl: Workload, eta: int) -> tuple[IdealResult, float]:
    """(the bound's ideal, the simulated capacity of one engine) for the bench's workload `wl`
    at `eta`, its own B and engines; computed once per workload and eta in a process."""
    key = (repr(wl), eta)
    if key not in _IDEALS:
        setup = IdealSetup.for_workload(wl, eta=eta)
        _IDEALS[key] = (ideal(setup), capacity_tokens_per_s(setup))
    return _IDEALS[key]


@dataclass(frozen=True)
class IdealResult:
    setup: IdealSetup
    tokens_per_s: float  # trained tokens per engine-clock second over the window
    period_s: float  # mean time between step starts over the window
    trainer_idle: float  # share of the window the trainer waited for groups
    mean_running: float  # requests running per engine, time-weighted, from the start to the window's end
    step_starts: tuple[float, ...]
    lag_max: int

    def describe(self) -> str:
        s = self.setup
        return (f"bound's ideal at eta {s.eta}, B {s.batch} x n {s.n}, {s.engines} engine(s): "
                f"{self.tokens_per_s:,.0f} trained tok/s engine clock; period {self.period_s:.1f} s "
                f"(trainer step + push {s.tau_s:.1f} s), trainer idle {self.trainer_idle:.0%}, mean running "
                f"{self.mean_running:.1f} per engine, lag max {self.lag_max} (steps {s.window()[0]}-{s.window()[1]} "
                f"of {s.steps}, seed {s.seed})")


# ---------------------------------------------------------------- the simulation


@dataclass(eq=False)
class _Group:
    gid: int
    clock: int  # admission version
    left: int  # answers not finished
    tokens: int  # its answers' tokens (what it trains)
    oldest: int | None = None  # version of its oldest token
    ready_at: float = math.inf


@dataclass(eq=False)
class _Job:
    group: _Group
    seen: int = 0  # its tokens so far (0: the next is its first)


@dataclass(eq=False)
class _Engine:
    sch: BatchScheduler
    version: int = 0  # the weights it holds
    stepping: bool = False  # a step (or a run of decode steps, or a push) is under way
    push_due: bool = False  # the trainer pushed: stop after the step in flight
    finished: list[SimReq] = field(default_factory=list)
    running_s: float = 0.0  # running requests x seconds (mean batch)


class _Sim:
    """The event loop: engine steps, the trainer's steps and pushes, on one simulated clock."""

    def __init__(self, setup: IdealSetup):
        self.setup = setup
        self.now = 0.0
        self.version = 0
        self.events: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self.engines = [_Engine(self._scheduler()) for _ in range(setup.engines)]
        self.groups: dict[int, _Group] = {}  # admitted, not trained
        self.admitted = 0
        self.training_until: float | None = None  # the trainer's step ends then
        self.pushes_left = 0
        self.step_starts: list[float] = []
        self.step_tokens: list[int] = []
        self.idle_since: float | None = 0.0
        self.idle: list[tuple[float, float]] = []
        self.lag_max = 0

    def _scheduler(self) -> BatchScheduler:
        import asyncio

        return BatchScheduler(self.setup.physics.limits, self.setup.physics.steps, asyncio.Event(), on_token=self._token)

    # -------------------------------------------------------- engines

    def _token(self, req: SimReq) -> None:
        job: _Job = req.owner
        if job.seen == 0:
            engine = self.engines[int(req.rid.split(":")[0])]
            oldest = job.group.oldest
            job.group.oldest = engine.version if oldest is None else min(oldest, engine.version)
        job.seen = req.produced
        if req.produced >= req.target:
            self.engines[int(req.rid.split(":")[0])].finished.append(req)

    def _submit(self, group: _Group, answer: int, length: int) -> None:
        s = self.setup
        index = min(range(len(self.engines)), key=lambda e: self._load(self.engines[e]))
        engine = self.engines[index]
        order = 1 if s.physics.limits.low_priority_values_first else -1  # due sooner = served first
        token = 1000 + (group.gid * s.n + answer) % VOCAB_SPAN
        req = SimReq(f"{index}:{group.gid}:{answer}", list(s.prompts[group.gid % len(s.prompts)]), [token] * length,
                     max(length, s.max_new_tokens), priority=order * group.clock)
        req.owner = _Job(group)
        engine.sch.add(req)
        self._kick(index)

    @staticmethod
    def _load(engine: _Engine) -> int:
        sch = engine.sch
        return len(sch.waiting) + len(sch.running) + (sch.chunked is not None)

    def _kick(self, index: int) -> None:
        """Start the engine's next step if it is free: its push first, else a run of decode steps
        where nothing can change inside it, else one step; nothing to do: it waits."""
        engine = self.engines[index]
        if engine.stepping:
            return
        if engine.push_due:
            engine.push_due, engine.stepping = False, True
            self._at(self.now + self.setup.physics.push_s, "pushed", index)
            return
        # the next push can come no sooner than the trainer's step in flight ends, or a step
        # starting now would end: a run of decode steps stops there (the push waits for one step)
        horizon = (self.training_until if self.training_until is not None else self.now + self.setup.train_step_s) - self.now
        running = len(engine.sch.running)
        many = engine.sch.decode_many(1 << 30, within_s=horizon) if horizon > 0 else None
        duration = many[1] if many is not None else engine.sch.step()
        if duration is None:
            return
        engine.running_s += running * duration
        engine.stepping = True
        self._at(self.now + duration, "step", index)

    def _step_done(self, index: int) -> None:
        engine = self.engines[index]
        engine.stepping = False
        for req in engine.finished:
            group = req.owner.group
            group.left -= 1
            if group.left == 0:
                group.ready_at = self.now
        engine.finished.clear()
        self._kick(index)

    def _pushed(self, index: int) -> None:
        engine = self.engines[index]
        engine.stepping = False
        engine.version += 1
        self.pushes_left -= 1
        if self.pushes_left == 0:
            self._publish()
        self._kick(index)

    # -------------------------------------------------------- trainer

    def _admit(self) -> None:
        s = self.setup
        while self.admitted < (s.eta + self.version + 1) * s.batch:
            gid = self.admitted
            self.admitted += 1
            lengths = [min(int(x), s.max_new_tokens) for x in s.lengths.draw(np.random.default_rng([s.seed, gid]), s.n)]
            group = self.groups[gid] = _Group(gid, self.version, s.n, sum(lengths))
            for answer, length in enumerate(lengths):
                self._submit(group, answer, length)

    def _try_train(self) -> None:
        s = self.setup
        if self.training_until is not None or self.pushes_left or len(self.step_starts) >= s.steps:
            return
        ready = {g.gid for g in self.groups.values() if g.left == 0}
        if len(ready) < s.batch:
            return
        clock_of = {g.gid: g.oldest if g.oldest is not None else self.version for g in self.groups.values()}
        if places_to_keep(clock_of, ready, rollout_id=self.version, batch_size=s.batch, eta=s.eta):
            return
        chosen = sorted(ready, key=lambda gid: (clock_of[gid], self.groups[gid].ready_at, gid))[: s.batch]
        self.lag_max = max([self.lag_max, *(self.version - clock_of[gid] for gid in chosen)])
        if self.idle_since is not None:
            self.idle.append((self.idle_since, self.now))
            self.idle_since = None
        self.step_starts.append(self.now)
        self.step_tokens.append(sum(self.groups.pop(gid).tokens for gid in chosen))
        self.training_until = self.now + s.train_step_s
        self._at(self.training_until, "trained", 0)

    def _push(self) -> None:
        self.training_until = None
        self.pushes_left = len(self.engines)
        for index, engine in enumerate(self.engines):
            engine.push_due = True
            self._kick(index)

    def _publish(self) -> None:
        self.version += 1
        self.idle_since = self.now
        self._admit()

    # -------------------------------------------------------- loop

    def _at(self, when: float, kind: str, index: int) -> None:
        heapq.heappush(self.events, (when, next(self._seq), kind, index))

    def run(self) -> None:
        self._admit()
        while self.events and len(self.step_starts) < self.setup.steps:
            self.now, _, kind, index = heapq.heappop(self.events)
            if kind == "step":
                self._step_done(index)
            elif kind == "pushed":
                self._pushed(index)
            else:
                self._push()
            self._try_train()
        if len(self.step_starts) < self.setup.steps:
            raise RuntimeError(f"the ideal schedule stalled after {len(self.step_starts)} steps (a bug)")


def ideal(setup: IdealSetup) -> IdealResult:
    """The bound's ideal for `setup` (module docstring)."""
    sim = _Sim(setup)
    sim.run()
    first, end = setup.window()
    t0, t1 = sim.step_starts[first], sim.step_starts[end]
    span = t1 - t0
    idle = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in sim.idle)
    running = sum(e.running_s for e in sim.engines) / len(sim.engines) / t1 if t1 > 0 else 0.0
    return IdealResult(setup=setup, tokens_per_s=sum(sim.step_tokens[first:end]) / span,
                       period_s=span / (end - first), trainer_idle=idle / span, mean_running=running,
                       step_starts=tuple(sim.step_starts), lag_max=sim.lag_max)


def default_outstanding(setup: IdealSetup) -> int:
    """Requests kept in flight by the capacity run: four times what the engine runs at once (its
    max running requests, or what the KV pool holds at the mean request: the bench's 4 x slots),
    so its queue never empties."""
    limits = setup.physics.limits
    mean = float(np.mean([len(p) for p in setup.prompts])) + setup.lengths.mean()
    return 4 * max(1, min(limits.max_running_requests, math.ceil(limits.kv_pool_tokens / mean)))


def capacity_tokens_per_s(setup: IdealSetup, *, outstanding: int = 0, warmup: int = 0, window: int = 0) -> float:
    """One engine saturated with the workload's requests and nothing else (no trainer, no push):
    generated tokens per engine-clock second while `window` requests finish (default 4 x
    `outstanding`), after `warmup` have (default `outstanding`: the first fill turned over)."""
    import asyncio

    outstanding = outstanding or default_outstanding(setup)
    warmup, window = warmup or outstanding, window or 4 * outstanding
    counted = [0]

    def token(req: SimReq) -> None:
        counted[0] += req.produced - req.owner
        req.owner = req.produced

    sch = BatchScheduler(setup.physics.limits, setup.physics.steps, asyncio.Event(), on_token=token)
    sent = itertools.count()

    def send() -> None:
        i = next(sent)
        length = min(int(setup.lengths.draw(np.random.default_rng([setup.seed, 1 << 20, i]), 1)[0]), setup.max_new_tokens)
        req = SimReq(f"cap-{i}", list(setup.prompts[i % len(setup.prompts)]),
                     [1000 + i % VOCAB_SPAN] * length, max(length, setup.max_new_tokens))
        req.owner = 0
        sch.add(req)

    for _ in range(outstanding):
        send()
    now, finished, start = 0.0, 0, (0.0, 0)
    while finished < warmup + window:
        before = len(sch.waiting) + len(sch.running) + (sch.chunked is not None)
        duration = sch.step()
        if duration is None:
            raise RuntimeError("the capacity run's engine stopped with requests in flight (a bug)")
        now += duration
        done = before - (len(sch.waiting) + len(sch.running) + (sch.chunked is not None))
        if finished < warmup <= finished + done:  # the window opens at the end of this step
            start = (now, counted[0])
        finished += done
        for _ in range(done):
            send()
    return (counted[0] - start[1]) / (now - start[0])


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    from scripts.bench.peer_contenders import WORKLOADS

    p = argparse.ArgumentParser(prog="python -m scripts.bench.ideal", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="areal-7b", choices=sorted(WORKLOADS))
    p.add_argument("--etas", default="2", help="staleness bounds, comma-separated")
    p.add_argument("--batch", type=int, default=0, help="B groups per step (0: the workload's)")
    p.add_argument("--engines", type=int, default=0, help="engines (0: the workload's)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--seeds", default="0", help="seeds, comma-separated (one line each)")
    args = p.parse_args(argv)
    wl = WORKLOADS[args.workload]
    for seed in _ints(args.seeds):
        cap = None
        for eta in _ints(args.etas):
            setup = IdealSetup.for_workload(wl, eta=eta, batch=args.batch or None, engines=args.engines or None,
                                            steps=args.steps, seed=seed)
            if cap is None:
                cap = capacity_tokens_per_s(setup)
                print(f"capacity (one engine saturated, seed {seed}): {cap:,.0f} tok/s engine clock")
            r = ideal(setup)
            print(f"{r.describe()}; {r.tokens_per_s / (setup.engines * cap):.2f} of N x capacity")
    return 0


def _ints(text: str) -> Sequence[int]:
    return [int(x) for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    raise SystemExit(main())
