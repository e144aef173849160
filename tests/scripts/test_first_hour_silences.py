"""Issue 27 item 2: the silences and misleading figures a new user meets in the first hour.
Each test here fails on fe89cd3."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import EnvConfig, PipelineConfig, parse_config
from pipeline.schema import PromptJob, Status, Task
from tests.support.conformance_support import require_nemo_skills
from workers.envs.base import EpisodeRecord
from workers.envs.math import MathEnvironment, last_boxed

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ math: the last \boxed{} is the answer


async def _math_reward(label: str, answer: str) -> tuple[float, object]:
    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline"}))
    task = Task(id="m1", env="m", prompt="Solve it.", label=label)
    session = await env.start(task)
    try:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": answer}]
        verification = await session.verify(EpisodeRecord(task=task, messages=messages, response_text=answer,
                                                           status=Status.COMPLETED, turns=1))
    finally:
        await session.close()
        await env.aclose()
    return verification.reward, verification.components["answer"]


@pytest.mark.parametrize("label,answer,reward", [
    ("4", "First \\boxed{3}. Wait, I dropped a carry: the final answer is \\boxed{4}.", 1.0),
    ("3", "First \\boxed{3}. Wait, I dropped a carry: the final answer is \\boxed{4}.", 0.0),
    ("\\frac{1}{2}", "maybe \\boxed{\\frac{1}{3}}, no: \\boxed{\\frac{1}{2}}", 1.0),
    ("(1, 2)", "one box holds both: \\boxed{(1, 2)}", 1.0),
])
async def test_math_scores_the_last_boxed_answer(label, answer, reward):
    got, extracted = await _math_reward(label, answer)
    assert got == reward, (label, answer, extracted)


def test_last_boxed_reads_as_nemo_skills_does():
    extract_answer = require_nemo_skills("nemo_skills.evaluation.math_grader").modules[
        "nemo_skills.evaluation.math_grader"].extract_answer  # the pinned snapshot

    for text in ("a \\boxed{3} b \\boxed{\\frac{1}{2}} c", "\\boxed{{1,2}}", "no box"):
        ours = last_boxed(text)
        theirs = extract_answer(text)
        assert (ours is None) == (theirs is None), text
        if ours is not None:
            assert theirs in ours, (text, ours, theirs)
    assert last_boxed("cut off \\boxed{4") is None


# ------------------------------------------------------------------ rollout --debug: a traceback for a config error


def _rollout(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    full.update({"COLUMNS": "200", "PYTHONUNBUFFERED": "1", "ROLLOUT_REDIS_OUTAGE_S": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "scripts.cli", *argv], env=full, text=True, capture_output=True,
                          timeout=timeout, cwd=cwd or REPO, check=False)


@pytest.mark.parametrize("command,config,extra", [
    ("workers", "rollout:\n  rollout_batch_size: 0\n", ()),
    ("enqueue", "environments:\n  gsm:\n    kind: maths\n", ("--tasks", "t.jsonl", "--without-trainer")),
    ("prepare", "environments:\n  gsm:\n    kind: maths\n    dataset: {source: jsonl, files: [d.jsonl]}\n",
     ("--output", "out.jsonl")),
])
def test_debug_prints_the_traceback_of_a_configuration_error(tmp_path, command, config, extra):
    (tmp_path / "p.yaml").write_text(config)
    (tmp_path / "t.jsonl").write_text('{"id": "a", "env": "gsm", "prompt": "1+1?", "label": "2"}\n')
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?"}\n')  # no label
    plain = _rollout(command, "--config", str(tmp_path / "p.yaml"), *extra, cwd=tmp_path)
    debug = _rollout("--debug", command, "--config", str(tmp_path / "p.yaml"), *extra, cwd=tmp_path)
    assert plain.returncode == debug.returncode == 2, (plain.stderr, debug.stderr)
    assert "Traceback" not in plain.stderr
    assert plain.stderr.lstrip().startswith(f"rollout {command}: "), plain.stderr
    assert "Traceback (most recent call last)" in debug.stderr, debug.stderr
    assert debug.stderr.rstrip().endswith(plain.stderr.strip())  # the same message, after the traceback


# ------------------------------------------------------------------ rollout workers: what it waits for


def test_workers_say_every_few_seconds_that_they_wait_for_redis():
    from pipeline.store.local_redis import free_port

    url = f"redis://:pw-not-shown@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    result = _rollout("workers", "--redis-url", url, env={"ROLLOUT_REDIS_OUTAGE_S": "6"}, timeout=60)
    waited = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if "waiting for Redis at redis://:***@127.0.0.1" in line]
    assert len(lines) >= 2, result.stderr  # at once, then every few seconds (WAIT_LOG_S = 5)
    assert "giving up in" in lines[0] and "ROLLOUT_REDIS_OUTAGE_S" in lines[0]
    assert "pw-not-shown" not in result.stderr and waited < 30


def test_wait_for_redis_returns_once_it_is_up(redis_url, caplog):
    from workers.worker_log import wait_for_redis

    caplog.set_level(logging.INFO, "workers.settings")
    wait_for_redis(redis_url, budget_s=1)
    assert not [r for r in caplog.records if "waiting for Redis" in r.getMessage()]  # up: nothing to say


# ------------------------------------------------------------------ workers: a line per group, never the payload


def _worker_config(redis_url: str, namespace: str, engine_url: str) -> PipelineConfig:
    return parse_config({
        "redis": {"url": redis_url, "namespace": namespace},
        "engine": {"url": engine_url, "max_retries": 1, "retry_backoff_s": 0.01},
        "rollout": {"max_response_tokens": 256, "n_samples_per_prompt": 2},
        "environments": {"calc": {"kind": "calculator"}},
        "workers": {"heartbeat_s": 0.5, "dead_after_s": 2.0, "poll_delay_s": 0.02},
    })


async def _run_jobs(redis, redis_url, keys, count: int, secret: str) -> None:
    from pipeline.store.jobqueue import create_arq_pool, enqueue_prompt_job
    from tests.support.policy_helpers import trainer_started
    from workers.settings import build_worker, stop_worker
    from workers.sim.engine import serve_sim_engine

    await trainer_started(redis, keys)
    async with serve_sim_engine() as sim:
        arq = await create_arq_pool(redis_url, keys)
        for i in range(count):
            task = Task(id=f"task-{i}", env="calc", prompt=f"{secret} What is {i} * 7?", label=str(7 * i))
            await enqueue_prompt_job(arq, PromptJob(task=task, epoch=0, n_samples=2, admission_version=0,
                                                    enqueued_at=time.time()), keys)
        await arq.aclose()
        worker = build_worker(_worker_config(redis_url, keys.ns, sim.url), handle_signals=False)
        running = asyncio.create_task(worker.async_run())
        try:
            deadline = time.monotonic() + 30
            while await redis.xlen(keys.groups) < count and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await stop_worker(worker, running)
        assert await redis.xlen(keys.groups) == count


async def test_a_line_per_finished_group_at_info(redis, redis_url, keys, caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger("arq.worker").setLevel(logging.WARNING)  # as `rollout workers` without --verbose
    try:
        await _run_jobs(redis, redis_url, keys, 1, "SECRET-PROMPT")
    finally:
        logging.getLogger("arq.worker").setLevel(logging.NOTSET)
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.groups"]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"group done: task task-0, env calc, reward mean \d\.\d{3}, \d+ tokens, \d+\.\ds "
                        r"\(2 episodes, 0 failed\)", lines[0]), lines[0]


def test_the_group_lines_are_rate_limited():
    from pipeline.synthetic import make_group
    from workers.worker_log import GroupLog

    now = [0.0]
    group_log = GroupLog(every_s=1.0, clock=lambda: now[0])
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("workers.groups")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for i in range(50):  # 50 groups in 0.49 s, then one more a second later
            now[0] = i * 0.01
            group_log.finished(make_group(f"g{i}", n=2), tokens=10)
        now[0] = 1.5
        group_log.finished(make_group("last", n=2), tokens=10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert len(records) == 2, records
    assert records[1].endswith("; 49 more group(s) since the last line")


async def test_verbose_shows_the_job_id_never_the_payload(redis, redis_url, keys, caplog):
    caplog.set_level(logging.INFO)  # --verbose: arq's per-job lines at INFO
    await _run_jobs(redis, redis_url, keys, 2, "SECRET-PROMPT")
    arq_lines = [r.getMessage() for r in caplog.records if r.name == "arq.worker"]
    started = [line for line in arq_lines if "→" in line]
    assert len(started) == 2, arq_lines
    for line in started:
        assert f"{keys.ns}:" in line and "run_group(…)" in line, line  # the job id, and no argument
    everything = "\n".join(r.getMessage() for r in caplog.records)
    assert "SECRET-PROMPT" not in everything and "\\x8" not in everything and "b'" not in everything


# ------------------------------------------------------------------ the trainer's wait line names its cause


def _source_args(redis_url: str, ns: str, **extra: Any):
    from tests.support.source_helpers import source_args

    return source_args(redis_url, ns, eta=1, batch=2, n=2, pipeline_wait_timeout_s=1.2, **extra)


def _wait_lines(redis_url: str, ns: str, rid: int, caplog, **extra: Any) -> list[str]:
    from pipeline.slime.data_source import RedisDataSource, generate_rollout

    source = RedisDataSource(_source_args(redis_url, ns, **extra))
    try:
        with caplog.at_level(logging.INFO, logger="pipeline.slime"), pytest.raises(TimeoutError):
            generate_rollout(source.args, rid, source)
    finally:
        source.close()
    return [r.getMessage() for r in caplog.records if "waiting for groups" in r.getMessage()]


def _admit(redis_url: str, ns: str, tmp_path: Path, count: int, *, live_worker: bool = False) -> None:
    """The real producer admits `count` tasks (no trainer yet: on the config's B and eta);
    with `live_worker`, a worker's real heartbeat, and no worker to run the jobs."""
    from pipeline.keys import Keys
    from pipeline.store.redis_conn import connect
    from producers.enqueue import ProducerOptions, run_producer
    from workers.liveness import Liveness

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"id": "t{i}", "env": "calc", "prompt": "{i} * 7?", "label": "{7 * i}"}}\n'
                             for i in range(count)))
    config = parse_config({"redis": {"url": redis_url, "namespace": ns}, "environments": {"calc": {"kind": "calculator"}},
                           "rollout": {"rollout_batch_size": 2, "eta": 1, "n_samples_per_prompt": 2}})

    async def go() -> None:
        client = connect(redis_url)
        stats = await run_producer(config, tasks, redis=client, options=ProducerOptions(wait_for_trainer=False))
        assert stats.admitted == count
        if live_worker:
            assert await Liveness(client, Keys(ns), "w1", heartbeat_s=1.0, dead_after_s=20.0).beat()
        await client.aclose()

    asyncio.run(go())


