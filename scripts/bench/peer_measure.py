"""What the peer benchmark counts of a contender while it runs, and the trainer's side of every
contender's loop: the simulated trainer step and weight push, the engines' own counters, busy
slots over time (`SlotSampler`), the step marks the steady window is cut from
(scripts/bench/peer_steady.py), and the loop itself (`trainer_loop`, train.py's order)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from scripts.bench.harness import Fleet, as_fleet, get_json
from scripts.bench.peer_workload import Result, Workload

SLOT_SAMPLE_S = 0.05
CLOCK_SAMPLE_S = 0.5


def push_weights(engine_url: str | list[str], version: int, mode: str = "abort") -> None:
    """slime's update_weights as the engines see it: pause (in `mode`), new label, continue, on
    each engine (pipeline.slime.weight_push.push_weights)."""
    from pipeline.slime.weight_push import push_weights as push

    push([engine_url] if isinstance(engine_url, str) else engine_url, str(version), mode)


def train_step(wl: Workload, engine_url: str) -> None:
    """The simulated trainer's step: train_step_s on the ENGINE's clock. It sleeps the scaled time,
    then, while the engine is busy and its simulated clock (GET /sim/stats "sim_time_s") has
    moved less than train_step_s since the step began, waits for it: a step loop that cannot keep
    its time scale on a loaded machine runs slower than the clock, and a trainer on the wall clock
    would then look faster than the published one. An idle engine's clock is the wall clock x the
    scale, so an idle engine (the synchronous contenders while they train) ends the wait at once;
    an engine without a simulated clock (no "sim_time_s") too."""
    start = get_json(engine_url + "/sim/stats").get("sim_time_s")
    time.sleep(wl.train_sleep_s)
    if start is None:
        return
    deadline = time.monotonic() + 10 * wl.train_sleep_s + 5.0
    while time.monotonic() < deadline:
        stats = get_json(engine_url + "/sim/stats")
        if not stats.get("running") and not stats.get("num_waiting_reqs"):
            return
        if float(stats["sim_time_s"]) >= float(start) + wl.train_step_s:
            return
        time.sleep(0.1)  # each look costs the engine's event loop a /sim/stats answer


def read_engine_counts(result: Result, engine_url: str | Fleet) -> None:
    """The engines' own counts: tokens answered, re-prefills, and the plan of every fresh
    request in the order the engine first saw it (the plan the trained lengths are held to).
    Several engines: counts summed, maxima the largest, the pool's size the first engine's."""
    fleet = as_fleet(engine_url)
    every = [get_json(url + "/sim/stats") for url in fleet.engines]
    stats = _merge_stats(every)
    result.engine_tokens = int(stats["output_tokens"])
    result.resumed_requests = int(stats.get("resumed_requests", 0))
    result.resumed_input_tokens = int(stats.get("resumed_input_tokens", 0))
    planned = [min(int(v), 10**9) for one in every for v in (one.get("planned") or {}).values()]
    result.planned_lengths = planned
    info = get_json(fleet.engines[0] + "/server_info")
    result.engine_stats = {k: float(v) for k, v in {**info, **stats}.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}


_MAX_STATS = ("max_kv_used", "kv_pool_tokens", "sim_time_s", "max_running")


def _merge_stats(every: list[dict[str, Any]]) -> dict[str, Any]:
    if len(every) == 1:
        return every[0]
    merged: dict[str, Any] = dict(every[0])
    for key, value in every[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [float(one.get(key, 0)) for one in every]
            merged[key] = max(values) if key in _MAX_STATS else sum(values)
    return merged


class SlotSampler(threading.Thread):
    """Busy engine slots over time: SGLang's GET /v1/loads (small; /sim/stats carries every
    routing key) every SLOT_SAMPLE_S, and the times of the weight pushes. Every CLOCK_SAMPLE_S
    also the engine's simulated clock (GET /sim/stats "sim_time_s", where it has one): its rate
    over windows the engine was busy at both ends, in simulated seconds per wall second, says
    whether the step loop kept its time scale on this machine (`clock_rates`)."""

    def __init__(self, engine_url: str, others: Sequence[str] = ()):
        super().__init__(daemon=True)
        self.url = engine_url + "/v1/loads"
        self.stats_url = engine_url + "/sim/stats"
        # the other engines of a fleet, sampled alike: each engine's idle time counts for itself
        # (peer_steady.engine_played_s), never the first engine's for all
        self.others = list(others)
        self.other_samples: list[list[tuple[float, int]]] = [[] for _ in self.others]
        self.other_clocks: list[list[list[float]]] = [[] for _ in self.others]
        self.started = time.monotonic()
        self.samples: list[tuple[float, int]] = []
        self.pushes: list[float] = []
        self.clock_rates: list[float] = []
        self.clock_samples: list[list[float]] = []  # [wall s since started, the engine's simulated clock]
        self._last_clock: tuple[float, float] | None = None
        self.stopped = threading.Event()

    def _sample_clock(self) -> None:
        try:
            stats = get_json(self.stats_url)
        except OSError:
            return
        if "sim_time_s" not in stats:
            return
        now, sim, busy = time.monotonic(), float(stats["sim_time_s"]), bool(stats.get("running"))
        self.clock_samples.append([round(now - self.started, 3), round(sim, 3), round(float(stats.get("busy_s", 0.0)), 3)])
        if busy and self._last_clock is not None and now > self._last_clock[0]:
            self.clock_rates.append(round((sim - self._last_clock[1]) / (now - self._last_clock[0]), 2))
        self._last_clock = (now, sim) if busy else None

    def push(self, engine_url: str | list[str], version: int, mode: str = "abort") -> None:
        self.pushes.append(round(time.monotonic() - self.started, 3))
        push_weights(engine_url, version, mode)

    def run(self) -> None:
        every = max(1, round(CLOCK_SAMPLE_S / SLOT_SAMPLE_S))
        while not self.stopped.wait(SLOT_SAMPLE_S):
            clock_due = len(self.samples) % every == 0
            if clock_due:
                self._sample_clock()
            for url, samples, clocks in zip(self.others, self.other_samples, self.other_clocks, strict=True):
                self._sample_other(url, samples, clocks if clock_due else None)
            try:
                load = get_json(self.url)["loads"][0]
            except OSError:
                continue
            self.samples.append((round(time.monotonic() - self.started, 3), int(load["num_running_reqs"])))

    def _sample_other(self, url: str, samples: list[tuple[float, int]], clocks: list[list[float]] | None) -> None:
        try:
            if clocks is not None:
                stats = get_json(url + "/sim/stats")
                clocks.append([round(time.monotonic() - self.started, 3), round(float(stats.get("sim_time_s", 0.0)), 3),
                               round(float(stats.get("busy_s", 0.0)), 3)])
            load = get_json(url + "/v1/loads")["loads"][0]
        except OSError:
            return
        samples.append((round(time.monotonic() - self.started, 3), int(load["num_running_reqs"])))

    def finish(self, result: Result) -> None:
        self.stopped.set()
        self.join(5)
        result.slot_samples, result.push_times, result.clock_rates = self.samples, self.pushes, self.clock_rates
        result.clock_samples = self.clock_samples
        result.engine_slot_samples, result.engine_clock_samples = self.other_samples, self.other_clocks


def trained_tokens_of(sample: Any) -> int:
    if getattr(sample, "remove_sample", False):
        return 0
    mask = sample.loss_mask
    return int(sum(mask)) if mask is not None else int(sample.response_length)


def record_step(result: Result, rollout_id: int, groups: list[list[Any]], labels_of) -> None:
    """Count one trained step: groups, trained tokens, lag per generate call, lengths, checks."""
    result.groups_per_step.append(len(groups))
    for group in groups:
        for sample in group:
            result.trained_tokens += trained_tokens_of(sample)
            result.trained_lengths.append(int(sample.response_length))
            if not sample.tokens or sample.response_length <= 0:
                result.samples_without_tokens += 1
            lps = sample.rollout_log_probs
            if lps is None or len(lps) != sample.response_length:
                result.samples_without_log_probs += 1
            if not getattr(sample, "remove_sample", False):
                result.lags += [rollout_id - int(label) for label in labels_of(sample)]


@dataclass
class EngineReading:
    """The engines' counters at a mark: per engine, generated tokens (answers finished or aborted,
    as the engine counts them) and busy simulated seconds; the first engine's simulated clock;
    output tokens held by their running and waiting requests."""

    tokens: list[int]
    busy: list[float]
    clock0: float
    held: int


def engine_reading(urls: Sequence[str]) -> EngineReading:
    every = [get_json(url + "/sim/stats") for url in urls]
    return EngineReading(tokens=[int(s.get("output_tokens", 0)) for s in every],
                         busy=[float(s.get("busy_s", 0.0)) for s in every],
                         clock0=float(every[0].get("sim_time_s", float("nan"))) if every else float("nan"),
                         held=sum(int(s.get("held_output_tokens", 0)) for s in every))


PER_ENGINE_COLUMN = 6  # a mark's per-engine [tokens, busy s] pairs start here (peer_steady.per_engine)


def mark(result: Result, started: float, urls: Sequence[str], held: Callable[[], int] | None = None) -> None:
    """A step mark: wall s since `started`, trained tokens so far, the engines' generated tokens
    and busy seconds (sums), the first engine's simulated clock and its own busy seconds, then
    each engine's generated tokens and busy seconds. `held`: the contender's own stock outside
    the engines (finished or requeued, not yet trained); given, the stock (that plus what the
    engines' requests hold) is appended to `result.stocks`."""
    e = engine_reading(urls)
    busy0 = e.busy[0] if e.busy else float("nan")
    per_engine = [x for tokens, busy in zip(e.tokens, e.busy, strict=True) for x in (tokens, round(busy, 3))]
    result.step_marks.append([round(time.monotonic() - started, 3), result.trained_tokens, sum(e.tokens),
                              round(sum(e.busy), 3), round(e.clock0, 3), round(busy0, 3), *per_engine])
    if held is not None:
        result.stocks.append(e.held + held())


def group_tokens(groups: Iterable[Iterable[Any]]) -> int:
    """Response tokens of slime groups (lists of Samples)."""
    return sum(int(s.response_length) for group in groups for s in group)



def trainer_loop(wl: Workload, result: Result, fleet: Fleet, sampler: SlotSampler,
                 rollout: Callable[[int], list[list[Any]]], labels_of: Callable[[Any], Iterable[Any]],
                 save: Callable[[int], None], held: Callable[[], int], *,
                 after_push: Callable[[int], None] | None = None, overheads: bool = False) -> None:
    """train.py's order for `wl.steps` steps: generate(r) (`rollout`, the groups to train), count
    them and mark, train(r) (`train_step`), save(r), the weight push; then `after_push(r)`.
    `overheads`: each step's train + push (+ after_push) seconds go to result.step_overheads_s.
    Sets wall_s and steps; the sampler keeps running (the caller finishes it)."""
    started = time.monotonic()
    mark(result, sampler.started, fleet.engines)
    for rollout_id in range(wl.steps):
        groups = rollout(rollout_id)
        record_step(result, rollout_id, groups, labels_of)
        mark(result, sampler.started, fleet.engines, held)
        trained_at = time.monotonic()
        train_step(wl, fleet.engines[0])  # the trainer's clock: the first engine
        save(rollout_id)
        sampler.push(fleet.engines, rollout_id + 1, wl.push_mode)
        if after_push is not None:
            after_push(rollout_id)
        if overheads:
            result.step_overheads_s.append(time.monotonic() - trained_at)
    result.wall_s = time.monotonic() - started
    result.steps = wl.steps
