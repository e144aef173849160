"""The one harness every bench section starts its contenders with: a private redis-server, the
simulated engine (one process, or several behind slime's router), the pipeline's own processes
(`rollout workers`, `rollout enqueue --follow`) on a config written for them, the engines' HTTP
counters, and the CPU each process spent. Sections compose these parts; none starts them itself.

    with pipeline_contender(workdir, tasks, config_for, engine_args=args) as c:
        ...  # c.redis.url, c.fleet.url, c.procs.workers, c.procs.producer

Everything is torn down in reverse order on the way out, also when the body raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.store.local_redis import LocalRedis, free_port
from scripts.processes import ChildProcess, SimEngineProcess, WorkerProcess, write_config

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "scripts" / "demo_tasks.jsonl"


# ------------------------------------------------------------------ the engines' HTTP side


def post_json(url: str, path: str, body: dict[str, Any] | None = None, *, timeout: float = 30) -> bytes:
    """POST `body` as JSON to url + path; the raw reply."""
    request = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return bytes(reply.read())


def get_json(url: str, *, timeout: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def engine_stats(url: str, *, timeout: float = 10) -> dict[str, Any]:
    """The simulated engine's own counters (GET /sim/stats)."""
    stats: dict[str, Any] = get_json(f"{url}/sim/stats", timeout=timeout)
    return stats


def wait_until(predicate: Callable[[], Any], timeout_s: float) -> bool:
    """Poll `predicate` every 0.1 s until it is true (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def math_tasks(workdir: Path) -> Path:
    """The demo's math tasks (the one environment the benches configure) as tasks.jsonl in `workdir`."""
    rows = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    tasks = workdir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows if r["env"] == "math"))
    return tasks


# ------------------------------------------------------------------ engines


@dataclass
class Fleet:
    """The engines a contender runs on: `url` is what its rollout sends to (slime's router, or
    the one engine), `engines` each engine's own URL (weight pushes, counters), `pids` theirs."""

    url: str
    engines: list[str]
    pids: list[int] = field(default_factory=list)


def as_fleet(engine: str | Fleet) -> Fleet:
    return engine if isinstance(engine, Fleet) else Fleet(engine, [engine])


@contextlib.contextmanager
def fleet_of(engine_args: Sequence[str], engines: int, logs: Path | None) -> Iterator[Fleet]:
    """`engines` fresh simulated engines (one process each, logs engine.log, engine1.log, ... in
    `logs`; None: no logs),
    behind sglang-router where more than one: the router slime launches, listing every engine,
    with `--policy round_robin`: its default (cache_aware) sent one contender's requests, which
    share the chat template's prefix, nearly all to one engine (slot use 0.01 on the other in a
    trial run), and a weight push flushes the prefix cache anyway."""
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(SimEngineProcess(list(engine_args), log_path=_log(logs, f"engine{i or ''}.log")))
                   for i in range(engines)]
        urls, pids = [e.url for e in started], [e.proc.pid for e in started if e.proc is not None]
        if len(started) == 1:
            yield Fleet(urls[0], urls, pids)
            return
        port = free_port()
        router = ChildProcess([], log_path=_log(logs, "router.log"))
        router.args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                       "--worker-urls", *urls, "--policy", "round_robin", "--prometheus-port", str(free_port()),
                       "--log-level", "warn"]
        stack.enter_context(router)
        url = f"http://127.0.0.1:{port}"
        if not wait_until(lambda: _listed(url) == len(urls), 120):
            raise RuntimeError(f"sglang-router on {url} did not list the {len(urls)} engines in 120 s")
        yield Fleet(url, urls, pids)


def _log(folder: Path | None, name: str) -> str | None:
    return str(folder / name) if folder is not None else None


def _listed(router_url: str) -> int:
    try:
        workers = get_json(router_url + "/workers").get("workers") or []
    except (OSError, ValueError):
        return 0
    return sum(1 for w in workers if w.get("is_healthy", True))


# ------------------------------------------------------------------ the pipeline's processes