def test_wait_line_producer_idle(redis_url, namespace, caplog):
    lines = _wait_lines(redis_url, namespace, 0, caplog)
    assert lines and "the producer is idle or out of tasks" in lines[0], lines
    assert f"is `rollout enqueue` running on namespace {namespace}?" in lines[0]


def test_wait_line_no_workers_alive(redis_url, namespace, caplog, tmp_path):
    _admit(redis_url, namespace, tmp_path, 4)
    lines = _wait_lines(redis_url, namespace, 0, caplog)
    assert lines and "no workers alive (none has registered" in lines[0], lines
    assert "producer" not in lines[0]


def test_wait_line_groups_in_flight(redis_url, namespace, caplog, tmp_path):
    _admit(redis_url, namespace, tmp_path, 4, live_worker=True)
    lines = _wait_lines(redis_url, namespace, 0, caplog)
    assert lines and re.search(r"4 group\(s\) in flight on 1 live worker\(s\), the oldest enqueued \d+s ago", lines[0]), lines


def test_wait_line_due_group_still_generating(redis_url, namespace, caplog, tmp_path):
    _admit(redis_url, namespace, tmp_path, 4, live_worker=True)
    lines = _wait_lines(redis_url, namespace, 1, caplog)  # step 1, eta 1: the groups admitted at 0 are due
    assert lines and "4 due group(s) still generating" in lines[0], lines


