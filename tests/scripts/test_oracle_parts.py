"""The learning oracle's product-side parts that need no engine or slime: the stand-ins' patches
without pytest (scripts/oracle/slime_loop.py `Patches`), the bench's lag per trained token from
the drift table (scripts/bench/learn.py `_lags`), and a `rollout engine` command line as the
SimConfig fields the engine stack's fronts take (workers/sim/stack.py `sim_fields`)."""

from __future__ import annotations

import types

import pytest


def test_patches_replace_attributes_and_put_them_back_in_reverse_order():
    from scripts.oracle.slime_loop import Patches

    target = types.SimpleNamespace(a=1, b="two")
    with Patches() as patches:
        patches.setattr(target, "a", 10)
        patches.setattr(target, "a", 100)  # twice: undone to the first value, not the second
        patches.setattr(target, "b", None)
        assert (target.a, target.b) == (100, None)
    assert (target.a, target.b) == (1, "two")
    patches = Patches()
    with pytest.raises(AttributeError):  # as pytest's MonkeyPatch.setattr(raising=True): no new attributes
        patches.setattr(target, "missing", 1)
    patches.undo()
    assert not hasattr(target, "missing")


def test_the_lag_is_each_trained_tokens_own_weighted_by_tokens():
    from pipeline.learning.drift import LagDrift
    from scripts.bench.learn import _lags

    def row(lag: int, tokens: int) -> LagDrift:
        return LagDrift(lag=lag, tokens=tokens, mean_abs_dlogp=0.0, share_outside=0.0, tis_clipped=0.0, ess=1.0)

    assert _lags([row(0, 500)]) == {"lag_mean": 0.0, "lag_max": 0}  # sync: every token at lag 0
    assert _lags([row(0, 300), row(1, 100), row(3, 0)]) == {"lag_mean": 0.25, "lag_max": 1}  # empty rows: no lag
    assert _lags([]) == {"lag_mean": 0.0, "lag_max": 0}


def test_a_rollout_engine_command_line_is_the_fronts_simulator_config():
    from workers.sim.stack import sim_fields

    fields = sim_fields(["--policy-path", "/tmp/policy", "--model", "Qwen/Qwen3-0.6B", "--time-scale", "0.025",
                         "--seed", "3", "--weight-version", "0", "--context-length", "1024"])
    assert fields == {"policy_path": "/tmp/policy", "model": "Qwen/Qwen3-0.6B", "time_scale": 0.025, "seed": 3,
                      "weight_version": "0"}  # defaults and the context (the front's) left out
