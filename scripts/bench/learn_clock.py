"""The learning bench's user's clock (issue 45 item 4, docs/benchmarks.md "The user's clock"):
how a run's simulated seconds split between sync's generation and its trainer step, the answer
lengths the tiny model wrote, and the seconds each contender takes to reach sync's final accuracy.

A real RL step is generation-bound: sync waits for a step's longest answer, then trains. The
learning bench plays that with the `sums` family (workers/sim/sums.py: worked answers of 2-30
lines, a heavy tail) and an engine whose steps are `STEP_TIME_FACTOR[family]` times the Qwen3-0.6B
H100 table's (workers/sim/physics.py `ScaledSteps`), calibrated so that sync's generation lasts
`GEN_TO_TRAIN_GOAL` times its trainer step (the calibration and its source: docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
from typing import Any

from workers.sim.sums import percentiles

GEN_TO_TRAIN_GOAL = (2.0, 3.0)  # sync's generation s / its trainer s per step, as in real runs
ETA2_GOAL = 0.6  # eta 2 reaches sync's final accuracy in <= this share of sync's seconds
# the engine's step-time factor per task family: 1 for arith (its 16-token answers, the CI
# tests' and the earlier figures' clock); sums' from the calibration run (docs/benchmarks.md)
STEP_TIME_FACTOR = {"arith": 1.0, "sums": 1.5}


def step_split(generate_s: dict[int, float], trainer_steps: list[tuple[int, float, float]],
               time_scale: float) -> dict[str, float]:
    """The median simulated seconds of a step's generate call (slime's loop waiting for the
    rollout: under sync the whole generation) and of its trainer step (its budget, or the CPU's
    time where the step overran), and their ratio. Medians: the first call also waits for the
    producer's first tasks, an eval round's steps for the eval."""
    if not generate_s or not trainer_steps:
        return {}
    generation = statistics.median(generate_s.values()) * time_scale
    trainer = statistics.median(max(budget, used) for _, budget, used in trainer_steps) * time_scale
    return {"generate_s": generation, "trainer_s": trainer, "ratio": generation / trainer if trainer else float("nan")}


def length_stats(batches: dict[int, list[Any]]) -> dict[str, Any]:
    """Percentiles of the trained samples' response lengths (tokens): over the run and per step."""
    by_step: dict[int, list[int]] = {}
    for rollout_id, batch in batches.items():
        for sample in _flat(batch):
            by_step.setdefault(rollout_id, []).append(int(sample.response_length))
    every = [n for lengths in by_step.values() for n in lengths]
    return {"overall": percentiles(every), "by_step": {rid: percentiles(ns) for rid, ns in sorted(by_step.items())}}


def _flat(batch: list[Any]) -> list[Any]:
    return [s for item in batch for s in (_flat(item) if isinstance(item, list) else [item])]


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def clock_lines(summary: dict[str, Any]) -> str:
    """Per contender: generation vs trainer seconds a step (sync's against the 2-3x goal), the
    answers' lengths, the simulated seconds to sync's final accuracy against sync's, with the eval
    rounds and less them (eta 2's against the 0.6x goal on the training's clock, the eval rounds
    left out, where the run recorded them: a user evaluates rarely or in the background)."""
    contenders = summary.get("contenders", {})
    sync = contenders.get("sync", {})
    lines = ["| contender | generate s / step (median, simulated) | trainer s / step | generate / trainer | "
             "response tokens p50 / p90 / p99 / max (mean) | simulated s to sync's final | / sync's | "
             "the same less the eval rounds and overruns | / sync's | "
             "less them, to sync's final 95% interval | / sync's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in contenders.items():
        splits = [s for s in c.get("split", []) if s]
        gen = statistics.fmean(s["generate_s"] for s in splits) if splits else None
        train = statistics.fmean(s["trainer_s"] for s in splits) if splits else None
        ratio = gen / train if gen is not None and train else None
        goal = ""
        if name == "sync" and ratio is not None:
            goal = f" (goal {GEN_TO_TRAIN_GOAL[0]:g}-{GEN_TO_TRAIN_GOAL[1]:g}x: {verdict(_in(ratio, GEN_TO_TRAIN_GOAL))})"
        cells = []
        for key in ("seconds_to_sync_final", "seconds_less_eval_to_sync_final", "seconds_less_eval_to_sync_interval"):
            secs, base = c.get(key), sync.get(key)
            cells += [_num(secs, "", "not reached"), _num(secs / base if secs is not None and base else None, "x")]
        lines.append(f"| {name} | {_num(gen)} | {_num(train)} | {_num(ratio, 'x')}{goal} | {_lengths(c)} | "
                     + " | ".join(cells) + " |")
    if "eta 2" in contenders:
        lines.append("\n" + _eta2_line(sync, contenders["eta 2"]))
        inside, base = contenders["eta 2"].get("seconds_less_eval_to_sync_interval"), sync.get("seconds_less_eval_to_sync_interval")
        if inside is not None and base:
            lines.append(f"(beside the goal: eta 2 inside sync's final 95% interval at {inside:.1f} s, {inside / base:.2f}x "
                         f"of sync's {base:.1f} s to it)")
    return "\n".join(lines)


def _eta2_line(sync: dict[str, Any], eta2: dict[str, Any]) -> str:
    """The goal line: on the training's clock (less the eval rounds) where recorded, else with them."""
    key, clock = ("seconds_less_eval_to_sync_final", "less the eval rounds and the trainer's overruns")
    if not sync.get(key):
        key, clock = "seconds_to_sync_final", "the eval rounds included"
    base, secs = sync.get(key), eta2.get(key)
    if not base:
        return "seconds to sync's final accuracy: sync's own not recorded"
    met = secs is not None and secs <= ETA2_GOAL * base
    shown = f"{secs:.1f} s = {secs / base:.2f}x" if secs is not None else "not reached"
    return (f"seconds to sync's final accuracy ({clock}): eta 2 {shown} of sync's {base:.1f} s "
            f"(goal <= {ETA2_GOAL:g}x): {verdict(met)}")


def _in(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def _num(value: float | None, unit: str = "", missing: str = "-") -> str:
    return f"{value:.2f}{unit}" if value is not None else missing


def _lengths(c: dict[str, Any]) -> str:
    """The response-length percentiles pooled over seeds (their mean per percentile)."""
    runs = [r for r in c.get("response_tokens", []) if r]
    if not runs:
        return "-"

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in runs)

    return f"{mean('p50'):.0f} / {mean('p90'):.0f} / {mean('p99'):.0f} / {mean('max'):.0f} ({mean('mean'):.1f})"
