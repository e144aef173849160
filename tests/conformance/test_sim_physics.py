"""The simulated engine's step times against their source, aiconfigurator-core (NVIDIA's measured
SGLang latency model, the test extra): the committed tables are what it computes, the
interpolation between grid points stays within 10% of it, and `rollout engine --model
Qwen/Qwen3-8B --gpu h100_sxm --tp 1` serves fixed batches of 1 to 256 requests whose generation
takes what aiconfigurator's static estimate (`predict_decode_latency`) says, within 10%.
Times here are simulated seconds (the engine's own clock), never wall time."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from functools import cache
from typing import Any

import pytest

from workers.sim.physics import available_tables, load_table

pytestmark = pytest.mark.conformance


@cache
def aic(model: str, gpu: str, tp: int = 1) -> Any:
    try:
        from aiconfigurator_core.sdk.engine import EngineHandle
    except ImportError:
        from tests.support.conformance_support import unavailable

        unavailable("aiconfigurator-core is not installed (extra `test`)")
    return EngineHandle.compile(model, gpu, "sglang", tp_size=tp)


def _split(stem: str) -> tuple[str, str, int]:
    model, gpu, tp = stem.rsplit("--", 2)
    return model.replace("--", "/"), gpu, int(tp.removeprefix("tp"))


@pytest.mark.parametrize("stem", available_tables())
def test_a_committed_table_is_what_aiconfigurator_computes(stem: str):
    """scripts/gen_step_tables.py run now gives the committed file's numbers."""
    from scripts.gen_step_tables import generate
    from workers.sim.physics import table_path

    model, gpu, tp = _split(stem)
    aic(model, gpu, tp)  # skips (or fails in CI) without aiconfigurator
    committed = json.loads(table_path(model, gpu, tp).read_text())
    assert generate(model, gpu, tp) == committed


@pytest.mark.parametrize("stem", ["Qwen--Qwen3-8B--h100_sxm--tp1", "Qwen--Qwen3-8B--h200_sxm--tp1",
                                  "Qwen--Qwen3-0.6B--h100_sxm--tp1"])
def test_step_times_between_grid_points_stay_within_10_percent(stem: str):
    """Every batch size 1-256 at contexts off the grid (decode_step_latency), and batched prefills
    of batch sizes, tokens and cached prefixes off the grid (predict_prefill_latency)."""
    model, gpu, tp = _split(stem)
    engine, table = aic(model, gpu, tp), load_table(model, gpu, tp)
    worst = 0.0
    for batch in range(1, 257):
        for context in (100, 700, 1500, 3000, 6000, 12000):
            truth = engine.decode_step_latency(batch, context, 2) / 1000
            worst = max(worst, abs(table.decode_s(batch, batch * context) - truth) / truth)
    for batch in (1, 3, 8, 20, 50, 100):
        for tokens in (10, 100, 300, 1000, 3000, 6000, 12000):
            if batch * tokens > 40_000:
                continue  # beyond --max-prefill-tokens' reach
            for prefix in (0, 1000, 5000, 20000, 36000):
                truth = engine.predict_prefill_latency(batch, tokens + prefix, prefix) / 1000
                worst = max(worst, abs(table.prefill_s([(tokens, prefix)] * batch) - truth) / truth)
    assert worst < 0.10, worst


def test_a_prefill_batch_is_timed_per_sequence_as_aiconfigurators_batched_prefill():
    """A prefill batch of 8 requests x 1,000 new tokens takes what aiconfigurator's batched
    prefill says (`predict_prefill_latency(8, 1000, 0)`), where one 8,000-token sequence takes 14%
    more, through the scheduler's own prefill step; a request's cached prefix counts for its
    own attention only. Mutation caught: workers/sim/scheduler.py `_run_prefill` passing the
    batch as one sequence (`seqs = [(tokens, sum(r.filled for r, _ in batch))]`, the old timing)."""
    import asyncio

    from workers.sim.scheduler import BatchScheduler, SchedulerConfig, SimReq

    engine, table = aic("Qwen/Qwen3-8B", "h100_sxm"), load_table("Qwen/Qwen3-8B", "h100_sxm")

    def prefill_s(inputs: list[int], prefix: list[int] | None = None) -> float:
        sch = BatchScheduler(SchedulerConfig(kv_pool_tokens=10**6, max_running_requests=64,
                                             chunked_prefill_size=16384), table, asyncio.Event())
        if prefix:  # a finished request leaves `prefix` in the cache
            sch.add(SimReq("p", prefix, [7], 1))
            sch.step()
        before = sch.stats["prefill_busy_s"]
        for i, n in enumerate(inputs):
            sch.add(SimReq(str(i), (prefix or []) + [1_000 * (i + 1) + t for t in range(n)], [7, 7], 2))
        sch.step()
        assert sch.stats["prefill_steps"] == (2 if prefix else 1)
        return sch.stats["prefill_busy_s"] - before

    batched = engine.predict_prefill_latency(8, 1000, 0) / 1000
    one_sequence = engine.predict_prefill_latency(1, 8000, 0) / 1000
    assert one_sequence > 1.1 * batched
    assert prefill_s([1000] * 8) == pytest.approx(batched, rel=0.01)
    cached = list(range(500_000, 502_000))
    assert prefill_s([1000] * 4, cached) == pytest.approx(engine.predict_prefill_latency(4, 3000, 2000) / 1000, rel=0.02)


