"""The engine path as a cluster runs it, on loopback: a router -> SGLang's own HTTP front ->
the project's simulator as the scheduler (workers/sim/sglang_front.py says what of SGLang runs).

- **Fronts**: `python -m workers.sim.sglang_front front --port P [P ...]` child processes (SGLang's
  import costs ~20 s of CPU, so one process serves several engines by default; each its own
  TokenizerManager, sockets, simulator and port). Each engine's simulator also answers its own
  routes on a port of its own (`EngineStack.control_url`: /sim/stats, /sim/config, ...).
- **Router**: smg 1.13.0 (`python -m smg launch`, the successor) or sglang-router 0.3.2
  (`python -m sglang_router.launch_router`; slime's docker/Dockerfile installs a fork build of
  that release, zhuzilin/sgl-router v0.3.2-9daabcd, whose version says "slime"; the PyPI wheel is
  the public build of it), both the PyPI CPU wheels of the `conformance` extra, in front of one or
  more fronts.

The tests (tests/support/engine_stack.py: one shared stack per session), the learning oracle's bench
(scripts/bench/learn.py) and `rollout check-signal` start it here. `start_engine_stack` is
blocking; async code calls `await asyncio.to_thread(start_engine_stack, ...)`.

    stack = start_engine_stack(tmp_path, n_engines=2, context_length=4096)
    stack.router_url, stack.engine_urls   # http://127.0.0.1:P ...
    stack.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ROUTERS = ("smg", "sglang-router")
_ROUTER_MODULES = {"smg": ["-m", "smg", "launch"], "sglang-router": ["-m", "sglang_router.launch_router"]}
START_TIMEOUT_S = 240.0  # a loaded 2-core CI machine; ~50 s there when idle


# what `EngineStack.configure` may change (not the engine's context, slots or tokenizer)
_CONFIGURABLE = ("accuracy", "tool_use", "malformed_rate", "length_mu", "length_sigma", "max_filler_tokens",
                 "token_latency_s", "latency_sigma", "seed", "puzzle", "slots", "policy_path")


SGLANG_VERSION = "0.5.23"  # the front is written against this release's modules


def missing_parts(router: str = "smg") -> str | None:
    """Why a stack with `router` cannot start here (SGLang missing or another release, the router
    or the front's server parts missing: the `conformance` extra), or None. Only versions and
    module specs: the import itself (~20 s of CPU) happens in the front processes."""
    import importlib.metadata
    import importlib.util

    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "sglang is not installed (the `conformance` extra; see .ci/run)"
    if found != SGLANG_VERSION:
        return f"sglang {found} is installed, the engine stack is written against {SGLANG_VERSION}"
    module = "smg" if router == "smg" else "sglang_router"
    for needed in (module, "uvicorn", "zmq", "fastapi", "torch"):
        if importlib.util.find_spec(needed) is None:
            return f"{needed} is not installed (extra `conformance`, see .ci/run)"
    return None


_LIVE: list[EngineStack] = []  # stopped at exit if a test run ends without their teardown


def _stop_live() -> None:
    for stack in list(_LIVE):
        stack.stop()


atexit.register(_stop_live)


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


@dataclass
class EngineStack:
    router_url: str  # the first router's
    engine_urls: list[str]
    router: str
    router_urls: dict[str, str] = field(default_factory=dict)  # every router in front of the engines, by name
    engine_processes: list[subprocess.Popen[bytes]] = field(default_factory=list)  # the front process of engine i
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    startup_s: float = 0.0

    def stop(self) -> None:
        if self in _LIVE:
            _LIVE.remove(self)
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def control_url(self, i: int = 0) -> str:
        """Engine i's simulator routes (`serve_sim_control`): /sim/stats, /sim/config, /sim/fail_next."""
        return f"http://127.0.0.1:{self._stats_ports[i]}"

    def stats(self, i: int = 0) -> dict[str, Any]:
        """The simulator's counters of engine i (GET /sim/stats)."""
        status, body = _get(f"{self.control_url(i)}/sim/stats")
        assert status == 200, f"no stats from engine {i}"
        return dict(body)

    def total_stats(self) -> dict[str, Any]:
        """Every engine's counters added up (`max_running`: the largest), routing keys merged."""
        total: dict[str, Any] = {}
        for i in range(len(self.engine_urls)):
            for key, value in self.stats(i).items():
                if isinstance(value, dict):
                    merged = total.setdefault(key, {})
                    for k, v in value.items():
                        merged[k] = merged.get(k, 0) + v
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = max(total.get(key, 0), value) if key == "max_running" else total.get(key, 0) + value
        return total

    def all_bodies(self) -> list[Any]:
        return [body for i in range(len(self.engine_urls)) for body in self.bodies(i)]

    def bodies(self, i: int = 0) -> list[Any]:
        """The /generate bodies engine i's SGLang front received since the last /sim/config."""
        status, body = _get(f"{self.control_url(i)}/sim/bodies")
        assert status == 200, f"no bodies from engine {i}"
        return list(body)

    def configure(self, i: int | None = None, **fields: Any) -> None:
        """The simulator's SimConfig defaults updated with `fields`, on engine i or every engine;
        weight label, counters, queued faults and kept bodies start afresh (a test's clean slate)."""
        from workers.sim.config import SimConfig

        unknown = set(fields) - set(_CONFIGURABLE)
        if unknown:
            raise ValueError(f"not configurable at run time: {sorted(unknown)} (start_engine_stack's sim= sets them)")
        defaults = SimConfig()
        self.sim("config", {**{k: getattr(defaults, k) for k in _CONFIGURABLE}, **fields}, i)
        # the weight label through SGLang's own endpoint (its TokenizerManager keeps one too): a test
        # that pushed weights must not leave the next one a label it did not set
        for k in range(len(self.engine_urls)) if i is None else [i]:
            request = urllib.request.Request(f"{self.engine_urls[k]}/update_weight_version",
                                             data=json.dumps({"new_version": defaults.weight_version}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()

    def sim(self, path: str, body: dict[str, Any], i: int | None = None) -> None:
        """POST /sim/<path> (config, fail_next) to engine i, or to every engine."""
        for k in range(len(self.engine_urls)) if i is None else [i]:
            request = urllib.request.Request(f"{self.control_url(k)}/sim/{path}", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()

    _stats_ports: list[int] = field(default_factory=list)
    spare_urls: list[str] = field(default_factory=list)  # engines behind no router (`start_engine_stack`'s spares)

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in self.logs if p.exists())


def sim_fields(engine_args: list[str]) -> dict[str, Any]:
    """The SimConfig fields a `rollout engine` command line sets (workers/sim/engine.py's own
    parser), those that differ from its defaults, as `start_engine_stack(sim=...)` takes them: a
    caller that describes its engine as `rollout engine` flags runs it behind SGLang's front
    unchanged. The context is the front's (`context_length`/`model_context`), not --context-length."""
    import dataclasses

    from workers.sim.engine import SimConfig, config_from_args, parse_args

    config, defaults = config_from_args(parse_args(engine_args)), SimConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(SimConfig)
            if f.name != "context_length" and getattr(config, f.name) != getattr(defaults, f.name)}


def _wait(what: str, ok: Any, procs: list[subprocess.Popen[bytes]], stack: EngineStack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            stack.stop()
            raise RuntimeError(f"{what}: a process exited with {dead[0].returncode}\n{stack.tail()}")
        time.sleep(0.25)
    stack.stop()
    raise RuntimeError(f"{what}: not ready within {timeout:.0f}s\n{stack.tail()}")


def start_engine_stack(
    tmp: Path | str,
    n_engines: int = 1,
    *,
    context_length: int | None = None,
    model_context: int = 32768,
    router: str | tuple[str, ...] = "smg",
    sim: dict[str, Any] | None = None,
    engines_per_process: int | None = None,
    timeout_s: float = START_TIMEOUT_S,
    spares: tuple[int, ...] = (),
) -> EngineStack:
    """Start `n_engines` SGLang fronts over simulators and `router` (one name or several, each
    its own process in front of all the engines; `router_url` is the first's) in front of them.

    `context_length` is SGLang's `--context-length` (None: the model's own, `model_context`
    = its `max_position_embeddings`, and /server_info says `context_length: null`, as for
    slime's engines, which pass none); `sim` are `SimConfig` fields of every
    engine's simulator (accuracy, slots, token_latency_s, ...; seeds count up from 0 unless
    given). One front process serves `engines_per_process` engines (None: all of them; SGLang's
    import costs ~20 s of CPU per process; 1 to kill engines one by one:
    `stack.engine_processes[i]`). `spares`: the `--context-length` of more engines in the first
    front process, behind no router (`stack.spare_urls`: a test registers one with a router itself).
    Returns when every router lists every engine as healthy.
    """
    routers = (router,) if isinstance(router, str) else tuple(router)
    if not routers or set(routers) - set(ROUTERS):
        raise ValueError(f"router must be one or more of {ROUTERS}, not {router!r}")
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    stack = EngineStack(router_url="", engine_urls=[], router=routers[0])
    _LIVE.append(stack)
    per_process = engines_per_process or n_engines
    for first in range(0, n_engines, per_process):
        group = range(first, min(n_engines, first + per_process))
        ports, stats_ports = [free_port() for _ in group], [free_port() for _ in group]
        extra = spares if first == 0 else ()
        extra_ports = [free_port() for _ in extra]
        log = tmp / f"front-{first}-{ports[0]}.log"
        cmd = [sys.executable, "-m", "workers.sim.sglang_front", "front", "--port", *map(str, extra_ports + ports),
               "--stats-port", *[str(free_port()) for _ in extra], *map(str, stats_ports), "--spares", str(len(extra)),
               "--first-seed", str(first), "--sim", json.dumps(sim or {}),
               "--workdir", str(tmp / f"front-{first}"), "--model-context", str(model_context),
               "--context-length", *map(str, extra), *[str(context_length)] * len(ports)]
        stack.spare_urls += [f"http://127.0.0.1:{port}" for port in extra_ports]
        proc = _spawn(cmd, log, env)
        stack.processes.append(proc)
        stack.logs.append(log)
        stack.engine_urls += [f"http://127.0.0.1:{port}" for port in ports]
        stack._stats_ports += stats_ports
        stack.engine_processes += [proc] * len(ports)
    try:
        _wait("SGLang fronts", lambda: all(_get(f"{u}/model_info")[0] == 200 for u in stack.engine_urls + stack.spare_urls),
              list(stack.processes), stack, timeout_s)
        for name in routers:
            stack.router_urls[name] = start_router(stack, name, tmp)
        stack.router_url = stack.router_urls[routers[0]]
    except BaseException:  # a test timeout or ^C while starting: nothing is left running
        stack.stop()
        raise
    stack.startup_s = time.monotonic() - started
    return stack


def start_router(stack: EngineStack, router: str, tmp: Path, timeout_s: float = 120.0) -> str:
    port = free_port()
    log = tmp / f"{router}-{port}.log"
    cmd = [sys.executable, *_ROUTER_MODULES[router], "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *stack.engine_urls, "--prometheus-port", str(free_port()), "--log-level", "warn"]
    proc = _spawn(cmd, log)
    stack.processes.append(proc)
    stack.logs.append(log)
    url = f"http://127.0.0.1:{port}"

    def listed() -> bool:
        status, body = _get(f"{url}/workers")
        workers = (body or {}).get("workers") or [] if status == 200 else []
        return len(workers) == len(stack.engine_urls) and all(w.get("is_healthy", True) for w in workers)

    _wait(f"router {router}", listed, [proc], stack, timeout_s)
    return url


@contextlib.contextmanager
def engine_stack(tmp: Path | str, n_engines: int = 1, **kwargs: Any) -> Iterator[EngineStack]:
    stack = start_engine_stack(tmp, n_engines, **kwargs)
    try:
        yield stack
    finally:
        stack.stop()


@contextlib.asynccontextmanager
async def async_engine_stack(tmp: Path | str, n_engines: int = 1, **kwargs: Any) -> Any:
    """`engine_stack` for async code: started and stopped in a thread, the event loop runs on."""
    import asyncio

    stack = await asyncio.to_thread(start_engine_stack, tmp, n_engines, **kwargs)
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.stop)

