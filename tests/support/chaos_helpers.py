"""Shared pieces of the run-level chaos tests: the slime-side trainer thread, the run's parts
(tasks, pipeline config, simulated engine and worker processes) and the worker-liveness waits.
Each test brings its own parameters, producer and faults."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from pipeline.keys import Keys
from pipeline.slime.data_source import RedisDataSource, generate_rollout


class Trainer(threading.Thread):
    """slime's loop: generate_rollout -> (train) -> save -> `after_step`, recording what each step trained.

    Stops before a step when `done(self)` is true, or after `max_steps`.
    """

    def __init__(
        self,
        redis_url: str,
        ns: str,
        *,
        batch: int,
        n: int,
        eta: int,
        max_steps: int,
        done: Callable[[Trainer], bool],
        after_step: Optional[Callable[[int], None]] = None,
        wait_timeout_s: float = 90.0,
    ):
        super().__init__(daemon=True)
        self.args = SimpleNamespace(
            pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=batch, n_samples_per_prompt=n,
            pipeline_eta=eta, pipeline_wait_timeout_s=wait_timeout_s, pipeline_publish_engine=False,
            # keep (and count) stale groups: a requeued task is re-admitted under the producer's current
            # epoch, which would blur the per-epoch exactly-once count these tests are about
            pipeline_stale_policy="keep",
            # this loop pushes weights (`after_step`) before the next rollout, as slime's train.py does
            pipeline_trainer_loop="sync",
        )
        self.max_steps, self.done, self.after_step = max_steps, done, after_step
        self.groups: list[list[Any]] = []  # every trained group's samples, in training order
        self.steps = 0
        self.error: BaseException | None = None

    @property
    def trained_groups(self) -> list[str]:
        return [group[0].metadata["pipeline"]["group_id"] for group in self.groups]

    def trained(self) -> list[tuple[str, int]]:
        return [trained_key(g) for g in self.trained_groups]

    def trained_tasks(self, epoch: int = 0) -> set[str]:
        return {t for t, e in self.trained() if e == epoch}

    def lost_and_duplicates(self, task_ids: Iterable[str]) -> tuple[list[str], dict[tuple[str, int], int]]:
        """The epoch-0 tasks never trained, and each (task, epoch) trained more than once (with its count)."""
        per_task = Tally(self.trained())
        lost = sorted(set(task_ids) - {t for t, e in per_task if e == 0})
        return lost, {t: c for t, c in per_task.items() if c > 1}

    def run(self) -> None:
        source = RedisDataSource(self.args)
        try:
            for rid in range(self.max_steps):
                if self.done(self):
                    return
                self.groups += generate_rollout(self.args, rid, source).samples
                time.sleep(0.05)  # the optimizer step
                source.save(rid)
                self.steps = rid + 1
                if self.after_step is not None:
                    self.after_step(rid)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            source.close()

    def join_and_check(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), "trainer did not finish"
        if self.error is not None:
            raise self.error


def trained_key(group_id: str) -> tuple[str, int]:
    """(task id, epoch) from a job id `{task}:{epoch}` or `{task}:{epoch}r{requeue}`."""
    task, tail = group_id.rsplit(":", 1)
    return task, int(tail.split("r")[0])


async def counters(redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}


async def live_workers(redis, keys: Keys) -> list[str]:
    return [w.decode() for w in await redis.zrange(keys.workers, 0, -1)]


async def wait_workers(redis, keys: Keys, count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while len(await live_workers(redis, keys)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers heart-beating after {timeout}s"
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------ a run's parts

def write_tasks(path: Path, ns: str, count: int) -> list[str]:
    """`count` arithmetic tasks (`{ns}-t{i}`: "What is i + i?") as a JSONL file; their ids."""
    ids = [f"{ns}-t{i}" for i in range(count)]
    lines = [json.dumps({"id": tid, "env": "arith", "prompt": f"What is {i} + {i}?", "label": str(2 * i)})
             for i, tid in enumerate(ids)]
    path.write_text("\n".join(lines) + "\n")
    return ids


def pipeline_config(redis_url: str, ns: str, engine_url: str, tokenizer: str, *, batch: int, n: int, eta: int,
                    max_response_tokens: int, concurrency: int, dead_after_s: float, poll_delay_s: float,
                    max_tries: int) -> dict:
    """The pipeline config of a chaos run: the arithmetic environment on the simulated engine."""
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine_url, "tokenizer": tokenizer, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": n, "rollout_batch_size": batch, "eta": eta,
                    "max_response_tokens": max_response_tokens},
        "environments": {"arith": {"kind": "arithmetic"}},
        "workers": {"concurrency": concurrency, "heartbeat_s": 0.5, "dead_after_s": dead_after_s,
                    "poll_delay_s": poll_delay_s, "max_tries": max_tries},
    }


@dataclass
class SimRun:
    """What `sim_run` started: the config (as written to `config_path`) and the worker processes;
    the test's producer task, when it sets one, runs with `stop_event=stop`."""

    data: dict
    config_path: str
    workers: list  # scripts.processes.WorkerProcess, in start order
    tmp_path: Path
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    producer: Optional[asyncio.Task] = None  # run_producer(..., stop_event=stop), stopped on the way out

    def start_worker(self) -> Any:
        """One more `rollout workers` process on the same config (log `w{index}.log`)."""
        from scripts.processes import WorkerProcess

        worker = WorkerProcess(self.config_path, log_path=str(self.tmp_path / f"w{len(self.workers)}.log")).start()
        self.workers.append(worker)
        return worker