@pytest.mark.parametrize("stem", ["Qwen--Qwen3-8B--h100_sxm--tp1", "Qwen--Qwen3-0.6B--h200_sxm--tp1"])
def test_the_context_and_prefix_axes_reach_the_models_context_length(stem: str):
    """The tables end at the model's context length (aiconfigurator's model config, 40,960 for
    Qwen3), so a decode at 38k context or a prefill over a 30k prefix is read inside the grid,
    within 10% of aiconfigurator, not clamped at the axis' old 16k/32k end. Mutation caught:
    scripts/gen_step_tables.py without the context length on its axes (`contexts =
    DECODE_CONTEXTS`, `prefixes = PREFILL_PREFIXES`, tables regenerated): the axes end short of
    it and these reads are clamped (with the old 16k prefix end a 36k-prefix prefill read 33% short)."""
    from aiconfigurator_core.sdk.utils import get_model_config_from_model_path

    model, gpu, tp = _split(stem)
    engine, table = aic(model, gpu, tp), load_table(model, gpu, tp)
    context = int(get_model_config_from_model_path(model)["context"])
    assert table.context_length == table.prefill_prefixes[-1] == table.decode_contexts[-1] == context
    for batch in (1, 16, 64):
        truth = engine.decode_step_latency(batch, 38_000, 2) / 1000
        assert table.decode_s(batch, batch * 38_000) == pytest.approx(truth, rel=0.10)
    for tokens, prefix in ((1000, 30_000), (4000, 36_000), (100, 40_000)):
        truth = engine.predict_prefill_latency(1, tokens + prefix, prefix) / 1000
        assert table.prefill_s([(tokens, prefix)]) == pytest.approx(truth, rel=0.10)


def _call(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read() or b"null")


def test_rollout_engine_serves_fixed_batches_at_aiconfigurator_step_times(tmp_path):
    """`rollout engine --model Qwen/Qwen3-8B --gpu h100_sxm --tp 1` (a faster clock: times are
    simulated): paused in place, a batch of N requests of 1,000 distinct input tokens and 64
    output tokens each queues; on continue they prefill and then decode together. Their 63
    decode steps (the prefill samples the first token) take predict_decode_latency(N, 1000, 64)
    within 10%, for N from 1 to 256."""

    from tests.support.engine_stack import free_port

    port = free_port()
    log = open(tmp_path / "engine.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "scripts.cli", "engine", "--model", "Qwen/Qwen3-8B", "--gpu",
                             "h100_sxm", "--tp", "1", "--time-scale", "20", "--port", str(port),
                             "--length-mu", "8", "--length-sigma", "0.01", "--weight-push-gbps", "0"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                info = _call(f"{url}/server_info")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()
                time.sleep(0.2)
        assert (info["model_path"], info["sim_gpu"], info["tp_size"]) == ("Qwen/Qwen3-8B", "h100_sxm", 1)
        assert info["sim_step_source"].startswith("aiconfigurator-core")
        engine = aic("Qwen/Qwen3-8B", "h100_sxm")
        for batch in (1, 8, 32, 128, 256):
            served = asyncio.run(_fixed_batch(url, batch))
            expected = engine.predict_decode_latency(batch, 1000, 64) / 1000
            assert abs(served - expected) / expected < 0.10, (batch, served, expected)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


async def _fixed_batch(url: str, batch: int) -> float:
    """Simulated seconds the engine spent decoding one batch of `batch` requests."""
    import aiohttp

    # no connection cap (aiohttp's default, 100, would hold back the rest of a batch of 128)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def post(path: str, body: dict[str, Any]) -> Any:
            async with http.post(f"{url}{path}", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        async def stats() -> dict[str, Any]:
            async with http.get(f"{url}/sim/stats") as resp:
                return dict(await resp.json())

        before = await stats()
        await post("/pause_generation", {"mode": "in_place"})
        asks = [asyncio.create_task(post("/generate", {
            "input_ids": [(r * 1009 + j) % 150_000 + 100 for j in range(1000)],
            "sampling_params": {"max_new_tokens": 64}})) for r in range(batch)]
        while (await stats())["running"] < batch:
            await asyncio.sleep(0.05)
        await post("/continue_generation", {})
        answers = await asyncio.gather(*asks)
        after = await stats()
    assert all(a["meta_info"]["completion_tokens"] == 64 for a in answers)
    assert after["decode_steps"] - before["decode_steps"] == 63
    return float(after["decode_busy_s"] - before["decode_busy_s"])


@pytest.mark.parametrize("stem", ["Qwen--Qwen3-8B--h100_sxm--tp1", "Qwen--Qwen3-8B--h200_sxm--tp1"])
def test_the_kv_pool_is_aiconfigurators_estimate_at_sglangs_default_memory_fraction(stem: str):
    """The pool (SGLang's max_total_num_tokens) at SGLang's default --mem-fraction-static for the
    GPU (memory_hook.py: 0.836 on an 80 GiB H100 with --chunked-prefill-size 8192) is what
    aiconfigurator's `estimate_kv_cache` gives for that fraction, within one token of rounding."""
    from aiconfigurator_core.sdk.memory import estimate_kv_cache

    from workers.sim.physics import AIC_DATABASE

    model, gpu, tp = _split(stem)
    aic(model, gpu, tp)
    table = load_table(model, gpu, tp)
    fraction = table.default_mem_fraction(8192)
    estimate = estimate_kv_cache(model, gpu, "sglang", AIC_DATABASE, max_num_tokens=8192, max_batch_size=256,
                                 memory_fraction_kind="of_total", memory_fraction_value=fraction, tp_size=tp)
    assert abs(table.kv_pool_tokens(fraction) - estimate["total_kv_size_tokens"]) <= 1
    if gpu == "h100_sxm":
        assert fraction == 0.836
