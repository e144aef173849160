"""Async vs sync: trainer throughput of the pipeline at eta = 0, 1, 2, 4 vs a synchronous loop.

Simulated: the engine (a fixed number of generation slots; an episode holds one slot
for `length x token_s` seconds, lengths long-tailed) and the trainer step (a sleep).
Real: the Redis group buffer (GroupBuffer.push, Lua dedup), the admission formula
(pipeline.staleness.admission_headroom over the Redis counters), and the slime side
(RedisDataSource via generate_rollout in its own thread: staleness check with
requeue, checkpoint-aligned acks via save). Episodes run in an in-process asyncio
pool, not arq workers, and groups carry 16 tokens per sample (buffer throughput is
measured by its own section). Time is compressed: a mean episode lasts ~0.1 s.

Sync baseline: generate B groups on the same slots, wait for the slowest, train, repeat;
group k gets the same lengths in every mode.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pipeline.buffer import GroupBuffer
from pipeline.keys import Counter, Keys
from pipeline.redis_conn import connect
from pipeline.slime import RedisDataSource, generate_rollout
from pipeline.staleness import admission_headroom
from pipeline.state import PipelineState
from pipeline.synthetic import make_group
from scripts.plan import simulate
from scripts.report import Figure
from scripts.simmodel import SimSetup
from scripts.timing import ratio

AREAL_SPEEDUP = 2.77  # AReaL (Fu et al. 2025): async RL vs synchronous, same hardware
UTILISATION_GOAL = 0.9
ETAS = (0, 1, 2, 4)
WARMUP_STEPS = 2  # steps excluded from the measurement window (pipeline fill)
SEED = 7


def default_setup() -> SimSetup:
    """64 slots, B=8 groups x n=8 (a batch fills the slots once), mean episode ~0.11 s, trainer step
    = one batch's generation time at full utilisation (the balanced pipeline async RL aims for)."""
    setup = SimSetup(slots=64, batch_groups=8, n_samples=8, token_s=50e-6, step_s=0.0)
    setup.step_s = setup.batch_groups * setup.n_samples * setup.mean_episode_s() / setup.slots
    return setup


class SlotMeter:
    """Fixed generation slots plus the integral of busy slots over time (for utilisation)."""

    def __init__(self, slots: int):
        self.gate = asyncio.Semaphore(slots)
        self.active = 0
        self.busy_s = 0.0
        self._since = time.monotonic()

    def _tick(self) -> None:
        now = time.monotonic()
        self.busy_s += self.active * (now - self._since)
        self._since = now

    def busy_until_now(self) -> float:
        self._tick()
        return self.busy_s

    async def generate(self, seconds: float) -> None:
        async with self.gate:
            self._tick()
            self.active += 1
            try:
                await asyncio.sleep(seconds)
            finally:
                self._tick()
                self.active -= 1


@dataclass
class Window:
    """Measurement window: from the end of the warm-up steps to the end of the run."""

    started: float = 0.0
    busy_at_start: float = 0.0
    trainer_wait_s: float = 0.0
    staleness: list[int] = field(default_factory=list)

    def result(self, setup: SimSetup, meter: SlotMeter, steps: int, **extra: Any) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        measured = steps - WARMUP_STEPS
        util = (meter.busy_until_now() - self.busy_at_start) / (setup.slots * elapsed)
        return {"throughput": measured * setup.batch_groups / elapsed, "utilisation": util,
                "trainer_idle": self.trainer_wait_s / elapsed,
                "staleness_max": max(self.staleness, default=0), **extra}


# --------------------------------------------------------------- synchronous baseline

async def run_sync(setup: SimSetup, steps: int) -> dict[str, Any]:
    meter = SlotMeter(setup.slots)
    window = Window()
    for step in range(steps):
        if step == WARMUP_STEPS:
            window.started, window.busy_at_start = time.monotonic(), meter.busy_until_now()
        first = step * setup.batch_groups
        waits = [meter.generate(float(n) * setup.token_s)
                 for g in range(first, first + setup.batch_groups) for n in setup.group_lengths(g, SEED)]
        started = time.monotonic()
        await asyncio.gather(*waits)
        if step >= WARMUP_STEPS:
            window.trainer_wait_s += time.monotonic() - started
        window.staleness += [0] * setup.batch_groups
        await asyncio.sleep(setup.step_s)
    return window.result(setup, meter, steps)


# --------------------------------------------------------------- the pipeline