@asynccontextmanager
async def sim_run(redis, keys: Keys, redis_url: str, tmp_path: Path, *, sim: dict, workers: int = 2,
                  **config: Any) -> AsyncIterator[SimRun]:
    """The engine path a cluster runs: the session's stack (smg -> SGLang's own front -> the
    simulator, tests/support/engine_stack.py), its simulators set to `sim` (SimConfig fields, 64 slots an
    engine) with a clean slate; `pipeline_config(redis_url, keys.ns, ..., **config)` written to
    `tmp_path/pipeline.yaml`, and `workers` `rollout workers` processes on it, heart-beating (seen
    through `redis`) when the run is handed over. On the way out: the producer task stopped, then
    every worker process (started here or by `SimRun.start_worker`; a frozen one resumed first)."""
    from scripts.processes import write_config
    from tests.support.engine_stack import shared_stack
    from workers.sim.tokenizer import default_tokenizer_path

    tokenizer = default_tokenizer_path()
    stack = await asyncio.to_thread(shared_stack)
    await asyncio.to_thread(stack.configure, **{"slots": 64, **sim})
    data = pipeline_config(redis_url, keys.ns, stack.router_url, tokenizer, **config)
    run = SimRun(data, write_config(data, tmp_path / "pipeline.yaml"), [], tmp_path)
    try:
        for _ in range(workers):
            run.start_worker()
        await wait_workers(redis, keys, workers)
        yield run
    finally:
        try:
            await stop_producer(run.stop, run.producer)
        finally:
            for w in run.workers:
                w.signal(signal.SIGCONT)  # a SIGSTOPped worker acts on SIGTERM only once resumed
                w.stop(grace_s=5)


async def stop_producer(stop: asyncio.Event, producer: Optional[asyncio.Task]) -> None:
    """Set the producer's stop event and wait (15 s at most) for its task to end, errors and all."""
    stop.set()
    if producer is not None and not producer.done():
        await asyncio.wait_for(asyncio.gather(producer, return_exceptions=True), 15)


# ------------------------------------------------------------------ lost replies

class LossyProxy:
    """A loopback TCP proxy in front of a redis-server that loses replies.

    Every chunk a client sends is forwarded; each reply chunk the server sends back is, with
    probability `rate`, not forwarded: the proxy drops both connections instead. The server
    has executed the command (its reply exists), the client never hears of it and, through
    redis-py's retry, sends it again: the fault a write must be safe against. `down(s)` also
    refuses new connections and cuts open ones for `s` seconds (a Redis restart, as clients
    see it). Runs its own event loop in a thread, so sync code and subprocesses can use it.
    """

    def __init__(self, target_port: int, *, rate: float = 0.01, seed: int = 0, host: str = "127.0.0.1"):
        import random as _random

        self.target = (host, target_port)
        self.rate = rate
        self.rng = _random.Random(seed)
        self.port = 0
        self.replies = 0  # reply chunks seen
        self.dropped = 0  # reply chunks lost (connections dropped)
        self.refused = 0
        self._down_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._lose: list[list] = []  # [pattern, times left]: lose the reply to a request containing it
        self.stalled = False  # hold every reply (a half-open connection, as the client sees it)

    def lose_reply_to(self, pattern: bytes, times: int = 1) -> None:
        """Lose the reply to the next `times` requests whose bytes contain `pattern` (b"EXEC", ...)."""
        self._lose.append([pattern, times])

    def _should_lose(self, request: bytes) -> bool:
        for rule in self._lose:
            if rule[1] > 0 and rule[0] in request:
                rule[1] -= 1
                return True
        return bool(self.rate) and self.rng.random() < self.rate

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LossyProxy:
        self._thread = threading.Thread(target=self._run, daemon=True, name="lossy-proxy")
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def down(self, seconds: float) -> None:
        """Refuse new connections and cut the open ones for `seconds`."""
        self._down_until = time.monotonic() + seconds

        def cut() -> None:
            for w in list(self._writers):
                w.transport.abort()

        assert self._loop is not None
        self._loop.call_soon_threadsafe(cut)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._down_until:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        def drop() -> None:
            writer.transport.abort()
            up_writer.transport.abort()

        last = [b""]  # the latest request chunk of this connection

        async def client_to_server() -> None:
            while data := await reader.read(65536):
                last[0] = data
                up_writer.write(data)
                await up_writer.drain()

        async def server_to_client() -> None:
            while data := await up_reader.read(65536):
                self.replies += 1
                while self.stalled:
                    await asyncio.sleep(0.05)
                if self._should_lose(last[0]):
                    self.dropped += 1
                    return
                writer.write(data)
                await writer.drain()

        try:
            pumps = [asyncio.ensure_future(client_to_server()), asyncio.ensure_future(server_to_client())]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pumps:
                p.cancel()
        except Exception:  # noqa: BLE001 - any error: the connection is gone, as with a real fault
            pass
        finally:
            drop()
            self._writers -= {writer, up_writer}

    def close(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)

    def __enter__(self) -> LossyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ a run as processes

