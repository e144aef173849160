"""The engine path as a cluster runs it, on loopback: a router -> SGLang's own HTTP front ->
the project's simulator as the scheduler.

- **Front**: SGLang 0.5.23's FastAPI app (`sglang.srt.entrypoints.http_server.app`) with a real
  `TokenizerManager` built from `ServerArgs` as `sglang.launch_server` builds it (a tiny Qwen2
  `config.json` beside the shared test tokenizer): the routing, the pydantic parsing of
  `GenerateReqInput`, the contract gate, `_validate_one_request`, the duplicate-rid check, the
  error shapes, `/server_info` (`build_server_info` + `scheduler_info`), `/model_info`,
  `/abort_request`, `/pause_generation`, `/continue_generation`, `/update_weight_version`.
- **Scheduler**: `SimScheduler` below, on the TokenizerManager's own ZMQ sockets (it connects
  where the real scheduler would: a PULL on `scheduler_input_ipc_name`, a PUSH to
  `tokenizer_ipc_name`) and answers as SGLang's scheduler + detokenizer do
  (`BatchStrOutput`, `AbortReq` prefix matching, the input-length check with SGLang's own
  `validate_input_length` at the `max_req_input_len` its own `TpModelWorker.get_worker_info`
  computes, `max_new_tokens` by its own `Scheduler.init_req_max_new_tokens`, weight-version spans
  by its own `compute_weight_version_spans` for every finished request, `cached_tokens` from its prefix cache; a weight-version
  update is the simulator's push: its GPU time, the cache flushed; a `retract` pause frees KV).
  Tokens, log-probs, latency and aborts come from
  `workers.sim.engine.SimEngine`, the project's simulator.
- **Router**: smg 1.13.0 (`python -m smg launch`, the successor) or sglang-router 0.3.2
  (`python -m sglang_router.launch_router`; slime's docker/Dockerfile installs a fork build of
  that release, zhuzilin/sgl-router v0.3.2-9daabcd, whose version says "slime"; the PyPI wheel is
  the public build of it), both the PyPI CPU wheels of the `conformance` extra, in front of one or
  more fronts.

The fronts run in a subprocess (`python tests/engine_stack.py front --port P [P ...]`): importing
SGLang's server sets uvloop as the event-loop policy and publishes process-wide config, so it
stays out of the test process. Importing it costs ~20 s of CPU, so one process serves several
engines by default (each its own TokenizerManager, sockets, simulator and port; SGLang's handlers
find theirs through `_EngineState`), and the suite shares one stack per session
(`shared_stack()`, reconfigured per test with `stack.configure(...)`). A test that kills or
restarts engines starts its own with `engines_per_process=1`. `start_engine_stack` is blocking;
async code calls `await asyncio.to_thread(start_engine_stack, ...)`.

    stack = start_engine_stack(tmp_path, n_engines=2, context_length=4096)
    stack.router_url, stack.engine_urls   # http://127.0.0.1:P ...
    stack.stop()
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
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
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROUTERS = ("smg", "sglang-router")
_ROUTER_MODULES = {"smg": ["-m", "smg", "launch"], "sglang-router": ["-m", "sglang_router.launch_router"]}
# A Qwen2 shape small enough to describe, never loaded: ModelConfig reads the architecture,
# the vocabulary and max_position_embeddings (the context when --context-length is not given).
_MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 151936,
    "max_position_embeddings": 32768, "torch_dtype": "float32", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "eos_token_id": 151645, "bos_token_id": 151643, "tie_word_embeddings": True,
}
START_TIMEOUT_S = 240.0  # a loaded 2-core CI machine; ~50 s there when idle


# what `EngineStack.configure` may change (not the engine's context, slots or tokenizer)
_CONFIGURABLE = ("accuracy", "tool_use", "malformed_rate", "length_mu", "length_sigma", "max_filler_tokens",
                 "token_latency_s", "latency_sigma", "seed", "puzzle", "slots", "policy_path")


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
        from workers.sim.engine import SimConfig

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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    stack = EngineStack(router_url="", engine_urls=[], router=routers[0])
    _LIVE.append(stack)
    per_process = engines_per_process or n_engines
    for first in range(0, n_engines, per_process):
        group = range(first, min(n_engines, first + per_process))
        ports, stats_ports = [free_port() for _ in group], [free_port() for _ in group]
        extra = spares if first == 0 else ()
        extra_ports = [free_port() for _ in extra]
        log = tmp / f"front-{first}-{ports[0]}.log"
        cmd = [sys.executable, str(Path(__file__)), "front", "--port", *map(str, extra_ports + ports),
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


_SHARED: list[EngineStack] = []
SHARED_MODEL_CONTEXT = 4096  # a Qwen2.5-Math-sized model; the engines get no --context-length, as slime's
SPARE_CONTEXT = 2048  # the shared stack's spare engine's --context-length


def shared_stack() -> EngineStack:
    """The test session's stack, started on first use and stopped at exit: two engines (SGLang
    fronts over simulators, seeds 0 and 1) at a 4096-token model context without
    --context-length, with --enable-priority-scheduling (larger values first, SGLang's default), behind smg (`router_url`) and sglang-router 0.3.2
    (`router_urls["sglang-router"]`), and a spare engine at --context-length SPARE_CONTEXT behind
    neither (`spare_urls[0]`, in the same process). A test starts with `configure(...)` (the simulator's
    behaviour, a clean slate of counters); one stack start per session keeps CI fast."""
    if _SHARED and all(p.poll() is None for p in _SHARED[0].processes):
        return _SHARED[0]
    require_stack_parts("smg")
    require_stack_parts("sglang-router")
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="engine-stack-"))
    stack = start_engine_stack(tmp, 2, model_context=SHARED_MODEL_CONTEXT, router=("smg", "sglang-router"),
                               sim={"priority_scheduling": True}, spares=(SPARE_CONTEXT,))
    print(f"\nengine stack (2 SGLang fronts, smg, sglang-router) started in {stack.startup_s:.1f}s ({tmp})")
    _SHARED[:] = [stack]
    atexit.register(_stop_and_remove, stack, tmp)
    return stack


def _stop_and_remove(stack: EngineStack, tmp: Path) -> None:
    stack.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def require_stack_parts(router: str = "smg") -> None:
    """Skip (or fail under ROLLOUT_REQUIRE_CONFORMANCE=1) when SGLang or the router is missing."""
    import importlib.metadata
    import importlib.util

    from conformance_support import SGLANG_VERSION, unavailable

    try:  # the version only: the import itself (~20 s of CPU) happens in the front processes
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        unavailable("sglang is not installed (see .ci/run)")
    if found != SGLANG_VERSION:
        unavailable(f"sglang {found} is installed, the engine stack is written against {SGLANG_VERSION}")
    module = "smg" if router == "smg" else "sglang_router"
    for needed in (module, "uvicorn", "zmq", "fastapi", "torch"):
        if importlib.util.find_spec(needed) is None:
            unavailable(f"{needed} is not installed (extra `conformance`, see .ci/run)")


# ============================================================================ the front process


def _model_dir(workdir: Path, model_context: int) -> Path:
    from workers.sim.tokenizer import default_tokenizer_path

    model = workdir / "model"
    model.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(default_tokenizer_path())
    for item in tokenizer.iterdir():
        link = model / item.name
        if not link.exists():
            link.symlink_to(item)
    (model / "config.json").write_text(json.dumps({**_MODEL_CONFIG, "max_position_embeddings": model_context}))
    return model


def _sglang_limits(context_len: int) -> tuple[int, int, int]:
    """(max_total_num_tokens, max_req_len, max_req_input_len) as SGLang's scheduler learns them:
    `TpModelWorker.get_worker_info` itself, run on a worker whose KV pool holds exactly one
    full-context request (the simulator has no memory to run out of; `--context-length` or the
    model's own context is the bound, as on an engine whose pool is larger than the context)."""
    from conformance_support import _import_with_stubs

    tp_worker = _import_with_stubs("sglang.srt.managers.tp_worker", ("torchvision",))
    runner = SimpleNamespace(effective_logical_max_total_num_tokens=context_len, logical_max_total_num_tokens=context_len,
                             token_to_kv_pool_allocator=None, max_running_requests=1, forward_stream=None,
                             req_to_token_pool=SimpleNamespace(size=1, max_context_len=context_len),
                             token_to_kv_pool=SimpleNamespace(size=context_len))
    worker = SimpleNamespace(model_runner=runner, model_config=SimpleNamespace(context_len=context_len),
                             dllm_algorithm=None, random_seed=0, device="cpu")
    info = tp_worker.TpModelWorker.get_worker_info(worker)
    return int(info[0]), int(info[4]), int(info[5])


def _flush_after_weight_update(obj: Any, flushed: bool, message: str) -> tuple[bool, str]:
    """SGLang's `SchedulerWeightUpdaterManager.flush_cache_after_weight_update` on the flush the
    simulator did (or refused: a request holds the cache, as under an `in_place` pause): with
    `flush_cache` (its default) a refused flush answers the update `success: false`, HTTP 400."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    updater = SimpleNamespace(flush_cache=lambda empty_cache: flushed)  # the one method it calls
    success, answer = SchedulerWeightUpdaterManager.flush_cache_after_weight_update(updater, obj, True, message)
    return bool(success), str(answer)


class SimScheduler:
    """SGLang's scheduler + detokenizer, played by the simulator, on the TokenizerManager's sockets."""

    def __init__(self, engine: Any, port_args: Any, context_len: int, io: Any, allow_auto_truncate: bool = False):
        import zmq
        import zmq.asyncio

        self.engine = engine
        self.io = io
        self.allow_auto_truncate = allow_auto_truncate
        self.max_total_num_tokens, self.max_req_len, self.max_req_input_len = _sglang_limits(context_len)
        ctx = zmq.asyncio.Context(2)
        self.recv = ctx.socket(zmq.PULL)
        self.recv.connect(port_args.scheduler_input_ipc_name)
        self.send = ctx.socket(zmq.PUSH)
        self.send.connect(port_args.tokenizer_ipc_name)
        self.tasks: set[Any] = set()
        self.bodies: list[Any] = []  # the /generate bodies the front received (`_recording`)
        from sglang.srt.managers.load_snapshot import create_load_snapshot_writer

        # the scheduler's load snapshots, which the front's GET /v1/loads reads (slime's abort
        # polls it until the engine is idle)
        self.loads = create_load_snapshot_writer(port_args, 1, 0)
        self.publish_load()

    def publish_load(self) -> None:
        from sglang.srt.managers.load_snapshot import LoadSnapshot

        held, slots = len(self.engine._running), self.engine.config.slots
        running = min(held, slots) if slots > 0 else held
        self.loads.write(LoadSnapshot(timestamp=time.time(), num_running_reqs=running, num_waiting_reqs=held - running,
                                      max_running_requests=slots, max_total_num_tokens=self.max_total_num_tokens))

    def scheduler_info(self) -> dict[str, Any]:
        return {"status": "ready", "max_total_num_tokens": self.max_total_num_tokens,
                "max_req_input_len": self.max_req_input_len, "startup_time": {}}

    async def serve(self) -> None:
        import asyncio

        io = self.io
        while True:
            obj = await io.async_sock_recv(self.recv)
            if isinstance(obj, io.BatchTokenizedGenerateReqInput):
                items = list(obj.batch)
            else:
                items = [obj]
            for item in items:
                if isinstance(item, io.TokenizedGenerateReqInput):
                    task = asyncio.get_running_loop().create_task(self._generate(item))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                else:
                    await self._control(item)

    async def _reply(self, obj: Any) -> None:
        await self.io.async_sock_send(self.send, obj)

    async def _control(self, obj: Any) -> None:
        io, engine = self.io, self.engine
        if isinstance(obj, io.AbortReq):
            for rid, running in list(engine._running.items()):
                if obj.abort_all or (obj.rid and rid.startswith(obj.rid)):
                    running.message = obj.abort_message or "Aborted"
                    running.aborted.set()
        elif isinstance(obj, io.PauseGenerationReqInput):  # in_place / retract (abort is the tokenizer's loop)
            engine._resumed.clear()
            engine._paused_in_place = True
            if obj.mode == "retract" and engine.scheduler is not None:
                engine.scheduler.retract_all()  # their KV is freed: they re-prefill after continue
        elif isinstance(obj, io.ContinueGenerationReqInput):
            engine._paused_in_place = False
            engine._resumed.set()
        elif isinstance(obj, io.UpdateWeightVersionReqInput):
            # the simulator's update: the push time on the step loop, the prefix cache flushed, spans
            await engine.push_weights(obj.new_version)
            await self._reply(io.UpdateWeightVersionReqOutput(rid=obj.rid, http_worker_ipc=obj.http_worker_ipc))
        elif isinstance(obj, io.UpdateWeightFromDiskReqInput):  # the tiny policy loads the checkpoint
            ok, message, flushed = await engine.load_weights_from_disk(obj.model_path, obj.weight_version,
                                                                       flush=obj.flush_cache)
            if ok:  # a refused flush fails the call, the weights and the label loaded: SGLang's own rule
                ok, message = _flush_after_weight_update(obj, flushed, message)
            await self._reply(io.UpdateWeightFromDiskReqOutput(success=ok, message=message, num_paused_requests=0,
                                                               rid=obj.rid, http_worker_ipc=obj.http_worker_ipc))
        elif isinstance(obj, io.GetInternalStateReq):
            state = {"max_req_input_len": self.max_req_input_len, "weight_version": engine.weight_version,
                     "running": len(engine._running)}
            await self._reply(io.GetInternalStateReqOutput(internal_state=state, http_worker_ipc=obj.http_worker_ipc))

    async def _generate(self, req: Any) -> None:
        from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

        from workers.sim.engine import _Running

        engine = self.engine
        input_ids = [int(t) for t in req.input_ids]
        params = req.sampling_params
        if req.rid.startswith(HEALTH_CHECK_RID_PREFIX):  # /health's one-token probe: any answer is health
            await self._output(req, [0], [0.0], {"type": "length", "length": 1}, None)
            return
        engine.stats["requests"] += 1
        if engine._faults:  # /sim/fail_next: the scheduler aborts it with that status (FINISH_ABORT)
            status, message = engine._faults.pop(0)
            engine.stats["errors"] += 1
            await self._output(req, [], [], {"type": "abort", "message": message, "status_code": status,
                                             "err_type": "SimulatedFault"}, None)
            return
        from sglang.srt.managers.utils import validate_input_length

        checked = SimpleNamespace(origin_input_ids=input_ids)  # the one field of Req it reads (and truncates)
        message = validate_input_length(checked, self.max_req_input_len, self.allow_auto_truncate)
        if message is not None:  # as scheduler.py answers it: FINISH_ABORT with HTTP 400
            await self._output(req, [], [], {"type": "abort", "message": message, "status_code": 400,
                                             "err_type": "BadRequestError"}, None)
            return
        input_ids = checked.origin_input_ids
        max_new, refused = self.max_new_tokens(req, input_ids)
        if refused is not None:
            await self._output(req, [], [], {"type": "abort", "message": refused, "status_code": 400,
                                             "err_type": "BadRequestError"}, None)
            return
        stops = params.stop_strs
        sim_params = {"max_new_tokens": max_new, "stop": list(stops) if stops else None,
                      # what a model samples with (the tiny policy; the scripted one ignores them)
                      "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                      "stop_token_ids": sorted(params.stop_token_ids or ())}
        routing_key = req.routing_key or req.rid
        keys = engine.stats["routing_keys"]
        keys[routing_key] = keys.get(routing_key, 0) + 1
        running = engine._running[req.rid] = _Running(req.rid)
        engine.stats["max_running"] = max(engine.stats["max_running"], len(engine._running))
        self.publish_load()
        try:
            await engine._resumed.wait()
            async with engine._slot(engine._note_priority(req.rid, req.priority)):  # the scheduler's waiting queue (workers/sim/scheduler.py)
                ids, lps, finish, _spans = await engine._run(running, input_ids, routing_key, sim_params)
        finally:
            engine._running.pop(req.rid, None)
            self.publish_load()
        engine.stats["output_tokens"] += len(ids)
        if finish.get("type") == "abort":
            finish = {**finish, "status_code": None, "err_type": None}
        await self._output(req, ids, lps, finish, running.version_events, cached_tokens=running.cached_tokens)

    def max_new_tokens(self, req: Any, input_ids: list[int]) -> tuple[int, str | None]:
        """What SGLang's scheduler lets the request generate, by its own `Scheduler.init_req_max_new_tokens`
        (max_new_tokens null: 1 << 30; SGLANG_MAX_NEW_TOKENS_LIMIT; clipped to max_req_len and to the
        KV budget of this engine's pool, page size 1), and its abort message where the prompt does
        not fit that budget."""
        import copy
        import types

        from sglang.srt.environ import envs
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

        allocator = SimpleNamespace(page_size=1)
        allocator.max_new_tokens_for_memory = types.MethodType(BaseTokenToKVPoolAllocator.max_new_tokens_for_memory,
                                                               allocator)
        limits = SimpleNamespace(max_new_tokens_limit=envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get(), max_req_len=self.max_req_len,
                                 max_total_num_tokens=self.max_total_num_tokens, kv_shard_widening=1, page_size=1,
                                 token_to_kv_pool_allocator=allocator, sliding_window_size=None,
                                 chunked_prefill_size=None)
        refused: list[str] = []
        scheduled = SimpleNamespace(rid=req.rid, origin_input_ids=input_ids, sampling_params=copy.copy(req.sampling_params),
                                    set_finish_with_abort=refused.append)  # the fields of Req it reads
        Scheduler.init_req_max_new_tokens(limits, scheduled)
        return int(scheduled.sampling_params.max_new_tokens), refused[0] if refused else None

    async def _output(self, req: Any, ids: list[int], lps: list[float], finish: dict[str, Any],
                      events: list[tuple[str, int]] | None, *, cached_tokens: int = 0) -> None:
        """`events`: the simulator's (old label, output tokens then) per weight update the request
        lived through; the spans are SGLang's own `compute_weight_version_spans` of them, sent for
        every finished request as SGLang's output streamer sends them."""
        io = self.io
        from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans

        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        changes = [WeightVersionEvent(old_version=old, num_output_tokens=n) for old, n in events or ()]
        version_spans = [compute_weight_version_spans(changes, current_version=self.engine.weight_version,
                                                      num_output_tokens=len(ids))]
        out = io.BatchStrOutput(
            rids=[req.rid], http_worker_ipcs=[req.http_worker_ipc], finished_reasons=[finish], output_strs=[text],
            output_ids=[ids], prompt_tokens=[len(req.input_ids)], completion_tokens=[len(ids)],
            reasoning_tokens=[0], cached_tokens=[cached_tokens],
            input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
            output_token_logprobs_val=[lps], output_token_logprobs_idx=[ids],
            input_top_logprobs_val=[[]], input_top_logprobs_idx=[[]],
            output_top_logprobs_val=[[]], output_top_logprobs_idx=[[]],
            input_token_ids_logprobs_val=[[]], input_token_ids_logprobs_idx=[[]],
            output_token_ids_logprobs_val=[[]], output_token_ids_logprobs_idx=[[]],
            output_token_entropy_val=None, output_token_sampling_mask=None, output_hidden_states=None,
            routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None, placeholder_tokens_val=None,
            retraction_counts=[0], weight_versions=version_spans,
        )
        await self._reply(out)


_KEPT_BODIES = 500


def _recording(app: Any, bodies: list[Any]) -> Any:
    """SGLang's ASGI app, keeping a copy of every POST /generate body it is sent (the last
    `_KEPT_BODIES`, GET /sim/bodies): what the suite sends, as SGLang's server received it."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") != "/generate":
            await app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def tee() -> Any:
            message = await receive()
            if message.get("type") == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    try:
                        bodies.append(json.loads(b"".join(chunks)))
                    except ValueError:
                        bodies.append(b"".join(chunks).decode(errors="replace"))
                    del bodies[:-_KEPT_BODIES]
            return message

        await app(scope, tee, send)

    return asgi


class _EngineState:
    """`http_server._global_state` when one process serves several engines: SGLang's handlers
    read `_global_state.tokenizer_manager` (and `.scheduler_info`) at each request; this reads
    them from the engine whose port took the request (`_serving`, set per request)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_serving.get(), name)


_serving: Any = None  # contextvars.ContextVar of the serving engine's _GlobalState (set in _serve_front)


def _bound(app: Any, state: Any) -> Any:
    """The ASGI app with `state` as the global state of every request it serves (uvicorn runs
    each request in a task of its own, so the context variable is that request's)."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        _serving.set(state)
        await app(scope, receive, send)

    return asgi


async def _serve_front(args: argparse.Namespace) -> None:
    """One process, `len(args.port)` engines: each its own ServerArgs, TokenizerManager (own ZMQ
    sockets), simulator-scheduler and uvicorn server on its port, all on SGLang's one app."""
    import asyncio
    import contextvars
    import logging

    import uvicorn
    from conformance_support import _import_with_stubs

    global _serving
    http_server = _import_with_stubs("sglang.srt.entrypoints.http_server", ("torchvision",))
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    from workers.sim.engine import SimConfig, SimEngine

    _serving = contextvars.ContextVar("sglang_engine")
    http_server.set_global_state(_EngineState())
    model = str(_model_dir(Path(args.workdir), args.model_context))
    sim_fields = json.loads(args.sim)
    servers, schedulers = [], []
    contexts = [None if c == "None" else int(c) for c in args.context_length]
    for i, (port, stats_port) in enumerate(zip(args.port, args.stats_port)):
        # the simulator's priority_scheduling is SGLang's --enable-priority-scheduling: the front
        # says so in /server_info and its TokenizerManager handles `priority` as it would
        context = contexts[i] if len(contexts) > 1 else contexts[0]
        server_args = ServerArgs(model_path=model, context_length=context, device="cpu",
                                 skip_server_warmup=True, host="127.0.0.1", port=port, log_level="warning",
                                 enable_priority_scheduling=bool(sim_fields.get("priority_scheduling")),
                                 schedule_low_priority_values_first=bool(sim_fields.get("low_priority_values_first")))
        # process-wide config, last publish wins: the engines differ only in their port (the
        # spares, first, also in their --context-length, read from their own ServerArgs)
        publish(server_args, role="tokenizer")
        port_args = PortArgs.init_new(server_args)
        manager = TokenizerManager(server_args, port_args)
        seed = args.first_seed + i - args.spares if i >= args.spares else 1000 + i
        config = SimConfig(**{"seed": seed, **sim_fields, "context_length": manager.context_len})
        scheduler = SimScheduler(SimEngine(config), port_args, manager.context_len, io_struct,
                                 allow_auto_truncate=server_args.allow_auto_truncate)
        manager.max_req_input_len = scheduler.scheduler_info()["max_req_input_len"]
        manager.set_startup_time({})
        manager.server_status = ServerStatus.Up
        state = http_server._GlobalState(tokenizer_manager=manager, template_manager=TemplateManager(),
                                         scheduler_info=scheduler.scheduler_info())
        app = _bound(_recording(http_server.app, scheduler.bodies), state)
        servers.append(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                                     log_level="warning", access_log=False, timeout_keep_alive=60)))
        schedulers.append((scheduler, stats_port))
    logging.getLogger("sglang").setLevel(logging.WARNING)
    async with contextlib.AsyncExitStack() as controls:
        for scheduler, stats_port in schedulers:  # the simulator's own routes, each engine on its own port
            await controls.enter_async_context(serve_sim_control(scheduler, stats_port))
        await asyncio.gather(*(sch.serve() for sch, _ in schedulers), *(srv.serve() for srv in servers),
                             _exit_with_parent())


