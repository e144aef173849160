"""scripts/bench_peer.py drives slime's own rollout code (the pinned snapshot) against the
simulated engine: two steps of each slime contender, counts only (never times).

(a) sglang_rollout.generate_rollout, (b) the same with partial rollout and over-sampling, run
here in the test's process one after the other (slime's GenerateState reset between them), and
(c) fully_async_rollout.generate_rollout_fully_async in a child process, as the benchmark runs
every slime contender (its background worker and HTTP client belong to one process), meanwhile.
Each contender has its own simulated engine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conformance_support import require_slime

pytestmark = pytest.mark.conformance

STEPS = 2


def test_slime_contenders_train_whole_groups_with_tokens_and_log_probs(tmp_path):
    require_slime("slime.rollout.sglang_rollout", "slime.rollout.fully_async_rollout")
    from scripts.bench_peer import (
        Workload,
        finish,
        run_contender,
        run_slime_contender,
        write_inputs,
    )
    from scripts.processes import SimEngineProcess

    wl = Workload(steps=STEPS, train_step_s=0.1, token_latency_s=0.001)
    tasks, prompts = write_inputs(tmp_path)

    def in_process(kind: str):
        (tmp_path / kind).mkdir()
        with SimEngineProcess(wl.engine_args(str(tasks)), log_path=str(tmp_path / kind / "engine.log")) as engine:
            return finish(run_slime_contender(kind, wl, engine.url, prompts, tmp_path / kind), wl)

    with ThreadPoolExecutor(1) as pool:
        child = pool.submit(run_contender, "c", wl, tmp_path, tasks, prompts, quiet=True)
        results = [in_process("a"), in_process("b"), finish(child.result(), wl)]
    for r in results:
        assert r.ran, f"({r.contender}) {r.name} did not run: {r.reason}"
        assert r.groups_per_step == [wl.batch] * STEPS, (r.contender, r.groups_per_step)
        assert len(r.trained_lengths) == STEPS * wl.batch * wl.n
        assert r.samples_without_tokens == 0 and r.samples_without_log_probs == 0, r.contender
        assert len(r.lags) >= STEPS * wl.batch * wl.n and min(r.lags) >= 0, r.contender  # one per generate call
        assert r.engine_tokens >= r.trained_tokens + r.carried_tokens > 0, r.contender
    a = results[0]
    assert max(a.lags) == 0  # synchronous: every call ran on the weights of the step that trains it
    assert a.carried_tokens == 0