class TrainerProcess:
    """`python -m tests.support.chaos_trainer` (slime's train.py loop, the ledger on) in `workdir`:
    SIGKILLable, and started again it resumes from its checkpoint as train.py does."""

    def __init__(self, redis_url: str, ns: str, workdir: Path, tasks: Path, *, batch: int, n: int, eta: int,
                 max_steps: int = 1000, train_step_s: float = 0.05):
        import sys

        self.workdir = workdir
        self.args = [sys.executable, "-m", "tests.support.chaos_trainer", "--redis-url", redis_url, "--namespace", ns,
                     "--workdir", str(workdir), "--tasks", str(tasks), "--batch", str(batch), "--n", str(n),
                     "--eta", str(eta), "--max-steps", str(max_steps), "--train-step-s", str(train_step_s)]
        self.proc: Any = None
        self.starts = 0

    def start(self) -> TrainerProcess:
        import subprocess

        self.starts += 1
        log = open(self.workdir / f"trainer{self.starts}.log", "wb")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
        log.close()
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def training(self) -> int:
        """The rollout id of the step it got and has not saved yet, or of the last saved one (-1: none)."""
        path = self.workdir / "training"
        return int(path.read_text() or -1) if path.exists() else -1

    def steps(self, log: str = "steps") -> list[dict]:
        """The saved steps' log lines (rid, wall time t, group ids), in order; `log="got"`: every
        batch got (rid, group ids), replays included."""
        path = self.workdir / f"{log}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def replays(self) -> tuple[int, int]:
        """(steps got again after a restart, those whose groups differed from the first time)."""
        first: dict[int, list[str]] = {}
        replayed = differing = 0
        for got in self.steps("got"):
            if got["rid"] in first:
                replayed += 1
                differing += got["groups"] != first[got["rid"]]
            else:
                first[got["rid"]] = got["groups"]
        return replayed, differing

    def log_tail(self) -> str:
        return "\n".join((self.workdir / f"trainer{i}.log").read_text(errors="replace")[-1500:]
                         for i in range(1, self.starts + 1))


def producer_process(config_path: str, tasks: Path, log_path: Path, *, max_requeues: int = 5) -> Any:
    """`rollout enqueue` of one epoch of `tasks` (a child process; SIGKILLable, its cursor resumes)."""
    from scripts.processes import ChildProcess

    return ChildProcess(["enqueue", "--config", config_path, "--tasks", str(tasks), "--epochs", "1",
                         "--max-requeues", str(max_requeues), "--poll", "0.05", "--quiet"], log_path=str(log_path))


def pool_children(pool_pid: int) -> list[int]:
    """The worker processes of a `rollout workers --processes N` parent (its spawned children)."""
    children = Path(f"/proc/{pool_pid}/task/{pool_pid}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@dataclass
class LedgerVerdict:
    """What the ledger (the Parquet files, the oracle of exactly-once training) says was trained."""

    steps: list[int]
    groups: dict[str, int]  # group id -> the step that trained it
    lost: list[str]  # epoch-0 tasks with no trained group
    twice: dict[str, list[str]]  # (task:epoch) -> its groups, where more than one was trained
    in_two_steps: list[str]  # group ids found in more than one step
    attempts: Tally  # attempt number -> groups trained


def ledger_verdict(ledger_dir: Path, task_ids: Iterable[str]) -> LedgerVerdict:
    from tests.support.chaos_trainer import ledger_rows

    groups: dict[str, set[int]] = {}
    per_task: dict[str, set[str]] = {}
    attempts: Tally = Tally()
    for row in ledger_rows(ledger_dir):
        groups.setdefault(row["group_id"], set()).add(row["rollout_id"])
        per_task.setdefault(f"{row['task_id']}:{row['epoch']}", set()).add(row["group_id"])
    for group_id in groups:
        attempts[int(group_id.rsplit(":", 1)[1].partition("r")[2] or 0)] += 1
    steps = sorted({s for where in groups.values() for s in where})
    return LedgerVerdict(
        steps=steps,
        groups={g: min(where) for g, where in groups.items()},
        lost=sorted(set(task_ids) - {key.rsplit(":", 1)[0] for key in per_task if key.endswith(":0")}),
        twice={key: sorted(gs) for key, gs in per_task.items() if len(gs) > 1},
        in_two_steps=sorted(g for g, where in groups.items() if len(where) > 1),
        attempts=attempts,
    )