async def _exit_with_parent() -> None:
    """A front whose test process is gone (killed, no teardown) exits too."""
    import asyncio

    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    os._exit(0)


@contextlib.asynccontextmanager
async def serve_sim_control(scheduler: SimScheduler, port: int) -> Any:
    """The simulator's own routes, on a port of their own (SGLang's app has no such routes):
    GET /sim/stats; POST /sim/config {SimConfig fields} (what the next requests do); POST
    /sim/fail_next {"status", "count", "message"}: the scheduler finishes the next requests with
    an abort of that HTTP status, which SGLang's front answers as it answers a real one."""
    import dataclasses

    from aiohttp import web

    engine = scheduler.engine

    async def configure(request: web.Request) -> web.Response:
        """New SimConfig fields; the counters, the queued faults and the kept bodies start afresh."""
        fields = await request.json()
        if fields.get("policy_path", engine.config.policy_path) != engine.config.policy_path:
            engine.set_policy(fields["policy_path"])
        engine.config = dataclasses.replace(engine.config, **fields)
        engine.set_slots(engine.config.slots)  # SGLang's max_running_requests, for the requests that come next
        engine._faults.clear()
        scheduler.bodies.clear()
        for key, value in engine.stats.items():
            engine.stats[key] = {} if isinstance(value, dict) else 0
        engine.stats["max_running"] = len(engine._running)
        return web.json_response(dataclasses.asdict(engine.config))

    async def bodies(_request: web.Request) -> web.Response:
        return web.json_response(scheduler.bodies)

    app = web.Application()
    app.router.add_get("/sim/stats", engine.get_stats)
    app.router.add_get("/sim/bodies", bodies)
    app.router.add_post("/sim/fail_next", engine.fail_next)
    app.router.add_post("/sim/config", configure)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    import asyncio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    front = sub.add_parser("front", help="serve SGLang fronts over simulated schedulers, one per --port")
    front.add_argument("--port", type=int, nargs="+", required=True)
    front.add_argument("--stats-port", type=int, nargs="+", required=True)
    front.add_argument("--first-seed", type=int, default=0, help="the simulators' seeds count up from it")
    front.add_argument("--context-length", nargs="+", default=["None"],
                       help="SGLang's --context-length, one for all ports or one per port (None: the model's)")
    front.add_argument("--spares", type=int, default=0, help="the first N ports are spare engines (seeds 1000 + i)")
    front.add_argument("--model-context", type=int, default=32768, help="the model's max_position_embeddings")
    front.add_argument("--sim", default="{}", help="SimConfig fields as JSON")
    front.add_argument("--workdir", required=True)
    args = p.parse_args(argv)
    asyncio.run(_serve_front(args))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    raise SystemExit(main())
