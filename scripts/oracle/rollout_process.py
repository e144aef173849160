"""slime's RolloutManager in a process of its own, as a Ray actor is on a cluster: the learning
oracle's slime fully async contender (scripts/oracle/run.py `rollout="slime_fully_async"`) runs
slime's `fully_async_rollout` worker, its SGLang client and the reward there, so their CPU work
no longer shares the trainer's process (and its GIL) with the CPU actor, and the contender's
seconds are its own.

The child (multiprocessing's spawn: nothing of the parent's slime state is inherited) imports
slime's `RolloutManager` and binds `pipeline.slime.data_source` before the run's clock starts; on `init` it
builds `slime_loop.RolloutManagerActor` (slime's own methods on a light object) from the run's
args, in a fresh rollout process (`fresh_slime_rollout_process`). `RolloutManagerHandle` is what
slime's loop holds in the trainer's process: the same `generate`/`eval`/`save`/`load` as futures
(`.remote`), each call answered over a pipe, one at a time, in order, as a Ray actor's are; the
samples each `generate` returned and each eval round's metrics come back with the answers
(`batches`, `evals`). `stop()` ends slime's worker there (`stop_fully_async_worker`: the finished
groups it left untrained) and the process.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scripts.oracle.slime_loop import _Remote

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # slime's and torch's imports on a loaded 2-core machine


class RolloutProcess:
    """The child process serving one RolloutManager; started (imports done) before the run's clock."""

    def __init__(self, slime_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(slime_path)), name="slime-rollout-manager", daemon=True)
        self._lock = threading.Lock()
        self._proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"slime's rollout process not ready within {START_TIMEOUT_S:.0f} s")
        self._answer()
        self.handles: list[RolloutManagerHandle] = []

    def call(self, method: str, payload: Any = None) -> Any:
        with self._lock:
            self._conn.send((method, payload))
            return self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"slime's rollout process exited ({self._proc.exitcode})") from exc
        if status == "error":
            raise RuntimeError(f"in slime's rollout process: {value}")
        return value

    def manager(self, args: Any) -> RolloutManagerHandle:
        """slime's `create_rollout_manager` -> `RolloutManager.options(...).remote(args, pg)`."""
        self.call("init", args)
        handle = RolloutManagerHandle(self)
        self.handles.append(handle)
        return handle

    def stop(self, timeout_s: float = 90.0) -> int:
        """slime's worker stopped and the process ended; the finished groups it never trained."""
        untrained = 0
        if self._proc.is_alive():
            try:
                untrained = int(self.call("stop"))
            finally:
                self._proc.join(timeout_s)
                if self._proc.is_alive():
                    self._proc.kill()
                    self._proc.join()
        self._conn.close()
        return untrained


class RolloutManagerHandle:
    """`slime_loop.RolloutManagerActor`'s interface, its calls answered by the rollout process."""

    data_source = None  # slime's own data source counts no trainer runs (install's create_actor_model reads run_id)

    def __init__(self, process: RolloutProcess) -> None:
        self.process = process
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-manager-handle")
        self.batches: dict[int, list[Any]] = {}  # rollout id -> the samples generate() returned
        self.evals: list[tuple[int, dict[str, Any], float]] = []  # (rollout id, the round's metrics, when done)
        self.eval_calls: list[tuple[int, float]] = []  # (rollout id, seconds the loop waited for the call)
        self.generate_s: dict[int, float] = {}  # rollout id -> seconds its generate call took (the data's wait)

        def generate(rollout_id: int) -> Any:
            started = time.monotonic()
            samples, data = process.call("generate", rollout_id)
            self.batches[rollout_id] = samples
            self.generate_s[rollout_id] = time.monotonic() - started
            return data

        def evaluate(rollout_id: int) -> None:
            started = time.monotonic()
            self.evals += process.call("eval", rollout_id)  # CLOCK_MONOTONIC: one clock for both processes
            self.eval_calls.append((rollout_id, time.monotonic() - started))

        self.generate = _Remote(self.executor, generate)
        self.eval = _Remote(self.executor, evaluate)
        self.save = _Remote(self.executor, lambda rollout_id: process.call("save", rollout_id))
        self.load = _Remote(self.executor, lambda rollout_id=None: process.call("load", rollout_id))
        self.dispose = _Remote(self.executor, lambda: None)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _serve(conn: Any, slime_path: str) -> None:
    """The child: slime's RolloutManager methods, one call at a time, until `stop`."""
    sys.path[:0] = [slime_path, str(REPO)]
    try:
        import importlib

        rollout = importlib.import_module("slime.ray.rollout")
        import pipeline.slime.data_source  # noqa: F401  (after slime: its samples are slime's)
        from scripts.oracle.run import close_eval_sources, fresh_slime_rollout_process, stop_fully_async_worker
        from scripts.oracle.slime_loop import RolloutManagerActor
    except Exception:  # noqa: BLE001 - said to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    manager: Any = None
    args: Any = None
    while True:
        try:
            method, payload = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            if method == "init":
                args = payload
                fresh_slime_rollout_process()
                manager = RolloutManagerActor(rollout.RolloutManager.__ray_actor_class__, args)
                value: Any = None
            elif method == "generate":
                data = manager.generate.remote(payload).result()
                value = (manager.batches[payload], data)
            elif method == "eval":
                seen = len(manager.evals)
                manager.eval.remote(payload).result()
                value = manager.evals[seen:]
            elif method in ("save", "load"):
                value = getattr(manager, method).remote(payload).result()
            elif method == "stop":
                value = stop_fully_async_worker(args) if args is not None else 0
                close_eval_sources()
                if manager is not None:
                    manager.close()
                conn.send(("ok", value))
                return
            else:
                raise ValueError(f"unknown call {method!r}")
            conn.send(("ok", value))
        except Exception:  # noqa: BLE001 - said to the parent, which raises it
            conn.send(("error", traceback.format_exc()))
