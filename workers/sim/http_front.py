"""SGLang 0.5.23's native HTTP endpoints over a simulated engine (workers/sim/core.py): the
routes, the parsing of a /generate body, SGLang's refusals and answer shapes. The engine decides
what happens to a request; this says it as SGLang's HTTP server says it.

Endpoints, with SGLang's behaviour (docs/architecture.md "The engine"): POST /generate, GET
/health (503 while starting), GET /model_info, GET /server_info (with `context_length`), POST
/abort_request, POST /pause_generation {"mode": "abort" | "in_place" | "retract"}, POST
/continue_generation, POST /update_weight_version {"new_version", "abort_all_requests": true},
POST /update_weights_from_disk {"model_path", "abort_all_requests": false, "weight_version"},
GET /v1/loads (core keys), and the router's GET /workers (itself as the one worker, for slime's
abort). Simulator-only, under /sim/: POST /sim/fail_next {"status", "count", "message"} (inject
HTTP errors), GET /sim/stats and GET /sim/arrivals?since=T (the wall-clock arrival times, epoch
seconds, of the last ARRIVALS_KEPT /generate requests after T: scripts/bench/push_gap.py times a
publish to the first request).

It refuses what SGLang refuses, with SGLang's status and message: sampling values out of range
(pipeline/sampling.py, SGLang's rules on the raw dict), an unknown sampling key, a rid that is
still running ("Duplicate request ID detected"), input at or over the context length, input +
max_new_tokens over it. `n > 1` answers a JSON array, as SGLang does.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec
from aiohttp import web

from pipeline.sampling import sampling_errors
from workers.sim.core import RunningRequest, SimEngine
from workers.sim.policy import DEFAULT_MAX_NEW_TOKENS

_json = msgspec.json.Encoder()
# SGLang's SamplingParams fields (sglang/srt/sampling/sampling_params.py), what a request may carry
_SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n beam_width json_schema regex ebnf structural_tag "
    "ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias "
    "sampling_seed custom_params watermark".split()
)
_INT_KEYS = frozenset({"max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "beam_width", "stream_interval"})
ARRIVALS_KEPT = 65536  # /generate arrival times kept for GET /sim/arrivals (0.5 MB)


class HttpFront:
    """The routes of one simulated engine."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)  # time.time() of each /generate, newest last

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.get("/health", self.health),
                web.get("/model_info", self.model_info),
                web.get("/get_model_info", self.model_info),
                web.get("/server_info", self.server_info),
                web.post("/abort_request", self.abort_request),
                web.post("/pause_generation", self.pause),
                web.post("/continue_generation", self.resume),
                web.post("/update_weight_version", self.update_weight_version),
                web.post("/update_weights_from_disk", self.update_weights_from_disk),
                web.get("/v1/loads", self.loads),
                web.get("/workers", self.workers),
                web.post("/sim/fail_next", self.fail_next),
                web.get("/sim/stats", self.get_stats),
                web.get("/sim/arrivals", self.get_arrivals),
            ]
        )
        return app

    # ------------------------------------------------------------ facts

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.starting() else 200)

    async def server_info(self, _request: web.Request) -> web.Response:
        engine = self.engine
        c, scheduler, table = engine.config, engine.scheduler, engine.table
        info: dict[str, Any] = {
            "model_path": c.model or "simulated-engine",
            "tokenizer_path": engine.tokenizer_path,
            "context_length": c.context_length,
            "max_running_requests": scheduler.config.max_running_requests if scheduler else c.slots,
            "enable_priority_scheduling": c.priority_scheduling,
            "schedule_low_priority_values_first": c.low_priority_values_first,
            "priority_scheduling_preemption_threshold": c.priority_preemption_threshold,
            "chunked_prefill_size": c.chunked_prefill_size,
            "max_prefill_tokens": c.max_prefill_tokens,
            "tp_size": c.tp,
            "version": "0.5.23-sim",
            # what it plays: the step times' source, the GPU, the clock
            "sim_physics": "instant" if scheduler is None else ("table" if table else "flat"),
            "sim_gpu": c.gpu if table else None,
            "sim_step_source": table.source if table else None,
            "sim_time_scale": c.time_scale,
        }
        if scheduler is not None:
            info["max_total_num_tokens"] = scheduler.config.kv_pool_tokens
        if table is not None:
            info["mem_fraction_static"] = engine.mem_fraction
        return web.json_response(info)

    async def model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "simulated-engine",
                "tokenizer_path": self.engine.tokenizer_path,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
            }
        )

    async def loads(self, _request: web.Request) -> web.Response:
        """SGLang's GET /v1/loads (entrypoints/v1_loads.py), one DP rank, core keys only:
        slime's abort polls it (server_control.py) until nothing is running or waiting."""
        engine = self.engine
        held = engine.held_count()
        if engine.scheduler is not None:
            running, limit = len(engine.scheduler.running), engine.scheduler.config.max_running_requests
        else:
            running, limit = held, engine.config.slots
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running,
                "num_waiting_reqs": held - running, "max_running_requests": limit}
        return web.json_response({"timestamp": load["timestamp"], "version": "0.5.23-sim", "accelerator": None,
                                  "num_accelerators": 0, "loads": [load]})

    async def workers(self, request: web.Request) -> web.Response:
        """The router's GET /workers (SGLang Model Gateway), as when this engine is also the
        router: one regular worker, itself. slime's abort reads the worker URLs from it."""
        worker = {"id": "sim-0", "url": f"http://{request.host}", "model_id": "simulated-engine",
                  "worker_type": "regular", "is_healthy": True}
        return web.json_response({"workers": [worker], "total": 1})

    # ------------------------------------------------------------ control

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("abort_all"):
            self.engine.abort_all("Abort request")
        else:
            self.engine.abort(body.get("rid", ""), "Abort request")
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        """abort (SGLang's default): abort running requests; in_place / retract: they stay and
        wait. New requests wait until continue in every mode."""
        body = await request.json() if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return web.json_response({"error": f"unknown pause mode {mode!r}"}, status=422)
        self.engine.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, _request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "new_version" not in body:
            return _field_required("new_version")
        engine = self.engine
        if body.get("abort_all_requests", True):
            engine.abort_all("Abort for weight version update")
        await engine.push_weights(str(body["new_version"]))
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {engine.weight_version}",
             "new_version": engine.weight_version}
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's POST /update_weights_from_disk (UpdateWeightFromDiskReqInput: model_path,
        abort_all_requests = false, weight_version): the tiny policy loads the checkpoint."""
        body = await request.json()
        if "model_path" not in body:
            return _field_required("model_path")
        if body.get("abort_all_requests", False):
            self.engine.abort_all("Abort for weight update")
        # lenient where SGLang is not: a refused flush is no error here (this route's abort pause
        # does not wait for the aborted requests to leave; the engine stack's front is SGLang's)
        ok, message, _flushed = await self.engine.load_weights_from_disk(
            str(body["model_path"]), body.get("weight_version"), flush=bool(body.get("flush_cache", True)))
        return web.json_response({"success": ok, "message": message, "num_paused_requests": 0},
                                 status=200 if ok else 400)

    async def fail_next(self, request: web.Request) -> web.Response:
        body = await request.json()
        status, message = int(body.get("status", 503)), str(body.get("message", "simulated failure"))
        return web.json_response({"queued": self.engine.queue_faults(status, message, int(body.get("count", 1)))})

    async def get_stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.engine.stats_report())

    async def get_arrivals(self, request: web.Request) -> web.Response:
        since = request.query.get("since", "0")
        try:
            after = float(since)
        except ValueError:
            return web.json_response({"error": f"since={since!r} is not a number (epoch seconds)"}, status=400)
        return web.json_response({"arrivals": [t for t in self.arrivals if t > after]})

    # ------------------------------------------------------------ generate

    async def generate(self, request: web.Request) -> web.Response:
        engine = self.engine
        started = time.monotonic()
        self.arrivals.append(time.time())
        engine.stats["requests"] += 1
        number = engine.stats["requests"]  # before any await: concurrent requests must not share a default rid
        fault = engine.take_fault()
        if fault is not None:
            return _error(*fault)
        if engine.starting():
            return _error(503, "The server is starting up")
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return web.json_response({"error": f"invalid JSON body: {exc}"}, status=400)
        refusal = self._refuse(body)
        if refusal is not None:
            return refusal
        input_ids: list[int] = body["input_ids"]
        params: dict[str, Any] = body.get("sampling_params") or {}
        rid = str(body.get("rid") or f"sim-{number}")
        routing_key = request.headers.get("X-SMG-Routing-Key") or body.get("routing_key") or rid
        keys = engine.stats["routing_keys"]
        keys[routing_key] = keys.get(routing_key, 0) + 1
        n = int(params.get("n") or 1)
        rids = [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
        held = engine.track(rids)  # registered from now until the answer
        try:
            await engine.until_resumed()
            answers = await asyncio.gather(
                *(self._answer_one(running, input_ids, f"{routing_key}#{i}" if n > 1 else routing_key, params,
                                   started, body.get("priority"))
                  for i, running in enumerate(held))
            )
        finally:
            engine.release(rids)
        payload = answers[0] if n == 1 else answers
        return web.Response(body=_json.encode(payload), content_type="application/json")

    def _refuse(self, body: Any) -> web.Response | None:
        """SGLang's refusals of a /generate body, with its status codes and error shapes."""
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(t, int) for t in input_ids):
            return web.json_response({"error": "input_ids must be a non-empty list of token ids"}, status=400)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            return web.json_response({"error": "sampling_params must be an object"}, status=400)
        unknown = sorted(set(params) - _SAMPLING_KEYS)
        if unknown:  # SGLang's contract gate (entrypoints/api_contract.py): a plain-string error
            expected = ", ".join(f"`{k}`" for k in sorted(_SAMPLING_KEYS))
            return web.json_response({"error": f"unknown field `{unknown[0]}`, expected one of {expected}"}, status=400)
        for key in _INT_KEYS & set(params):
            if isinstance(params[key], float):
                return web.json_response(
                    {"error": f"invalid type: floating point `{params[key]}`, expected i64"}, status=400)
        errors = sampling_errors(params, pipeline=False)
        if errors:
            return _value_error(errors[0])
        priority = body.get("priority")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)
                                     or not -(1 << 63) <= priority < (1 << 63)):
            # tokenizer_manager.py _set_default_priority
            return _value_error("priority must be a signed 64-bit integer between -9223372036854775808 and "
                                "9223372036854775807")
        rid = body.get("rid")
        if rid is not None and (self.engine.held(str(rid)) or self.engine.held(f"{rid}_0")):
            return _value_error(f"Duplicate request ID detected: {rid}")
        return _context_refusal(input_ids, params, self.engine.config.context_length)

    async def _answer_one(
        self, running: RunningRequest, input_ids: list[int], routing_key: str, params: dict[str, Any], started: float,
        priority: int | None = None,
    ) -> dict[str, Any]:
        engine = self.engine
        engine.note_priority(running.rid, priority)
        ids, log_probs, finish, spans = await engine.run(running, input_ids, routing_key, params)
        engine.stats["output_tokens"] += len(ids)
        meta: dict[str, Any] = {
            "id": running.rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": running.cached_tokens,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,  # SGLang sends them for every finished request
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(log_probs, ids)],
            "e2e_latency": time.monotonic() - started,
        }
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta}


def _context_refusal(input_ids: list[int], params: dict[str, Any], context: int) -> web.Response | None:
    """SGLang's refusal of input at or over the context length, or input + max_new_tokens over it."""
    n_input = len(input_ids)
    if n_input >= context:
        return _value_error(f"The input ({n_input} tokens) is longer than the model's context length ({context} tokens).")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None and max_new + n_input > context:
        return _value_error(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {max_new + n_input} tokens: {n_input} tokens from the input messages "
            f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        )
    return None


def _field_required(name: str) -> web.Response:
    """FastAPI's 422 for a body without a required field."""
    return web.json_response({"detail": [{"loc": ["body", name], "msg": "Field required"}]}, status=422)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


def _value_error(message: str) -> web.Response:
    """How SGLang's HTTP server answers a ValueError from request handling (HTTP 400)."""
    return web.json_response({"error": {"message": message}}, status=400)