@dataclass
class PipelineProcs:
    """`rollout workers` and `rollout enqueue --follow` on one pipeline config. Started workers
    first, stopped producer first (a producer without workers only queues). `log`: one log file
    for both; empty: workers.log and enqueue.log in `workdir`."""

    config_path: str
    tasks: Path
    workdir: Path
    processes: int = 1
    concurrency: int | None = None
    enqueue_args: Sequence[str] = ()
    log: str = ""
    workers: WorkerProcess = field(init=False)
    producer: ChildProcess = field(init=False)

    def __post_init__(self) -> None:
        self.workers = WorkerProcess(self.config_path, processes=self.processes, concurrency=self.concurrency,
                                     log_path=self.log or str(self.workdir / "workers.log"))
        # the default poll: a published version wakes the producer at once (issue 25 item 3)
        self.producer = ChildProcess(["enqueue", "--config", self.config_path, "--tasks", str(self.tasks), "--follow",
                                      *self.enqueue_args, "--quiet"],
                                     log_path=self.log or str(self.workdir / "enqueue.log"))

    def start(self) -> PipelineProcs:
        self.workers.start()
        try:
            self.producer.start()
        except BaseException:
            self.workers.stop()
            raise
        return self

    def stop(self) -> None:
        self.producer.stop()
        self.workers.stop()

    def __enter__(self) -> PipelineProcs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Contender:
    """What `pipeline_contender` started: the private Redis, the engines, the pipeline's processes."""

    redis: LocalRedis
    fleet: Fleet
    procs: PipelineProcs

    def pids(self, engine_pid: int = 0) -> dict[str, int]:
        """Its processes by name, for `CpuMeter` (the workers with their pool: a negative pid;
        `engine_pid`: the engine's, where the fleet was given without its pids)."""
        assert self.procs.workers.proc is not None and self.procs.producer.proc is not None
        assert self.redis.proc is not None
        return {"workers": -self.procs.workers.proc.pid, "producer": self.procs.producer.proc.pid,
                "redis": self.redis.proc.pid, **engine_pids(self.fleet, engine_pid)}


def engine_pids(fleet: Fleet, engine_pid: int = 0) -> dict[str, int]:
    """The engines' processes by name: "engine", or "engine 1".."engine N" for a fleet."""
    return {f"engine {i + 1}" if len(fleet.pids) > 1 else "engine": pid
            for i, pid in enumerate(fleet.pids or [engine_pid])}


@contextlib.contextmanager
def pipeline_contender(workdir: Path, tasks: Path, config: Callable[[str, str], dict[str, Any]], *,
                       fleet: Fleet | None = None, engine_args: Sequence[str] = (), engines: int = 1,
                       processes: int = 1, concurrency: int | None = None) -> Iterator[Contender]:
    """A fresh redis-server, the engines (`fleet` when given, else `engines` started with
    `engine_args`), `config(redis_url, engine_url)` written to workdir/pipeline.yaml, and the
    workers and producer on it; all stopped on the way out, the processes first."""
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(LocalRedis())
        fleet = fleet or stack.enter_context(fleet_of(engine_args, engines, workdir))
        config_path = write_config(config(redis.url, fleet.url), workdir / "pipeline.yaml")
        procs = stack.enter_context(PipelineProcs(config_path, tasks, workdir, processes=processes,
                                                  concurrency=concurrency))
        yield Contender(redis, fleet, procs)


# ------------------------------------------------------------------ CPU per process


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """user + system CPU of a process (and its reaped children), from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = sum(int(x) for x in fields[11:15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (a worker pool's processes), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += parents.get(current, [])
    return out


class CpuMeter:
    """CPU seconds per named process between start() and stop(); a negative pid: the process
    -pid and its descendants (a worker pool)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.before: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(p, children=False) for p in (process_tree(-pid) if pid < 0 else [pid]))
                for name, pid in self.pids.items()}

    def start(self) -> None:
        self.before = self._now()

    def stop(self) -> dict[str, float]:
        after = self._now()
        return {name: round(after[name] - self.before.get(name, 0.0), 3) for name in self.pids}