class Pipeline:
    """Producer (admission) + in-process generator pool + real buffer, against a real RedisDataSource."""

    def __init__(self, setup: SimSetup, redis_url: str, eta: int):
        self.setup, self.redis_url, self.eta = setup, redis_url, eta
        self.keys = Keys(f"ab{uuid.uuid4().hex[:8]}")
        self.redis = connect(redis_url)
        self.buffer = GroupBuffer(self.redis, self.keys)
        self.state = PipelineState(self.redis, self.keys)
        self.meter = SlotMeter(setup.slots)
        self.window = Window()
        self.done = threading.Event()
        self.tasks: set[asyncio.Task] = set()
        self.next_group = 0

    async def run(self, steps: int) -> dict[str, Any]:
        await self.buffer.ensure_group()
        producer = asyncio.create_task(self._produce())
        try:
            await asyncio.to_thread(self._train, steps)
        finally:
            self.done.set()
            producer.cancel()
            for task in [producer, *self.tasks]:
                task.cancel()
            await asyncio.gather(producer, *self.tasks, return_exceptions=True)
        counters = await self.state.counters()
        await self.redis.aclose()
        return self.window.result(self.setup, self.meter, steps, stale_rejected=counters.get(Counter.STALE, 0),
                                  admitted=counters.get(Counter.ENQUEUED, 0))

    async def _produce(self) -> None:
        """Admit groups whenever the bound allows (the producers' formula on the shared Redis counters)."""
        while not self.done.is_set():
            version = await self.state.get_version()
            counters = await self.state.counters()
            headroom = admission_headroom(
                eta=self.eta, version=version, batch_size=self.setup.batch_groups,
                admitted=counters.get(Counter.ENQUEUED, 0), discarded=counters.get(Counter.DISCARDED, 0),
            )
            if headroom:
                await self.state.incr(**{Counter.ENQUEUED: headroom, Counter.RUNNING: headroom})
                for _ in range(headroom):
                    task = asyncio.create_task(self._generate(self.next_group, version))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                    self.next_group += 1
            await asyncio.sleep(0.002)

    async def _generate(self, group_index: int, admission_version: int) -> None:
        lengths = self.setup.group_lengths(group_index, SEED)
        await asyncio.gather(*(self.meter.generate(float(n) * self.setup.token_s) for n in lengths))
        group = make_group(f"g{group_index}:0", n=self.setup.n_samples, prompt_len=8, response_len=8,
                           admission_version=admission_version, rewards=[float(i % 2) for i in range(len(lengths))])
        await self.buffer.push(group, **{Counter.RUNNING: -1})

    def _train(self, steps: int) -> None:
        args = SimpleNamespace(
            pipeline_redis_url=self.redis_url, pipeline_namespace=self.keys.ns, rollout_batch_size=self.setup.batch_groups,
            n_samples_per_prompt=self.setup.n_samples, pipeline_eta=self.eta, pipeline_stale_policy="requeue",
            pipeline_trainer_loop="sync",  # this loop's "weights" move right after each step (eta 0 = synchronous)
        )
        source = RedisDataSource(args)
        try:
            for rid in range(steps):
                if rid == WARMUP_STEPS:
                    self.window.started, self.window.busy_at_start = time.monotonic(), self.meter.busy_until_now()
                started = time.monotonic()
                out = generate_rollout(args, rid, source)
                assert len(out.samples) == self.setup.batch_groups
                if rid >= WARMUP_STEPS:
                    self.window.trainer_wait_s += time.monotonic() - started
                self.window.staleness += source.last_stats.staleness
                time.sleep(self.setup.step_s)  # the simulated optimizer step
                source.save(rid)
        finally:
            source.close()


async def run_pipeline(setup: SimSetup, redis_url: str, eta: int, steps: int) -> dict[str, Any]:
    return await Pipeline(setup, redis_url, eta).run(steps)


# --------------------------------------------------------------- the section

def bench_async(redis_url: str, *, quick: bool, setup: SimSetup | None = None) -> list[Figure]:
    setup = setup or default_setup()
    steps = 20 if quick else 60
    sync = asyncio.run(run_sync(setup, steps))
    bound = setup.throughput_bound()
    figures = [_figure("sync baseline", sync, sync, setup, bound, eta=None)]
    for eta in ETAS:
        measured = asyncio.run(run_pipeline(setup, redis_url, eta, steps))
        predicted = simulate(setup, eta=eta, steps=200, seed=SEED)
        measured["planner_predicted_throughput"] = predicted["throughput"]
        figures.append(_figure(f"pipeline eta={eta}", measured, sync, setup, bound, eta=eta))
    return figures + [_anchor(figures[1:], setup)]


def _anchor(per_eta: list[Figure], setup: SimSetup) -> Figure:
    """The AReaL anchor: the best speedup at some eta <= 4 that keeps utilisation >= 0.9 of the bound."""
    qualifying = [f for f in per_eta if f.details["utilisation"] / setup.utilisation_bound() >= UTILISATION_GOAL
                  and f.met]
    best = max(qualifying or per_eta, key=lambda f: f.ratio)
    return Figure(
        section="async", name=f"best pipeline speedup at eta <= 4 with utilisation >= {UTILISATION_GOAL} of bound "
        f"({best.details['eta_label']})", value=best.value, unit="groups/s", baseline="sync",
        baseline_value=best.baseline_value, ratio=best.ratio, goal=f"ratio >= {AREAL_SPEEDUP} (AReaL)",
        met=bool(qualifying) and best.ratio >= AREAL_SPEEDUP, details={"from": best.name},
    )


def _figure(name: str, r: dict[str, Any], sync: dict[str, Any], setup: SimSetup, bound: float,
            eta: int | None) -> Figure:
    speedup = ratio(r["throughput"], sync["throughput"])
    util_of_bound = r["utilisation"] / setup.utilisation_bound()
    details = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
    details.update(utilisation_bound=round(setup.utilisation_bound(), 4), throughput_bound=round(bound, 3),
                   fraction_of_bound=round(r["throughput"] / bound, 4), step_s=round(setup.step_s, 4),
                   slots=setup.slots, batch_groups=setup.batch_groups, n_samples=setup.n_samples)
    details["eta_label"] = "sync" if eta is None else f"eta={eta}"
    met = None
    goal = ""
    if eta is not None:
        goal, met = "max staleness <= eta", r["staleness_max"] <= eta
        name += f" (util {r['utilisation']:.0%} = {util_of_bound:.0%} of bound, max staleness {r['staleness_max']})"
    return Figure(section="async", name=f"trainer throughput, {name}", value=r["throughput"], unit="groups/s",
                  baseline="sync", baseline_value=sync["throughput"], ratio=speedup, goal=goal, met=met,
                  details=details)
