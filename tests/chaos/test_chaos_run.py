"""Chaos shaped like a run: every part its own process, the ledger as the oracle.

Real parts: a redis-server (the session's, a namespace per test), the engine as a cluster runs
it (tests/support/engine_stack.py: the smg router -> SGLang 0.5.23's own HTTP front and
TokenizerManager -> the simulator as its scheduler), a worker pool (`rollout workers
--processes 2`), the producer (`rollout enqueue`, its own process) and the trainer (its own
process, tests/support/chaos_trainer.py: slime's train.py loop around the real data source with
`pipeline_ledger_dir` set). Processes are SIGKILLed (trainer, producer, a pool child) or
frozen past their job deadlines; nobody is told.

The oracle is what was trained, read back from the ledger's Parquet files: every epoch-0 task
trained in exactly one group (0 lost, 0 twice), no group in two steps, the steps contiguous;
and the counters in Redis equal that truth (`accepted` = groups in the ledger).

Run alone: `python -m pytest tests/chaos/test_chaos_run.py -s -p no:warnings` (prints the reports).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from pipeline.keys import Counter, Keys
from pipeline.store.buffer import GroupBuffer
from tests.support.chaos_helpers import (
    TrainerProcess,
    counters,
    ledger_verdict,
    pipeline_config,
    pool_children,
    producer_process,
    wait_workers,
    write_tasks,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

B, N, ETA = 4, 2, 2
# one engine stack for the module: a long tail of response lengths (lognormal, sigma 2) at 4 ms a
# token, so that a 2048-token cap lets some episodes run ~8 s and a 256-token cap ~1 s
SIM = {"token_latency_s": 0.004, "latency_sigma": 0.3, "length_sigma": 2.0, "slots": 64}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.support.engine_stack import engine_stack, require_stack_parts

    require_stack_parts("smg")
    with engine_stack(tmp_path_factory.mktemp("engine"), 1, sim=SIM) as stack:
        yield stack


class Run:
    """The processes of one run and the faults done to them (for the report)."""

    def __init__(self, redis, redis_url: str, keys: Keys, tmp_path: Path, engine_url: str, tasks: int, **config):
        from scripts.processes import WorkerProcess, write_config
        from workers.sim.tokenizer import default_tokenizer_path

        self.redis, self.keys, self.tmp = redis, keys, tmp_path
        self.tasks = tmp_path / "tasks.jsonl"
        self.task_ids = write_tasks(self.tasks, keys.ns, tasks)
        job_timeout_s = config.pop("job_timeout_s", 120.0)
        data = pipeline_config(redis_url, keys.ns, engine_url, default_tokenizer_path(), batch=B, n=N, eta=ETA,
                               concurrency=4, poll_delay_s=0.05, **config)
        data["workers"].update(job_timeout_s=job_timeout_s, drain_grace_s=5.0)
        data["rollout"]["max_requeues"] = 8
        self.config_path = write_config(data, tmp_path / "pipeline.yaml")
        (tmp_path / "trainer").mkdir()
        self.pool = WorkerProcess(self.config_path, processes=2, log_path=str(tmp_path / "pool.log"))
        self.trainer = TrainerProcess(redis_url, keys.ns, tmp_path / "trainer", self.tasks, batch=B, n=N, eta=ETA,
                                      train_step_s=0.3)
        self.producers: list = []
        self.faults: list[dict] = []
        self.started = time.monotonic()

    async def start(self) -> None:
        self.pool.start()
        await wait_workers(self.redis, self.keys, 2)
        self.trainer.start()
        self.start_producer()

    def start_producer(self) -> None:
        self.producers.append(producer_process(self.config_path, self.tasks, self.tmp / f"producer{len(self.producers)}.log",
                                               max_requeues=8).start())

    def steps_done(self) -> int:
        return len({s["rid"] for s in self.trainer.steps()})

    async def until_step(self, step: int, timeout: float = 120.0, *, training: bool = False) -> None:
        """Until `step` steps are saved; `training`: and the next one is got, not yet saved."""
        deadline = time.monotonic() + timeout
        while self.steps_done() < step or (training and self.trainer.training() < step):
            assert self.trainer.proc.poll() is None, f"trainer exited with {self.trainer.proc.returncode} before step {step}"
            assert time.monotonic() < deadline, f"no step {step} after {timeout}s:\n{self.trainer.log_tail()}"
            await asyncio.sleep(0.05)

    def note(self, what: str, **extra) -> None:
        self.faults.append({"what": what, "at_step": self.steps_done(),
                            "t": round(time.monotonic() - self.started, 1), **extra})

    async def finish(self, timeout: float = 240.0) -> int:
        """Wait for the trainer to end (it stops when the ledger holds every task); its exit status."""
        status = await asyncio.to_thread(self.trainer.proc.wait, timeout)
        self.duration_s = time.monotonic() - self.started
        return status

    async def conclude(self) -> tuple[int, dict]:
        """Wait for the trainer to end, stop the rest, and judge: (its exit status, `verdict()`)."""
        status = await self.finish()
        await self.stop()
        return status, await self.verdict()

    async def stop(self) -> None:
        if self.pool.proc is None or self.pool.proc.returncode is not None:
            return  # stopped before
        for producer in self.producers:
            producer.stop(grace_s=10)
        if self.trainer.proc is not None and self.trainer.proc.poll() is None:
            self.trainer.kill()
        for pid in pool_children(self.pool.proc.pid) if self.pool.proc.poll() is None else []:
            os.kill(pid, signal.SIGCONT)  # a frozen child acts on SIGTERM only once resumed
        self.pool.stop(grace_s=20)

    async def verdict(self) -> dict:
        """The ledger's verdict beside the counters; the report printed by the test."""
        verdict = ledger_verdict(self.trainer.workdir / "ledger", self.task_ids)
        counts = await counters(self.redis, self.keys)
        ready, pending = await GroupBuffer(self.redis, self.keys).depth()
        steps = self.trainer.steps()
        times = sorted({s["rid"]: s["t"] for s in steps}.items())
        gaps = [round(b[1] - a[1], 2) for a, b in zip(times, times[1:])]
        dead = [f[b"reason"].decode() for _, f in await self.redis.xrange(self.keys.dead)]
        replayed, differing = self.trainer.replays()
        in_stream = {f[b"id"].decode() for _, f in await self.redis.xrange(self.keys.groups)}
        return {
            "verdict": verdict, "counters": counts, "ready": ready, "pending": pending, "gaps": gaps, "dead": dead,
            "in_stream": in_stream,
            "report": {
                "tasks": len(self.task_ids), "steps": len(verdict.steps), "groups_in_ledger": len(verdict.groups),
                "lost": len(verdict.lost), "twice": len(verdict.twice), "in_two_steps": len(verdict.in_two_steps),
                "replayed_steps": replayed, "replays_differing": differing, "attempts": dict(verdict.attempts),
                "accepted": counts.get(Counter.ACCEPTED, 0), "buffered": counts.get(Counter.BUFFERED, 0),
                "ready": ready, "pending": pending,
                "duplicates_refused": counts.get(Counter.DUPLICATES, 0), "dead_letters": len(dead),
                "faults": self.faults, "step_gap_max_s": max(gaps, default=0.0),
                "step_gap_median_s": sorted(gaps)[len(gaps) // 2] if gaps else 0.0,
                "duration_s": round(self.duration_s, 1), "trainer_starts": self.trainer.starts,
                "producer_starts": len(self.producers),
            },
        }


def assert_exactly_once(result: dict) -> None:
    """The ledger says 0 lost and 0 twice, and the counters say the same as the ledger."""
    verdict, counts, report = result["verdict"], result["counters"], result["report"]
    assert verdict.lost == [] and verdict.twice == {} and verdict.in_two_steps == [], report
    assert verdict.steps == list(range(len(verdict.steps))), report  # no step missing from the ledger
    assert counts.get(Counter.ACCEPTED, 0) == len(verdict.groups), report  # the counters equal the truth
    discarded = counts.get(Counter.STALE, 0) + counts.get(Counter.FILTERED, 0)
    # every group buffered was trained, discarded, or is still in the stream (ready, or read and held
    # by the due-first reader: pending); what the ledger holds is acknowledged: none of it is left there
    still = result["ready"] + result["pending"]
    assert counts.get(Counter.BUFFERED, 0) == len(verdict.groups) + discarded + still, report
    assert not set(verdict.groups) & result["in_stream"], report
    assert report["replays_differing"] == 0, report  # a step got again after a restart is the same batch


async def test_trainer_producer_and_worker_sigkilled_every_task_trained_once_by_the_ledger(
    redis, redis_url, keys, tmp_path, engine
):
    rng = random.Random(26)
    run = Run(redis, redis_url, keys, tmp_path, engine.router_url, tasks=48, max_response_tokens=256,
              dead_after_s=3.0, max_tries=6)
    try:
        await run.start()
        for step, what in ((2, "trainer"), (3, "producer"), (4, "worker"), (6, "trainer-training")):
            # between steps (a random point of the wait for the next batch), or between get_samples and save
            await run.until_step(step, training=what == "trainer-training")
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            if what.startswith("trainer"):
                run.trainer.kill()
                run.note(f"{what} SIGKILL", training=run.trainer.training())
                run.trainer.start()  # resumes from its checkpoint, as train.py does
            elif what == "producer":
                run.producers[-1].proc.kill()
                run.producers[-1].proc.wait()
                run.note("producer SIGKILL")
                run.start_producer()  # its cursor resumes
            else:
                victim = rng.choice(pool_children(run.pool.proc.pid))
                os.kill(victim, signal.SIGKILL)
                run.note("pool child SIGKILL", pid=victim)  # the pool restarts it; its jobs are reaped
        status = await run.finish()
    finally:
        await run.stop()
    result = await run.verdict()
    print("\nCHAOS run-shaped kills report:", json.dumps(result["report"]))
    assert status == 0, run.trainer.log_tail()
    assert_exactly_once(result)
    assert result["report"]["replayed_steps"] >= 1, result["report"]  # the kill in training made a step replay


async def test_groups_past_the_soft_and_the_hard_deadline_are_handed_back_and_the_run_goes_on_while_a_child_is_frozen(
    redis, redis_url, keys, tmp_path, engine
):
    """A long tail of episode lengths (some ~8 s) against job_timeout_s 6 (soft deadline 3 s),
    and one pool child frozen (SIGSTOP) for longer than job_timeout_s with its groups running:
    they pass the hard deadline too. The slow groups are handed back at the soft deadline and
    trained once in a later attempt; the frozen child's groups are reaped and re-run, and its
    late hand-backs or pushes on SIGCONT are refused by the tombstone or the dedup marker."""
    job_timeout_s = 6.0
    run = Run(redis, redis_url, keys, tmp_path, engine.router_url, tasks=40, max_response_tokens=2048,
              dead_after_s=2.0, max_tries=3, job_timeout_s=job_timeout_s)
    try:
        await run.start()
        await run.until_step(2)
        victim = pool_children(run.pool.proc.pid)[0]
        os.kill(victim, signal.SIGSTOP)
        run.note("pool child SIGSTOP", pid=victim)
        await asyncio.sleep(job_timeout_s + 2.0)
        os.kill(victim, signal.SIGCONT)
        run.note("pool child SIGCONT", pid=victim)
        status = await run.finish()
    finally:
        await run.stop()
    result = await run.verdict()
    report = result["report"]
    report["soft_deadline_hand_backs"] = sum("soft deadline" in reason for reason in result["dead"])
    report["arq_timeouts"] = sum("arq's job timeout" in reason for reason in result["dead"])
    print("\nCHAOS run-shaped deadlines report:", json.dumps(report))
    assert status == 0, run.trainer.log_tail()
    assert_exactly_once(result)
    assert report["soft_deadline_hand_backs"] >= 1, report  # the tail did pass the soft deadline
    assert sum(n for attempt, n in result["verdict"].attempts.items() if attempt >= 1) >= 1, report
    # the run goes on while a child is frozen with due groups: its groups are reaped (no heartbeat)
    # and re-run, so the trainer takes steps before the child wakes. Counted, not timed: step gaps
    # are printed only (a due group handed back at the soft deadline makes its step wait by design,
    # and CI's 2 cores gave medians of 0.85-1.71 s and 3 gaps past the soft deadline on the same code).
    stopped, resumed = (next(f["at_step"] for f in report["faults"] if f["what"] == what)
                        for what in ("pool child SIGSTOP", "pool child SIGCONT"))
    assert resumed - stopped >= 1, report


async def test_redis_sigkilled_three_times_acknowledged_steps_stay_acknowledged_by_the_ledger(namespace, tmp_path, engine):
    """redis-server (`appendfsync always`) SIGKILLed and started again from its AOF three times
    under the whole run of processes. After each restart no group of a step the trainer had
    saved before the kill is back in the stream (an acknowledged step stays acknowledged); at
    the end the ledger says 0 lost, 0 twice and the counters equal it."""
    from pipeline.store.local_redis import LocalRedis
    from pipeline.store.redis_conn import connect

    rng = random.Random(13)
    keys = Keys(namespace)
    (tmp_path / "redis").mkdir()
    server = LocalRedis(appendonly=True, appendfsync="always", data_dir=str(tmp_path / "redis")).start()
    redis = connect(server.url)
    run = Run(redis, server.url, keys, tmp_path, engine.router_url, tasks=40, max_response_tokens=256,
              dead_after_s=3.0, max_tries=6)
    acked_back: list[str] = []
    try:
        await run.start()
        for step in (2, 4, 6):
            await run.until_step(step)
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            saved = {g for s in run.trainer.steps() for g in s["groups"]}  # save() returned for these
            server.stop(kill=True)  # SIGKILL: no shutdown, no last fsync
            run.note("redis-server SIGKILL", saved_groups=len(saved))
            await asyncio.sleep(0.5)
            server.start()  # same port, same AOF; nobody is told
            in_stream = {f[b"id"].decode() for _, f in await redis.xrange(keys.groups)}
            acked_back += sorted(saved & in_stream)
        status, result = await run.conclude()
    finally:
        await run.stop()
        await redis.aclose()
        server.close()
    result["report"]["acked_back"] = acked_back
    print("\nCHAOS run-shaped redis AOF report:", json.dumps(result["report"]))
    assert status == 0, run.trainer.log_tail()
    assert acked_back == [], result["report"]
    assert_exactly_once(result)
