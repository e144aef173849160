"""`rollout workers --processes N --concurrency C --config FILE`: a pool of worker processes.

Each process is one arq worker running up to C groups at once (C x n episodes).
The parent starts N children (spawned: no inherited event loops or sockets),
forwards SIGTERM/SIGINT to them (each drains: stops taking jobs, finishes or hands
back its groups within `workers.drain_grace_s`), and exits when all have. A child
that dies unexpectedly is restarted; its jobs are released by the other workers'
reaper, so none waits for arq's job timeout.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any

from pipeline.config import ConfigError, PipelineConfig, load_config

log = logging.getLogger("workers.pool")

RESTART_BACKOFF_S = 2.0


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
    def __init__(self, config: PipelineConfig, processes: int, concurrency: int | None, verbose: bool):
        self.config = config
        self.processes = processes
        self.concurrency = concurrency
        self.verbose = verbose
        self.ctx = mp.get_context("spawn")
        self.children: list[mp.process.BaseProcess] = []
        self.stopping = False

    def _spawn(self) -> mp.process.BaseProcess:
        proc = self.ctx.Process(target=_child, args=(self.config, self.concurrency, self.verbose), daemon=False)
        proc.start()
        log.info("started worker process %d", proc.pid)
        return proc

    def _stop(self, signum: int, _frame: Any) -> None:
        if not self.stopping:
            log.info("%s: draining %d worker process(es)", signal.Signals(signum).name, len(self.children))
        self.stopping = True
        for proc in self.children:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.children = [self._spawn() for _ in range(self.processes)]
        while True:
            alive = [p for p in self.children if p.is_alive()]
            if self.stopping and not alive:
                return 0
            if not self.stopping:
                for i, proc in enumerate(self.children):
                    if not proc.is_alive():
                        log.error("worker process %d exited with %s; restarting", proc.pid, proc.exitcode)
                        time.sleep(RESTART_BACKOFF_S)
                        self.children[i] = self._spawn()
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"rollout workers: {exc}", file=sys.stderr)
        return 2
    if args.processes == 1:  # no parent in between: signals reach arq directly
        _child(config, args.concurrency, args.verbose)
        return 0
    return Pool(config, args.processes, args.concurrency, args.verbose).run()


if __name__ == "__main__":
    raise SystemExit(main())
