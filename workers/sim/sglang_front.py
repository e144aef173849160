"""SGLang 0.5.23's own HTTP front over the project's simulator as its scheduler, one process
serving one or more engines (`python -m workers.sim.sglang_front front --port P [P ...]`;
workers/sim/stack.py starts it, with a router in front).

- **Front**: SGLang's FastAPI app (`sglang.srt.entrypoints.http_server.app`) with a real
  `TokenizerManager` built from `ServerArgs` as `sglang.launch_server` builds it (a tiny Qwen2
  `config.json` beside the simulator's tokenizer): the routing, the pydantic parsing of
  `GenerateReqInput`, the contract gate, `_validate_one_request`, the duplicate-rid check, the
  error shapes, `/server_info` (`build_server_info` + `scheduler_info`), `/model_info`,
  `/abort_request`, `/pause_generation`, `/continue_generation`, `/update_weight_version`,
  `/update_weights_from_disk`.
- **Scheduler**: `SimScheduler` below, on the TokenizerManager's own ZMQ sockets (it connects
  where the real scheduler would: a PULL on `scheduler_input_ipc_name`, a PUSH to
  `tokenizer_ipc_name`) and answers as SGLang's scheduler + detokenizer do
  (`BatchStrOutput`, `AbortReq` prefix matching, the input-length check with SGLang's own
  `validate_input_length` at the `max_req_input_len` its own `TpModelWorker.get_worker_info`
  computes, `max_new_tokens` by its own `Scheduler.init_req_max_new_tokens`, weight-version spans
  by its own `compute_weight_version_spans` for every finished request, `cached_tokens` from its
  prefix cache; a weight-version update is the simulator's push: its GPU time, the cache
  flushed; a `retract` pause frees KV; `/update_weights_from_disk` loads the tiny policy's
  checkpoint, with SGLang's own flush rule). Tokens, log-probs, latency and aborts come from
  `workers.sim.core.SimEngine`, the project's simulator.

It is a process of its own: importing SGLang's server sets uvloop as the event-loop policy and
publishes process-wide config, and costs ~20 s of CPU. SGLang is the `conformance` extra's (not a
runtime dependency): this module imports it only inside the process it serves from.

One stub, while SGLang's modules import only: `sglang.srt.managers.io_struct` drags in
`sglang/srt/multimodal/internvl_utils.py`, which imports `torchvision.transforms` at module
level; the PyPI torchvision wheels are CUDA builds that do not load against the CPU torch
wheel, so `import_with_stubs` stubs `torchvision` by an import hook while that import runs (never
shadowing a real installation), then removes the hook and the stub modules and puts back the
environment variables the import set; transformers' `is_torchvision_available()` is cached
(False) before the hook goes in.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# A Qwen2 shape small enough to describe, never loaded: ModelConfig reads the architecture,
# the vocabulary and max_position_embeddings (the context when --context-length is not given).
_MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 151936,
    "max_position_embeddings": 32768, "torch_dtype": "float32", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "eos_token_id": 151645, "bos_token_id": 151643, "tie_word_embeddings": True,
}


# ============================================================================ importing SGLang


class _StubType(type):
    """Any attribute of a stubbed class is another stub class (`InterpolationMode.BICUBIC`)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_with_stubs(name: str, roots: tuple[str, ...]) -> types.ModuleType:
    """Import `name` with the top-level packages `roots` stubbed while it runs (see the module
    docstring). Environment variables and warning filters that the import sets (sglang sets its
    cache directories and a dozen filters) are put back, so the rest of the process is unchanged."""
    environ = dict(os.environ)
    try:  # cache transformers' verdict on the real environment before the hook exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # noqa: BLE001
        pass
    real = [r for r in roots if importlib.util.find_spec(r) is not None]
    roots = tuple(r for r in roots if r not in real)  # never shadow a real installation
    finder = _StubFinder(roots)
    sys.meta_path.insert(0, finder)
    try:
        with warnings.catch_warnings():  # restores the filters the import adds
            return importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        for key in [k for k in sys.modules if k.partition(".")[0] in roots]:
            del sys.modules[key]
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


# ============================================================================ the front process



def model_dir(workdir: Path, model_context: int) -> Path:
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
    tp_worker = import_with_stubs("sglang.srt.managers.tp_worker", ("torchvision",))
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

        held, slots = self.engine.held_count(), self.engine.config.slots
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
            engine.pause(obj.mode)
        elif isinstance(obj, io.ContinueGenerationReqInput):
            engine.resume()
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
                     "running": engine.held_count()}
            await self._reply(io.GetInternalStateReqOutput(internal_state=state, http_worker_ipc=obj.http_worker_ipc))

    async def _generate(self, req: Any) -> None:
        from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

        engine = self.engine
        input_ids = [int(t) for t in req.input_ids]
        params = req.sampling_params
        if req.rid.startswith(HEALTH_CHECK_RID_PREFIX):  # /health's one-token probe: any answer is health
            await self._output(req, [0], [0.0], {"type": "length", "length": 1}, None)
            return
        engine.stats["requests"] += 1
        fault = engine.take_fault()
        if fault is not None:  # /sim/fail_next: the scheduler aborts it with that status (FINISH_ABORT)
            status, message = fault
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
        [running] = engine.track([req.rid])
        self.publish_load()
        try:
            await engine.until_resumed()
            engine.note_priority(req.rid, req.priority)  # the scheduler's waiting queue (workers/sim/scheduler.py)
            ids, lps, finish, _spans = await engine.run(running, input_ids, routing_key, sim_params)
        finally:
            engine.release([req.rid])
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
    global _serving
    http_server = import_with_stubs("sglang.srt.entrypoints.http_server", ("torchvision",))
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    from workers.sim.config import SimConfig
    from workers.sim.core import SimEngine

    _serving = contextvars.ContextVar("sglang_engine")
    http_server.set_global_state(_EngineState())
    model = str(model_dir(Path(args.workdir), args.model_context))
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
                                 schedule_low_priority_values_first=bool(sim_fields.get("low_priority_values_first")),
                                 # the label SGLang's front starts with (its --weight-version), the simulator's too
                                 weight_version=str(sim_fields.get("weight_version", "default")))
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

    from workers.sim.http_front import HttpFront

    engine = scheduler.engine
    front = HttpFront(engine)  # the simulator's own routes are the plain front's

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
        engine.stats["max_running"] = engine.held_count()
        return web.json_response(dataclasses.asdict(engine.config))

    async def bodies(_request: web.Request) -> web.Response:
        return web.json_response(scheduler.bodies)

    app = web.Application()
    app.router.add_get("/sim/stats", front.get_stats)
    app.router.add_get("/sim/bodies", bodies)
    app.router.add_post("/sim/fail_next", front.fail_next)
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
    raise SystemExit(main())