# ------------------------------------------------------------------ the stale-storm warning while the trainer waits


def test_stale_storm_warning_fires_while_no_batch_fills(redis_url, namespace, caplog):
    from pipeline.synthetic import make_group
    from tests.support.source_helpers import push_groups

    push_groups(redis_url, namespace, [make_group(f"old{i}:0", n=2, admission_version=0) for i in range(6)])
    with caplog.at_level(logging.WARNING, logger="pipeline.slime"):
        _wait_lines(redis_url, namespace, 6, caplog, pipeline_stale_policy="drop")  # no batch: every group is stale
    storms = [r.getMessage() for r in caplog.records if "were stale" in r.getMessage()]
    assert len(storms) == 1 and "6 of 6 groups read were stale (eta 1)" in storms[0], storms


# ------------------------------------------------------------------ the monitor's staleness: what waits, what was trained


def test_monitor_staleness_is_of_what_waits_and_what_was_trained_recently(redis_url, namespace):
    """The issue's case: groups trained at lag 0 long ago, the policy now 25, the buffer empty:
    the trainer's own max was 0, and so is the monitor's (it said 25 for every group)."""
    import json

    from pipeline.keys import Keys
    from pipeline.slime.data_source import RedisDataSource, generate_rollout
    from pipeline.state import PipelineState
    from pipeline.store.redis_conn import connect
    from pipeline.synthetic import make_group
    from tests.support.source_helpers import push_groups

    source = RedisDataSource(_source_args(redis_url, namespace, pipeline_consume_order="arrival"))
    try:
        for rid in range(3):  # each step trains 2 groups generated by its own policy: lag 0
            push_groups(redis_url, namespace, [make_group(f"s{rid}-{i}:0", n=2, admission_version=rid, seed=i)
                                               for i in range(2)])
            out = generate_rollout(source.args, rid, source)
            assert out.metrics["rollout/pipeline/staleness_max"] == 0
            source.save(rid)
    finally:
        source.close()

    async def move_on() -> None:
        client = connect(redis_url)
        await PipelineState(client, Keys(namespace)).set_version(25)
        await client.aclose()

    asyncio.run(move_on())
    result = _rollout("monitor", "--json", "--redis-url", redis_url, "--namespace", namespace)
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["recent_groups"] == 6 and snap["buffer_ready"] == 0
    assert snap["staleness_hist"] == {"0": 6} and snap["staleness_max"] == 0, snap
    assert snap["trained_steps"] == 3

    async def wandb_figures() -> dict[str, float]:
        from pipeline.ops.metrics import figures
        from pipeline.ops.monitor import snapshot

        client = connect(redis_url)
        try:
            return figures(await snapshot(client, Keys(namespace)))
        finally:
            await client.aclose()

    flat = asyncio.run(wandb_figures())  # what `rollout monitor --wandb` logs
    assert flat["staleness/max"] == 0 and flat["staleness/trained_hist/0"] == 6
    assert not [k for k in flat if k.startswith("staleness/") and k.endswith("/25")]

    push_groups(redis_url, namespace, [make_group("late:0", n=2, admission_version=22)])  # waits at lag 3
    snap = json.loads(_rollout("monitor", "--json", "--redis-url", redis_url, "--namespace", namespace).stdout)
    assert snap["waiting_staleness_hist"] == {"3": 1} and snap["staleness_max"] == 3
    table = _rollout("monitor", "--once", "--redis-url", redis_url, "--namespace", namespace).stdout
    assert "trained (last 3 steps)" in table, table
