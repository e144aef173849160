"""The learning bench's trainer on a simulated GPU's clock (scripts/oracle/cpu_actor.py `TrainerClock`,
scripts/bench/learn.py `trainer_tokens_per_s`): a step lasts its tokens at the simulated rate,
slowed by the time scale; CPU work that outlasts it is counted, never hidden."""

from __future__ import annotations

import time

import pytest

from scripts.bench.learn import AREAL_GPUS, AREAL_PROMPTS_PER_STEP, trainer_tokens_per_s
from scripts.bench.peer_contenders import WORKLOADS
from scripts.oracle.cpu_actor import TrainerClock


def test_a_step_lasts_its_simulated_budget() -> None:
    clock = TrainerClock(tokens_per_s=10_000.0, time_scale=0.5)  # 1,000 tokens: 0.1 s simulated, 0.2 s real
    started = time.monotonic()
    clock.fill(1_000, started)
    assert 0.2 <= time.monotonic() - started < 0.6  # slept its budget (a loaded machine only adds)
    assert clock.overruns == 0 and clock.cpu_share < 0.5


def test_cpu_work_past_the_budget_is_an_overrun() -> None:
    clock = TrainerClock(tokens_per_s=100_000.0, time_scale=1.0)  # 1,000 tokens: 0.01 s
    started = time.monotonic()
    time.sleep(0.05)  # the CPU's work took five budgets
    clock.fill(1_000, started)
    assert time.monotonic() - started < 0.05 + 0.5  # nothing like a budget slept on top (load only adds)
    assert clock.overruns == 1 and clock.cpu_share > 4


def test_no_rate_no_clock() -> None:
    clock = TrainerClock()
    started = time.monotonic()
    clock.fill(10**6, started)
    assert time.monotonic() - started < 0.5 and clock.overruns == 0 and clock.budget_s(10**6) == 0


def test_trainer_rate_is_areals_per_gpu_scaled_by_parameters() -> None:
    """AReaL's cluster: 512 x 16 answers of the areal-7b workload's mean length (7,896: the
    frontier's plans, docs/benchmarks.md) in 91.4 s on 192 GPUs, x 7.6 / 0.6."""
    wl = WORKLOADS["areal-7b"]
    per_gpu_7b = AREAL_PROMPTS_PER_STEP * wl.n * 7_896 / wl.train_step_s / AREAL_GPUS
    assert trainer_tokens_per_s() == pytest.approx(per_gpu_7b * 7.6 / 0.6, rel=0.01)
