"""Sizing that fills the engines (issue 46 item 3): `rollout plan` (scripts/bench/sizing.py) finds
the smallest B at which the bound's ideal reaches 0.95 of N x capacity, or says the trainer binds
first; the producer (real redis-server) and the launcher's check say so once where B is below it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import msgspec
import pytest

from pipeline.sizing import SizingAdvice, below_advice, load_advice
from pipeline.sizing import main as check_main
from pipeline.state import PipelineState, TrainerInfo
from producers.enqueue import ProducerOptions, run_producer
from scripts.bench.sizing import main as plan_main
from scripts.bench.sizing import plan
from tests.producers.test_enqueue import make_config, wait_for, write_tasks
from tests.scripts.test_bench_ideal import flat


def test_equal_answers_fill_one_engine_at_the_first_b():
    """4 slots, groups of 4 equal answers, eta 1: B = 1 already keeps the engine full."""
    advice, trials = plan(flat(slots=4, batch=1, n=4, eta=1, lengths=[10]))
    assert advice.batch == 1 and [t.batch for t in trials] == [1]
    assert advice.ideal_tokens_per_s == pytest.approx(advice.capacity_tokens_per_s)


def test_a_heavy_tail_needs_a_larger_b_and_the_planner_finds_the_smallest():
    """Answers of 10 or 400 tokens on 16 slots at eta 1: B = 1 leaves the engine idle behind the
    tail; the planner doubles then bisects to the B where the ideal first reaches 0.95."""
    base = flat(slots=16, batch=1, n=4, eta=1, lengths=[10, 10, 10, 400], steps=24)
    advice, trials = plan(base)
    by_b = {t.batch: t for t in trials}
    assert advice.batch > 1 and by_b[advice.batch].fill >= 0.95
    assert by_b[advice.batch - 1].fill < 0.95  # bisection leaves the B below it tried and short
    assert by_b[1].fill < 0.95 and not advice.trainer_binds
    assert f"B >= {advice.batch} groups per step fills 1 engine(s) at eta 1" in advice.summary()


def test_a_trainer_slower_than_the_engines_binds_first():
    """The trainer's step grows with B from 1 s at B = 1: 4 answers of 10 tokens a second at most,
    far below one engine's 444 tok/s: no B fills it, and no B is tried."""
    advice, trials = plan(dataclasses.replace(flat(slots=4, batch=1, n=4, eta=1, lengths=[10]), train_step_s=1.0),
                          step_batch=1)
    assert advice.trainer_binds and trials == [] and advice.trainer_tokens_per_s == pytest.approx(40.0)
    assert "the trainer binds first" in advice.summary()
    assert "rollout_batch_size 8: the trainer binds first" in (below_advice(advice, batch=8, eta=1, n=4) or "")


def _advice(**kw) -> SizingAdvice:
    base = dict(batch=4, eta=1, n=2, engines=2, capacity_tokens_per_s=1000.0, ideal_tokens_per_s=1950.0,
                trainer_tokens_per_s=5000.0, workload="test")
    return SizingAdvice(**{**base, **kw})  # type: ignore[arg-type]


def test_the_check_speaks_only_below_the_advice_or_for_another_eta(tmp_path, capsys):
    advice = _advice()
    assert below_advice(advice, batch=4, eta=1, n=2) is None and below_advice(advice, batch=6, eta=1, n=2) is None
    line = below_advice(advice, batch=2, eta=1, n=2) or ""
    assert "rollout_batch_size 2 is below the 4" in line and "0.97 of N x capacity (2,000 tok/s" in line
    assert "planned for eta 1, n 2; this run has eta 2" in (below_advice(advice, batch=4, eta=2, n=2) or "")
    path = tmp_path / "advice.json"
    path.write_text(json.dumps({"batch": 4}))
    with pytest.raises(ValueError, match="advice.json: not `rollout plan --save` output"):
        load_advice(path)
    path.write_bytes(msgspec.json.encode(advice))
    assert check_main([str(path), "--batch", "2", "--eta", "1", "--n", "2"]) == 0
    assert "sizing: rollout_batch_size 2 is below the 4" in capsys.readouterr().out
    assert check_main([str(path), "--batch", "4", "--eta", "1", "--n", "2"]) == 0
    assert capsys.readouterr().out == ""


async def test_the_producer_warns_once_when_the_trainers_b_is_below_the_advice(tmp_path, redis_url, redis, keys,
                                                                               namespace, caplog):
    path = tmp_path / "advice.json"
    path.write_bytes(msgspec.json.encode(_advice()))
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 30})
    config = msgspec.structs.replace(make_config(redis_url, namespace, {"a": 1}, batch=8, eta=1, n=2))
    config = msgspec.structs.replace(config, rollout=msgspec.structs.replace(config.rollout, sizing_advice=str(path)))
    await PipelineState(redis, keys).set_trainer_info(TrainerInfo(rollout_batch_size=2, n_samples_per_prompt=2, eta=1))
    caplog.set_level(logging.WARNING, logger="rollout.enqueue")
    stop = asyncio.Event()
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, stop_event=stop,
                                           options=ProducerOptions(poll_s=0.02)))

    async def admitted() -> bool:
        return await redis.zcard(keys.queue) == 4  # the trainer's (1 + 0 + 1) x 2

    await wait_for(admitted)
    await asyncio.sleep(0.3)  # more loops, each refreshing the limits
    stop.set()
    stats = await run
    said = [r.getMessage() for r in caplog.records if "below the 4 that keeps the engines full" in r.getMessage()]
    assert len(said) == 1 and "rollout_batch_size 2" in said[0]
    assert any("below the 4" in w for w in stats.warnings)


def test_rollout_plan_prints_and_saves_its_advice(tmp_path, capsys):
    """The command on the bench's flat workload (issue25: 32 slots at 4 ms a token)."""
    path = tmp_path / "advice.json"
    assert plan_main(["--workload", "issue25", "--eta", "1", "--steps", "10", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    advice = load_advice(path)
    assert advice.batch >= 1 and advice.eta == 1 and advice.n == 4 and advice.command.startswith("rollout plan ")
    assert f"advice: B >= {advice.batch} groups per step" in out and "| B (groups/step) |" in out


def test_the_launcher_says_it_once_when_its_b_is_below_the_advice(tmp_path, redis_url):
    from tests.scripts.test_scripts import _run, _slime_env

    path = tmp_path / "advice.json"
    path.write_bytes(msgspec.json.encode(_advice(eta=3, n=8)))
    env = _slime_env(tmp_path, redis_url, ROLLOUT_SIZING_ADVICE=str(path), ROLLOUT_BATCH_SIZE="2", N_SAMPLES="8")
    result = _run("run_slime_grpo.sh", "--check", env=env)
    assert result.stderr.count("sizing: rollout_batch_size 2 is below the 4 that keeps the engines full") == 1
    fine = _run("run_slime_grpo.sh", "--check", env={**env, "ROLLOUT_BATCH_SIZE": "4"})
    assert "sizing:" not in fine.stderr + fine.stdout
    (tmp_path / "bad.json").write_text("[]")
    bad = _run("run_slime_grpo.sh", "--check", env={**env, "ROLLOUT_SIZING_ADVICE": str(tmp_path / "bad.json")})
    assert f"ROLLOUT_SIZING_ADVICE={tmp_path}/bad.json is not readable" in bad.stderr
