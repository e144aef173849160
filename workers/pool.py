"""`rollout workers --processes N --concurrency C --config FILE`: a pool of worker processes.

Each process is one arq worker running up to C groups at once (C x n episodes).
The parent starts N children (spawned: no inherited event loops or sockets),
forwards SIGTERM/SIGINT to them (each drains: stops taking jobs, finishes or hands
back its groups within `workers.drain_grace_s`), and exits when all have; a child
still alive `drain_grace_s + KILL_MARGIN_S` after the signal is SIGKILLed (its jobs are
released by the reaper of whatever workers remain, or re-run after a restart).

A child that dies unexpectedly (non-zero exit, killed) is restarted after a backoff that
doubles per recent failure (2 s .. 60 s); more than `MAX_RESTARTS` failures within
`RESTART_WINDOW_S` stop the pool with exit status 1 and one line naming the cause (a crash
loop, e.g. Redis gone past its outage budget: the workers exit with status 3). A child
that exits 0 drained on purpose (it got SIGTERM itself, e.g. from a process-group kill)
and is not restarted. A pool told to stop restarts nothing, not even one whose backoff
was running when the signal came, and a SIGTERM that arrives while a child is being started
reaches that child too (`_spawn` forwards it once the child is in `self.children`).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.usage import usage_error

log = logging.getLogger("workers.pool")

RESTART_BACKOFF_S = 2.0  # first restart delay; doubles per failure in the window, up to RESTART_BACKOFF_MAX_S
RESTART_BACKOFF_MAX_S = 60.0
MAX_RESTARTS = 5  # failures within RESTART_WINDOW_S before the pool gives up
RESTART_WINDOW_S = 300.0
KILL_MARGIN_S = 15.0  # after drain_grace_s: SIGKILL what is still alive


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollout workers", description="Start a pool of rollout worker processes.")
    p.add_argument("--config", help="pipeline YAML (default: embedded defaults)")
    p.add_argument("--processes", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--concurrency", type=int, default=None, help="groups per process (default: workers.concurrency)")
    p.add_argument("--redis-url", default=None, help="overrides redis.url")
    p.add_argument("--namespace", default=None, help="overrides redis.namespace")
    p.add_argument("--engine-url", default=None, help="overrides engine.url ('auto' = follow {ns}:engine)")
    p.add_argument("--tokenizer", default=None, help="overrides engine.tokenizer")
    p.add_argument("--verbose", action="store_true", help="log every job (arq's per-job lines)")
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    return args


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    overrides: dict[str, Any] = {}
    for flag, dotted in (("redis_url", "redis.url"), ("namespace", "redis.namespace"),
                         ("engine_url", "engine.url"), ("tokenizer", "engine.tokenizer")):
        value = getattr(args, flag)
        if value is not None:
            overrides[dotted] = value
    return load_config(args.config, overrides)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    if not verbose:  # arq logs two lines per job: too many at thousands of groups per minute
        logging.getLogger("arq.worker").setLevel(logging.WARNING)


def _child(config: PipelineConfig, concurrency: int | None, verbose: bool) -> None:
    from workers.settings import run_worker  # heavy imports only in the child

    setup_logging(verbose)
    run_worker(config, concurrency=concurrency)


class Pool:
    def __init__(
        self, config: PipelineConfig, processes: int, concurrency: int | None, verbose: bool,
        *, target: Any = None, args: tuple | None = None, tick_s: float = 0.2,
        backoff_s: float = RESTART_BACKOFF_S, max_restarts: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S,
        kill_after_s: float | None = None,
    ):
        self.config = config
        self.processes = processes
        self.concurrency = concurrency
        self.verbose = verbose
        self.ctx = mp.get_context("spawn")
        self.children: list[mp.process.BaseProcess | None] = []
        self.stopping = False
        self.stop_at: float | None = None
        self.target = target or _child
        self.args = args if args is not None else (config, concurrency, verbose)
        self.tick_s = tick_s
        self.backoff_s = backoff_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.kill_after_s = kill_after_s if kill_after_s is not None else config.workers.drain_grace_s + KILL_MARGIN_S
        self.failures: list[float] = []  # monotonic times of unexpected exits
        self.restart_at: dict[int, float] = {}  # slot -> when its replacement may start
        self.restarts = 0
        self.signalled: set[int] = set()  # pids already sent SIGTERM by the pool
        self.failed = False  # gave up on a crash loop

    def _spawn(self, slot: int) -> None:
        """Start the child of `slot`. A signal handled while it starts (`_stop` runs between any
        two bytecodes of `proc.start()`) cannot see it yet: once it is in `self.children`, a
        pool that is stopping by then forwards the SIGTERM itself, so the child drains instead
        of being SIGKILLed after the grace period."""
        proc = self.ctx.Process(target=self.target, args=self.args, daemon=False)
        proc.start()
        self.children[slot] = proc
        log.info("started worker process %d", proc.pid)
        if self.stopping and proc.pid is not None and proc.pid not in self.signalled:
            self._terminate(proc)

    def _terminate(self, proc: mp.process.BaseProcess) -> None:
        assert proc.pid is not None
        self.signalled.add(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)

    def _stop(self, signum: int, _frame: Any) -> None:
        alive = [p for p in self.children if p is not None and p.is_alive()]
        if not self.stopping:
            log.info("%s: draining %d worker process(es)", signal.Signals(signum).name, len(alive))
            self.stop_at = time.monotonic()
        self.stopping = True
        self.restart_at.clear()  # a backoff that was running starts nothing
        for proc in alive:
            if proc.pid is not None:
                self._terminate(proc)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.children = [None] * self.processes
        for slot in range(self.processes):
            if self.stopping:
                break
            self._spawn(slot)
        while True:
            status = self._tick()
            if status is not None:
                return status
            time.sleep(self.tick_s)

    def _tick(self) -> int | None:
        """One look at the children; an exit status when the pool is done."""
        now = time.monotonic()
        alive = [p for p in self.children if p is not None and p.is_alive()]
        if self.stopping:
            if not alive:
                return 1 if self.failed else 0
            if self.stop_at is not None and now - self.stop_at >= self.kill_after_s:
                for child in alive:
                    log.error("worker process %d still running %.0fs after the signal; SIGKILL", child.pid, now - self.stop_at)
                    child.kill()
                self.stop_at = None  # once
            return None
        for i, proc in enumerate(self.children):
            if proc is not None and not proc.is_alive():
                self.children[i] = None
                if proc.exitcode == 0:
                    log.info("worker process %d exited cleanly (drained); not restarted", proc.pid)
                    continue
                self.failures = [t for t in self.failures if now - t < self.window_s] + [now]
                if len(self.failures) > self.max_restarts:
                    log.error("worker process %d exited with %s: %d failures in %.0fs, giving up (see its log)",
                              proc.pid, proc.exitcode, len(self.failures), self.window_s)
                    self._stop(signal.SIGTERM, None)
                    self.failed = True
                    return None
                delay = min(RESTART_BACKOFF_MAX_S, self.backoff_s * 2 ** (len(self.failures) - 1))
                log.error("worker process %d exited with %s; restarting in %.1fs", proc.pid, proc.exitcode, delay)
                self.restart_at[i] = now + delay
        for i, when in list(self.restart_at.items()):
            if self.stopping:
                break
            if now >= when:
                del self.restart_at[i]
                self._spawn(i)
                self.restarts += 1
        if not self.restart_at and all(p is None for p in self.children):
            return 0  # every child drained on its own
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    try:
        config = config_from_args(args)
        from workers.validate import check_environments

        check_environments(config)  # kinds and options: a typo fails here, not in every job
        if any(env.kind == "code" for env in config.environments.values()):
            from workers.envs.code import check_sandboxes

            check_sandboxes(config)  # no sandbox isolation here: one line now, not every job failing
    except ConfigError as exc:
        return usage_error("workers", exc)  # the traceback too under --debug
    if args.processes == 1:  # no parent in between: signals reach arq directly
        _child(config, args.concurrency, args.verbose)
        return 0
    return Pool(config, args.processes, args.concurrency, args.verbose).run()


if __name__ == "__main__":
    raise SystemExit(main())
