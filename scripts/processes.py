"""Run `rollout` commands as child processes: the simulated engine, worker pools, a producer
(tests, demo, benchmarks). Each child is `python -m scripts.cli ...`, so this lives beside it.

    with SimEngineProcess(["--token-latency-s", "0.001"]) as engine:   # engine.url
        with WorkerProcess(config_path) as worker:                      # worker.proc (Popen)
            ...

Both wait until the child is ready and stop it on exit (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TypeVar

import yaml

from pipeline.config import PipelineConfig
from pipeline.store.local_redis import free_port

_Child = TypeVar("_Child", bound="ChildProcess")


class ChildProcess:
    def __init__(self, args: Sequence[str], *, log_path: str | None = None):
        self.args = [sys.executable, "-m", "scripts.cli", *args]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | int | None = None

    def start(self: _Child) -> _Child:
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()  # type: ignore[union-attr]

    def __enter__(self: _Child) -> _Child:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SimEngineProcess(ChildProcess):
    """`rollout engine` on a free loopback port; ready when /health answers."""

    def __init__(self, extra_args: Sequence[str] = (), *, port: int | None = None, log_path: str | None = None):
        self.port = port or free_port()
        super().__init__(["engine", "--port", str(self.port), *extra_args], log_path=log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SimEngineProcess:
        super().start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"simulated engine exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"simulated engine on {self.url} not healthy after 60 s")


class WorkerProcess(ChildProcess):
    """`rollout workers --config FILE` (one process unless `processes` > 1)."""

    def __init__(self, config_path: str, *, processes: int = 1, concurrency: int | None = None,
                 log_path: str | None = None):
        args = ["workers", "--config", config_path, "--processes", str(processes)]
        if concurrency is not None:
            args += ["--concurrency", str(concurrency)]
        super().__init__(args, log_path=log_path)


def write_config(config: PipelineConfig | dict, path: str | Path) -> str:
    """Write a pipeline YAML that `load_config` reads back (for child processes)."""
    import msgspec

    data = msgspec.to_builtins(config) if isinstance(config, PipelineConfig) else config
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)
