"""A SIMULATED SGLang engine: a real aiohttp server with SGLang's native endpoints and a
scripted policy instead of a model. It is the engine of the demo, the tests and the
benchmarks; it is never a stand-in for measuring model quality.

Endpoints, with SGLang 0.5.23's behaviour (docs/architecture.md "The engine"): POST
/generate, GET /health (503 while starting), GET /model_info, GET /server_info (with
`context_length`), POST /abort_request, POST /pause_generation {"mode": "abort" |
"in_place" | "retract"}, POST /continue_generation, POST /update_weight_version
{"new_version", "abort_all_requests": true}, GET /v1/loads (core keys), and the router's
GET /workers (itself as the one worker, for slime's abort). Simulator-only, under /sim/: POST
/sim/fail_next {"status", "count", "message"} (inject HTTP errors), GET /sim/stats and GET
/sim/arrivals?since=T (the wall-clock arrival times, epoch seconds, of the last ARRIVALS_KEPT
/generate requests after T: scripts/bench/push_gap.py times a publish to the first request).

It refuses what SGLang refuses, with SGLang's status and message: sampling values out of
range (pipeline/sampling.py, SGLang's rules on the raw dict), an unknown sampling key, a
rid that is still running ("Duplicate request ID detected"), input at or over the context
length, input + max_new_tokens over it. `n > 1` answers a JSON array, as SGLang does.
A weight-version update aborts running requests unless told not to; under the
`in_place`/`retract` pause modes requests survive the pause, and an update during it
shows up as `meta_info.weight_versions` spans; with `--policy-path` the tokens after an
`/update_weights_from_disk` are the new weights' draws (`SimEngine.load_weights_from_disk`).

The policy works on the real test tokenizer (workers.sim.tokenizer). For each turn
it decodes the input ids, finds the last user question and:
- if tools are offered (`<tools>` in the system prompt) and no tool answered yet,
  calls one (probability `tool_use`) in Hermes format: `<tool_call>{json}</tool_call>`;
- otherwise answers `... Answer: X`. X is right with probability `accuracy`. The
  simulator knows the right answer only by evaluating an arithmetic question
  ("What is 12 * 7?") itself or by looking the question up in tasks given with
  `--tasks FILE` (tasks.jsonl with labels): it is told the answers, it does not
  reason.
Response length: a lognormal number of filler tokens (long tail). Time: the scheduler's step
loop (workers/sim/scheduler.py, SGLang's event_loop_normal in simulated time: admission by KV
pool and chunked-prefill budget, max running requests, FCFS or priority with preemption, decode
retraction, a radix prefix cache) with a named model's measured step times on a named GPU
(`model`/`gpu`/`tp`, workers/sim/physics.py), or without a model a flat `token_latency_s` per
decode step, or none at all (instant answers, unit tests). Every running request gains one token
per step; there is no per-request speed.
A turn's plan is seeded by (seed, routing key, context length), so a request resumed
after an abort continues the same plan, and the n episodes of a group differ.

`rollout engine --port P [...]` serves it; `serve_sim_engine(SimConfig())` is an async
context manager that serves it in the caller's event loop and yields the URL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from pipeline.sampling import sampling_errors
from pipeline.schema import Task
from workers.sim.physics import FlatSteps, ScaledSteps, StepModel, StepTable, load_table, sglang_max_running_requests
from workers.sim.scheduler import BatchScheduler, SchedulerConfig, SimReq

log = logging.getLogger(__name__)

_QUESTION = re.compile(r"(?:what is|compute|calculate|evaluate)\s+([-+*/%().\d\s]+?)\s*[?.=]?\s*$", re.IGNORECASE)
_FILLER_WORDS = (
    "the answer is that let me think about this step by step first we have then we get so result check "
    "again compute and multiply add numbers total is value of it for with hmm wait right ok"
).split()
_json = msgspec.json.Encoder()
# SGLang's SamplingParams fields (sglang/srt/sampling/sampling_params.py), what a request may carry
_SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n beam_width json_schema regex ebnf structural_tag "
    "ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias "
    "sampling_seed custom_params watermark".split()
)
_INT_KEYS = frozenset({"max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "beam_width", "stream_interval"})
_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request does not say
# without a model the pool never limits admission in practice, but stays finite: the prefix cache
# keeps finished requests' tokens until the pool needs them, so its memory is bounded by this
_FLAT_POOL_TOKENS = 1 << 21
ARRIVALS_KEPT = 65536  # /generate arrival times kept for GET /sim/arrivals (0.5 MB)


@dataclass
class SimConfig:
    accuracy: float = 0.7  # probability that a final answer is right
    tool_use: float = 0.9  # probability to call a tool first when tools are offered
    malformed_rate: float = 0.0  # probability that a tool call is broken JSON
    length_mu: float = 3.5  # lognormal filler length: exp(mu) ~ 33 tokens median
    length_sigma: float = 0.8
    max_filler_tokens: int = 2048
    # Physics (workers/sim/physics.py, workers/sim/scheduler.py). `model` set: SGLang's step loop
    # with that model's measured step times on `gpu` x `tp` (a committed aiconfigurator table);
    # else `token_latency_s` > 0: the same step loop, every decode step that long, prefill free;
    # else instant: every answer at once, no capacity (unit tests).
    model: str = ""  # e.g. Qwen/Qwen3-8B (workers/sim/step_tables/)
    gpu: str = "h100_sxm"  # h100_sxm | h200_sxm
    tp: int = 1
    time_scale: float = 1.0  # simulated seconds per real second (benchmarks on 2 cores run faster clocks)
    token_latency_s: float = 0.0  # without a model: seconds per decode step; 0 = instant
    step_time_factor: float = 1.0  # every step (decode and prefill) this many times as long (ScaledSteps)
    latency_sigma: float = 0.0  # ignored: the per-request speed draw is gone (kept so old configs load)
    slots: int = 256  # --max-running-requests (0: SGLang's default from the KV pool)
    mem_fraction_static: float = 0.0  # 0: SGLang's default for the GPU (physics.sglang_mem_fraction_static)
    kv_pool_tokens: int = 0  # --max-total-tokens; 0: from model, GPU and mem fraction (no model: 2**21)
    chunked_prefill_size: int = 8192  # SGLang's default on 80-160 GB GPUs; -1 = no chunking
    max_prefill_tokens: int = 16384  # SGLang's --max-prefill-tokens default
    # SGLang's --enable-priority-scheduling / --schedule-low-priority-values-first /
    # --priority-scheduling-preemption-threshold
    priority_scheduling: bool = False
    low_priority_values_first: bool = False
    priority_preemption_threshold: int = 10
    weight_push_gbps: float = 25.0  # with a model: a weight update holds the GPU model bytes / this (GB/s); 0 = free
    context_length: int = 32768
    weight_version: str = "default"
    startup_s: float = 0.0  # /health answers 503 (and /generate is refused) this long after start
    seed: int = 0
    tokenizer_path: str = ""  # "" = the shared test tokenizer
    answers: dict[str, str] = field(default_factory=dict)  # question text -> label (from --tasks)
    puzzle: bool = False  # play sliding-puzzle moves (NeMo-RL's SlidingPuzzleEnv games), see `_puzzle_move`
    # a tiny causal LM checkpoint (workers/sim/tinylm.py) that decides the tokens instead of the
    # scripted policy; "" = the scripted policy. /update_weights_from_disk replaces its weights.
    policy_path: str = ""


@dataclass
class _Running:
    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    message: str = ""
    produced: int = 0
    priority: int | None = None  # the `priority` it is scheduled by
    cached_tokens: int = 0  # prefix-cache hit (meta_info.cached_tokens)
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (old label, tokens so far) per update
    plan: _Plan | None = None  # the tiny policy's answer for it (`--policy-path`), once drawn


@dataclass
class _Plan:
    """A tiny-policy request's answer: what it asked for and what the weights drew. `ids` is the
    list the scheduler's SimReq steps through (`output_ids`); a weight load re-draws it past the
    tokens already emitted, in place (`SimEngine._redraw_stale`)."""

    request: Any  # workers.sim.tinylm.GenRequest
    ids: list[int]
    log_probs: list[float]
    finish: dict[str, Any]
    weights: int  # which load of the policy's weights drew the ids past the emitted ones


@dataclass(frozen=True)
class EnginePhysics:
    """What a `SimConfig` makes of the engine's hardware: the scheduler's limits (KV pool, max
    running requests, chunk budgets, priority rules), the step model and the weight push's GPU
    time. The served engine and the schedule simulations (scripts/bench/ideal.py) build it here."""

    limits: SchedulerConfig
    steps: StepModel
    table: StepTable | None
    mem_fraction: float
    push_s: float  # a weight update's GPU time, simulated seconds (0 without a model)


def engine_physics(c: SimConfig) -> EnginePhysics | None:
    """The physics `c` plays; None in instant mode (no model, no token latency)."""
    table = load_table(c.model, c.gpu, c.tp) if c.model else None
    steps: StepModel | None = table if table is not None else (
        FlatSteps(c.token_latency_s) if c.token_latency_s > 0 else None)
    if steps is None:
        return None
    if c.step_time_factor != 1.0:
        if c.step_time_factor <= 0:
            raise ValueError(f"step_time_factor must be > 0, not {c.step_time_factor}")
        steps = ScaledSteps(steps, c.step_time_factor)
    if c.time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, not {c.time_scale}")
    mem_fraction = c.mem_fraction_static or (table.default_mem_fraction(c.chunked_prefill_size) if table else 0.0)
    pool = c.kv_pool_tokens or (table.kv_pool_tokens(mem_fraction) if table is not None else _FLAT_POOL_TOKENS)
    max_running = c.slots or sglang_max_running_requests(pool, c.context_length)
    limits = SchedulerConfig(kv_pool_tokens=pool, max_running_requests=max_running,
                             chunked_prefill_size=c.chunked_prefill_size, max_prefill_tokens=c.max_prefill_tokens,
                             priority_scheduling=c.priority_scheduling,
                             low_priority_values_first=c.low_priority_values_first,
                             preemption_threshold=c.priority_preemption_threshold, time_scale=c.time_scale)
    push_s = weight_push_s(c, table) if table is not None else 0.0
    return EnginePhysics(limits=limits, steps=steps, table=table, mem_fraction=mem_fraction, push_s=push_s)


def weight_push_s(c: SimConfig, table: StepTable) -> float:
    """A weight update's GPU time: the model's bytes over `weight_push_gbps` (0: free)."""
    return table.model_bytes / (c.weight_push_gbps * 1e9) if c.weight_push_gbps > 0 else 0.0


class SimEngine:
    def __init__(self, config: SimConfig):
        from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

        self.config = config
        self.tokenizer_path = config.tokenizer_path or default_tokenizer_path()
        self.tokenizer = load_test_tokenizer(self.tokenizer_path)
        self.eos_id: int = self.tokenizer.eos_token_id
        self.weight_version = config.weight_version
        self._filler_ids = self._single_token_words()
        self._assistant_header = self.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.scheduler: BatchScheduler | None = None
        self._apply_config()
        self.policy: Any = None  # workers.sim.tinylm.TinyPolicy when config.policy_path is set
        self._policy_queue: list[tuple[Any, asyncio.Future[Any]]] = []
        self._policy_busy = False
        self._loading = asyncio.Lock()  # one weight load at a time (SGLang's scheduler runs them in turn)
        self.set_policy(config.policy_path)
        self._paused_in_place = False  # in_place/retract: running requests wait instead of aborting
        self._started_at = time.monotonic()
        self._running: dict[str, _Running] = {}
        self._faults: list[tuple[int, str]] = []
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)  # time.time() of each /generate, newest last
        self.stats: dict[str, Any] = {"requests": 0, "aborted": 0, "max_running": 0, "routing_keys": {}, "errors": 0,
                                      "output_tokens": 0,  # every token answered, aborted partial outputs included
                                      # the plan's full response length per routing key, at its first
                                      # fresh turn (benchmarks compare trained lengths with it)
                                      "planned": {},
                                      # input tokens of requests resuming a turn (an abort's re-prefill)
                                      "resumed_requests": 0, "resumed_input_tokens": 0,
                                      "priorities": {}}  # rid -> the `priority` it was scheduled by

    def _apply_config(self) -> None:
        """(Re)build the physics from `self.config`: the step model, the KV pool, the scheduler's
        limits. A scheduler already running keeps its queue, batch and cache."""
        c = self.config
        physics = engine_physics(c)
        self.table = physics.table if physics is not None else None
        if physics is None:
            self.scheduler = None  # instant mode: every answer at once
            return
        self.mem_fraction = physics.mem_fraction
        current = getattr(self, "scheduler", None)
        if current is not None:
            current.config, current.steps = physics.limits, physics.steps
        else:
            self.scheduler = BatchScheduler(physics.limits, physics.steps, self._resumed, on_token=_count_token)

    def set_slots(self, slots: int) -> None:
        """Generations at once (SGLang's max_running_requests), and any other SimConfig change, for what comes next."""
        self.config = dataclasses.replace(self.config, slots=slots)
        self._apply_config()

    def _single_token_words(self) -> list[int]:
        ids = [self.tokenizer.encode(" " + w, add_special_tokens=False) for w in _FILLER_WORDS]
        return [i[0] for i in ids if len(i) == 1] or [i[0] for i in ids]

    # ------------------------------------------------------------ app

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

    def _starting(self) -> bool:
        return time.monotonic() - self._started_at < self.config.startup_s

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=503 if self._starting() else 200)

    async def server_info(self, _request: web.Request) -> web.Response:
        c = self.config
        info: dict[str, Any] = {
            "model_path": c.model or "simulated-engine",
            "tokenizer_path": self.tokenizer_path,
            "context_length": c.context_length,
            "max_running_requests": self.scheduler.config.max_running_requests if self.scheduler else c.slots,
            "enable_priority_scheduling": c.priority_scheduling,
            "schedule_low_priority_values_first": c.low_priority_values_first,
            "priority_scheduling_preemption_threshold": c.priority_preemption_threshold,
            "chunked_prefill_size": c.chunked_prefill_size,
            "max_prefill_tokens": c.max_prefill_tokens,
            "tp_size": c.tp,
            "version": "0.5.23-sim",
            # what it plays: the step times' source, the GPU, the clock
            "sim_physics": "instant" if self.scheduler is None else ("table" if self.table else "flat"),
            "sim_gpu": c.gpu if self.table else None,
            "sim_step_source": self.table.source if self.table else None,
            "sim_time_scale": c.time_scale,
        }
        if self.scheduler is not None:
            info["max_total_num_tokens"] = self.scheduler.config.kv_pool_tokens
        if self.table is not None:
            info["mem_fraction_static"] = self.mem_fraction
        return web.json_response(info)

    async def model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "simulated-engine",
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "weight_version": self.weight_version,
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        targets = list(self._running.values()) if body.get("abort_all") else [self._running.get(body.get("rid", ""))]
        for running in targets:
            if running is not None:
                running.message = "Abort request"
                running.aborted.set()
        return web.Response(status=200)

    async def loads(self, _request: web.Request) -> web.Response:
        """SGLang's GET /v1/loads (entrypoints/v1_loads.py), one DP rank, core keys only:
        slime's abort polls it (server_control.py) until nothing is running or waiting."""
        held = len(self._running)
        if self.scheduler is not None:
            running, limit = len(self.scheduler.running), self.scheduler.config.max_running_requests
        else:
            running, limit = held, self.config.slots
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

    async def pause(self, request: web.Request) -> web.Response:
        """abort (SGLang's default): abort running requests; in_place / retract: they stay and
        wait. New requests wait until continue in every mode."""
        body = await request.json() if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return web.json_response({"error": f"unknown pause mode {mode!r}"}, status=422)
        self._resumed.clear()
        self._paused_in_place = mode != "abort"
        if mode == "abort":
            self._abort_all("Abort for pause generation")
        elif mode == "retract" and self.scheduler is not None:
            self.scheduler.retract_all()  # their KV is freed: they re-prefill after continue
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, _request: web.Request) -> web.Response:
        self._paused_in_place = False
        self._resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "new_version" not in body:
            return web.json_response({"detail": [{"loc": ["body", "new_version"], "msg": "Field required"}]}, status=422)
        if body.get("abort_all_requests", True):
            self._abort_all("Abort for weight version update")
        await self.push_weights(str(body["new_version"]))
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {self.weight_version}",
             "new_version": self.weight_version}
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's POST /update_weights_from_disk (UpdateWeightFromDiskReqInput: model_path,
        abort_all_requests = false, weight_version): the tiny policy loads the checkpoint."""
        body = await request.json()
        if "model_path" not in body:
            return web.json_response({"detail": [{"loc": ["body", "model_path"], "msg": "Field required"}]}, status=422)
        if body.get("abort_all_requests", False):
            self._abort_all("Abort for weight update")
        # lenient where SGLang is not: a refused flush is no error here (this route's abort pause
        # does not wait for the aborted requests to leave; the engine stack's front is SGLang's)
        ok, message, _flushed = await self.load_weights_from_disk(str(body["model_path"]), body.get("weight_version"),
                                                                  flush=bool(body.get("flush_cache", True)))
        return web.json_response({"success": ok, "message": message, "num_paused_requests": 0},
                                 status=200 if ok else 400)

    def set_policy(self, path: str) -> None:
        """Serve the tiny LM checkpoint at `path` (workers/sim/tinylm.py), or the scripted policy ("")."""
        self.config = dataclasses.replace(self.config, policy_path=path)
        if not path:
            self.policy = None
            return
        from workers.sim.tinylm import TinyPolicy

        self.policy = TinyPolicy(path, self.tokenizer, seed=self.config.seed)

    async def load_weights_from_disk(self, path: str, version: str | None,
                                     flush: bool = True) -> tuple[bool, str, bool]:
        """The weights at `path` replace the policy's (after the batch in flight), every request
        in flight has what it has not emitted yet re-drawn by them (`_redraw_stale`), then the
        weight version changes as a push does (push time, spans) and, with `flush` (SGLang's
        `flush_cache`, default true), the prefix cache is flushed if no request holds it.
        Returns (loaded, message, flushed or not asked to flush).

        The re-draw is here, not at /continue_generation: the step after the load is the first
        one on the new weights whether the engine is paused (SGLang loads at once under a pause)
        or not, and the label changes here, so the spans and the tokens change at the same token.
        No step runs from the load to the end of the re-draw (`BatchScheduler.frozen`)."""
        if self.policy is None:
            return False, "this simulated engine plays the scripted policy (no --policy-path): no weights to load", True
        async with self._loading:
            with self.scheduler.frozen() if self.scheduler is not None else contextlib.nullcontext():
                try:
                    await asyncio.to_thread(self.policy.load, path)
                except (OSError, ValueError) as exc:
                    return False, f"Failed to load weights from {path}: {exc}", True
                await self._redraw_stale()
            # SGLang flushes after a load whether or not it carries a version label
            flushed = await self.push_weights(str(version), flush=flush) if version is not None else self._flush(flush)
        return True, "Succeeded to update model weights.", flushed

    async def _redraw_stale(self) -> None:
        """Every request in flight whose plan an earlier load drew (and that no abort ended) gets
        the rest of its answer drawn again by the weights now loaded, in one batch: conditioned on
        its prompt and the tokens it already emitted, at its own sampling params, within what is
        left of its max_new_tokens, with these weights' log-probs and finish. As SGLang decodes
        after `/update_weights_from_disk` under an `in_place` / `retract` pause, up to the KV:
        SGLang's `in_place` keeps the prefix's KV the old weights computed, where the tiny model
        recomputes the whole prefix on the new weights (`retract` recomputes it in SGLang too)."""
        stale = [(running, running.plan, running.produced) for running in self._running.values()
                 if running.plan is not None and running.plan.weights != self.policy.loads
                 and not running.aborted.is_set() and running.produced < len(running.plan.ids)]
        if not stale:
            return
        requests = [dataclasses.replace(plan.request, emitted=plan.ids[:produced]) for _, plan, produced in stale]
        results = await asyncio.to_thread(self.policy.generate, requests)
        for (_running, plan, produced), result in zip(stale, results):
            plan.ids[produced:] = result.ids  # in place: the scheduler's SimReq steps through this list
            plan.log_probs[produced:] = result.log_probs
            plan.finish, plan.weights = result.finish, result.weights
        self.stats["redrawn_requests"] = self.stats.get("redrawn_requests", 0) + len(stale)

    async def push_weights(self, new_version: str, flush: bool = True) -> bool:
        """A weight update as the engine feels it: with a model, the GPU is busy model bytes /
        `weight_push_gbps` (no step runs; the call returns when it is done) and, with `flush`,
        the prefix cache is flushed (SGLang's update_weights_* flush it; refused while requests
        hold it, as after an in_place pause); then the label changes, and requests that survived
        the pause record the switch (weight-version spans). Returns False where a flush was
        asked for and refused."""
        scheduler, c = self.scheduler, self.config
        if scheduler is not None and self.table is not None and c.weight_push_gbps > 0:
            seconds = weight_push_s(c, self.table)
            scheduler.hold(seconds)
            self.stats["weight_push_s"] = self.stats.get("weight_push_s", 0.0) + seconds
            await asyncio.sleep(seconds / c.time_scale)
        flushed = self._flush(flush)
        old, self.weight_version = self.weight_version, new_version
        for running in self._running.values():  # survivors (paused in place) record the switch
            if running.produced:  # as SGLang's record_weight_version_events: only a request with output
                running.version_events.append((old, running.produced))
        return flushed

    def _flush(self, asked: bool) -> bool:
        """SGLang's `flush_cache` after a weight update, if `asked`: False where it was refused
        (a request holds the cache); without a step loop there is no cache to refuse."""
        if not asked or self.scheduler is None:
            return True
        if not self.scheduler.flush_cache():
            return False
        self.stats["cache_flushes"] = self.stats.get("cache_flushes", 0) + 1
        return True

    def _abort_all(self, message: str) -> None:
        for running in self._running.values():
            running.message = message
            running.aborted.set()

    async def fail_next(self, request: web.Request) -> web.Response:
        body = await request.json()
        fault = (int(body.get("status", 503)), str(body.get("message", "simulated failure")))
        self._faults += [fault] * int(body.get("count", 1))
        return web.json_response({"queued": len(self._faults)})

    async def get_stats(self, _request: web.Request) -> web.Response:
        return web.json_response({**self.stats, **self.physics_stats(), "weight_version": self.weight_version,
                                  "running": len(self._running)})

    async def get_arrivals(self, request: web.Request) -> web.Response:
        since = request.query.get("since", "0")
        try:
            after = float(since)
        except ValueError:
            return web.json_response({"error": f"since={since!r} is not a number (epoch seconds)"}, status=400)
        return web.json_response({"arrivals": [t for t in self.arrivals if t > after]})

    def physics_stats(self) -> dict[str, Any]:
        """The step loop's counters (steps, prefill tokens, cached tokens, retractions, preemptions,
        simulated busy time, KV use) and the KV pool's size; empty in instant mode."""
        if self.scheduler is None:
            return {}
        sch = self.scheduler
        return {**sch.stats, "kv_pool_tokens": sch.config.kv_pool_tokens, "kv_used": sch.kv_used,
                "sim_time_s": sch.sim_now, "num_waiting_reqs": len(sch.waiting), "num_running_reqs": len(sch.running),
                # output tokens the held requests have made so far (not yet answered): the bench's stock
                "held_output_tokens": sum(r.produced for r in (*sch.running, *sch.waiting))}

    # ------------------------------------------------------------ generate

    async def generate(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        self.arrivals.append(time.time())
        self.stats["requests"] += 1
        number = self.stats["requests"]  # before any await: concurrent requests must not share a default rid
        if self._faults:
            status, message = self._faults.pop(0)
            return _error(status, message)
        if self._starting():
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
        keys = self.stats["routing_keys"]
        keys[routing_key] = keys.get(routing_key, 0) + 1
        n = int(params.get("n") or 1)
        rids = [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
        for one in rids:  # registered from now until the answer, as SGLang's rid_to_state
            self._running[one] = _Running(one)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        try:
            await self._resumed.wait()
            answers = await asyncio.gather(
                *(self._answer_one(one, input_ids, f"{routing_key}#{i}" if n > 1 else routing_key, params, started,
                                   body.get("priority"))
                  for i, one in enumerate(rids))
            )
        finally:
            for one in rids:
                self._running.pop(one, None)
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
        if rid is not None and (str(rid) in self._running or f"{rid}_0" in self._running):
            return _value_error(f"Duplicate request ID detected: {rid}")
        context, n_input = self.config.context_length, len(input_ids)
        if n_input >= context:
            return _value_error(f"The input ({n_input} tokens) is longer than the model's context length ({context} tokens).")
        max_new = params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        if max_new is not None and max_new + n_input > context:
            return _value_error(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {max_new + n_input} tokens: {n_input} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        return None

    async def _answer_one(
        self, rid: str, input_ids: list[int], routing_key: str, params: dict[str, Any], started: float,
        priority: int | None = None,
    ) -> dict[str, Any]:
        async with self._slot(self._note_priority(rid, priority)):
            ids, log_probs, finish, spans = await self._run(self._running[rid], input_ids, routing_key, params)
        self.stats["output_tokens"] += len(ids)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": self._running[rid].cached_tokens if rid in self._running else 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,  # SGLang sends them for every finished request
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(log_probs, ids)],
            "e2e_latency": time.monotonic() - started,
        }
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _note_priority(self, rid: str, priority: int | None) -> int | None:
        if priority is not None:
            self.stats["priorities"][rid] = priority
        running = self._running.get(rid)
        if running is not None:
            running.priority = priority
        return priority

    @contextlib.asynccontextmanager
    async def _slot(self, priority: int | None = None) -> AsyncIterator[None]:
        """Kept for callers of the old slot queue: admission now happens in the scheduler's step loop."""
        yield

    async def _run(
        self, running: _Running, input_ids: list[int], routing_key: str, params: dict[str, Any]
    ) -> tuple[list[int], list[float], dict[str, Any], list[dict[str, Any]]]:
        if self.config.puzzle:
            return await self._run_puzzle(running, input_ids, params)
        if self.policy is not None:
            return await self._run_model(running, input_ids, params)
        plan_ids, plan_lps, done = self._plan(input_ids, routing_key)
        if done == 0:
            self.stats["planned"].setdefault(routing_key, len(plan_ids))
        else:
            self.stats["resumed_requests"] += 1
            self.stats["resumed_input_tokens"] += len(input_ids)
        budget = params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        budget = len(plan_ids) if budget is None else budget
        ids, lps = plan_ids[done : done + budget], plan_lps[done : done + budget]
        produced = await self._emit(running, input_ids, ids, params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS))
        if produced < len(ids):
            self.stats["aborted"] += 1
            finish: dict[str, Any] = {"type": "abort", "message": running.message}
        elif ids and ids[-1] == self.eos_id:
            finish = {"type": "stop", "matched": self.eos_id}
        else:
            finish = {"type": "length", "length": len(ids)}
        return ids[:produced], lps[:produced], finish, self._spans(running, produced)

    async def _run_model(
        self, running: _Running, input_ids: list[int], params: dict[str, Any]
    ) -> tuple[list[int], list[float], dict[str, Any], list[dict[str, Any]]]:
        """The tiny LM answers at the request's own sampling params; the scheduler times it. The
        answer is drawn whole when the request arrives; a weight load while it is in flight
        re-draws what it has not emitted yet (`load_weights_from_disk`), so every token is the
        draw of the weights loaded at its step."""
        from workers.sim.tinylm import GenRequest

        budget = params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        stops = params.get("stop") or []
        request = GenRequest(
            input_ids=input_ids, max_new_tokens=int(budget if budget is not None else _DEFAULT_MAX_NEW_TOKENS),
            temperature=float(params.get("temperature", 1.0) if params.get("temperature") is not None else 1.0),
            top_p=float(params.get("top_p") or 1.0), top_k=int(params.get("top_k") or -1),
            stop=[stops] if isinstance(stops, str) else list(stops),
            stop_token_ids=list(params.get("stop_token_ids") or []))
        result = await self._policy_generate(request)
        while result.weights != self.policy.loads:  # drawn before a load that ended since: draw again
            result = await self._policy_generate(request)
        plan = running.plan = _Plan(request, result.ids, result.log_probs, result.finish, result.weights)
        produced = await self._emit(running, input_ids, plan.ids, request.max_new_tokens)
        finish = plan.finish
        if produced < len(plan.ids):
            self.stats["aborted"] += 1
            finish = {"type": "abort", "message": running.message}
        return plan.ids[:produced], plan.log_probs[:produced], finish, self._spans(running, produced)

    async def _policy_generate(self, request: Any) -> Any:
        """Requests that arrive while a batch generates go together in the next one (one forward
        per token for the whole batch, as the scheduler's running batch)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._policy_queue.append((request, future))
        if not self._policy_busy:
            self._policy_busy = True
            asyncio.ensure_future(self._policy_loop())
        return await future

    async def _policy_loop(self) -> None:
        try:
            while self._policy_queue:
                await asyncio.sleep(0)  # the requests of this tick join the batch
                batch, self._policy_queue = self._policy_queue, []
                try:
                    results = await asyncio.to_thread(self.policy.generate, [r for r, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every waiter hears of it
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._policy_busy = False

    def _spans(self, running: _Running, produced: int) -> list[dict[str, Any]]:
        """The weight-version spans SGLang's `compute_weight_version_spans` (utils/weight_versions.py)
        makes of the request's events: output tokens per label. The simulator runs without sglang
        (importing it costs seconds and torch, in every process that plays an engine), so the rule
        is its own, pinned to SGLang's function by tests/conformance/test_sim_sglang_rules.py; the engine
        stack (tests/support/engine_stack.py, SGLang's front) calls SGLang's own on these events."""
        spans: list[dict[str, Any]] = []
        for version, end in [*running.version_events, (self.weight_version, produced)]:
            end = min(end, produced)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return spans or [{"version": self.weight_version, "start": 0, "end": produced}]

    async def _emit(self, running: _Running, input_ids: list[int], ids: list[int], max_new: int | None) -> int:
        """Run the request through the scheduler's step loop (instant mode: at once); returns
        how many of `ids` were produced before an abort. While paused in place nothing steps."""
        if self.scheduler is None or not ids:
            if not self._resumed.is_set() and self._paused_in_place:
                await self._resumed.wait()
            running.produced = 0 if running.aborted.is_set() else len(ids)
            return running.produced
        req = SimReq(running.rid, input_ids, ids, max(len(ids), max_new or 0), priority=running.priority)
        req.owner = running
        self.scheduler.submit(req)
        aborted = asyncio.ensure_future(running.aborted.wait())
        finished = asyncio.ensure_future(req.done.wait())
        try:
            await asyncio.wait({aborted, finished}, return_when=asyncio.FIRST_COMPLETED)
            if not req.done.is_set():
                self.scheduler.abort(req)
                await req.done.wait()
        finally:
            aborted.cancel()
            finished.cancel()
            if not req.done.is_set():  # the caller went away: the request leaves the engine too
                self.scheduler.abort(req)
        running.produced = req.produced
        running.cached_tokens = req.cached_tokens
        return req.produced

    async def _run_puzzle(
        self, running: _Running, input_ids: list[int], params: dict[str, Any]
    ) -> tuple[list[int], list[float], dict[str, Any], list[dict[str, Any]]]:
        """`--puzzle`: one sliding-puzzle move, cut at the first of the request's `stop` strings
        as SGLang cuts it (the output ends with the stop string's tokens, finish `stop`)."""
        move = _puzzle_move(self.tokenizer.decode(input_ids, skip_special_tokens=False))
        text = f"I slide {move}. <action>{move}</action> That is my move."
        stops = params.get("stop") or []
        hits = [(text.find(s), s) for s in ([stops] if isinstance(stops, str) else stops) if s and s in text]
        if hits:
            at, stop = min(hits)
            ids = self._encode(text[: at + len(stop)])
            finish: dict[str, Any] = {"type": "stop", "matched": stop}
        else:
            ids = self._encode(text) + [self.eos_id]
            finish = {"type": "stop", "matched": self.eos_id}
        budget = params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        if budget is not None and len(ids) > budget:
            ids, finish = ids[:budget], {"type": "length", "length": budget}
        produced = await self._emit(running, input_ids, ids, len(ids))
        if produced < len(ids):
            self.stats["aborted"] += 1
            finish = {"type": "abort", "message": running.message}
        return ids[:produced], [-0.5] * produced, finish, self._spans(running, produced)

    # ------------------------------------------------------------ policy

    def _plan(self, input_ids: list[int], routing_key: str) -> tuple[list[int], list[float], int]:
        """This turn's full response (ids, log-probs) and how much of it the input already holds."""
        turn_start = _rfind(input_ids, self._assistant_header)
        context_end = turn_start if turn_start >= 0 else len(input_ids)
        done = len(input_ids) - (turn_start + len(self._assistant_header)) if turn_start >= 0 else 0
        context = self.tokenizer.decode(input_ids[:context_end], skip_special_tokens=False)
        seed = int.from_bytes(
            hashlib.blake2b(f"{self.config.seed}|{routing_key}|{context_end}".encode(), digest_size=8).digest(), "little"
        )
        rng = np.random.default_rng(seed)
        body_ids = self._respond(context, rng)
        ids = body_ids + [self.eos_id]
        log_probs = (-np.abs(rng.normal(0.0, 0.4, size=len(ids)))).astype(np.float32).tolist()
        return ids, log_probs, min(done, len(ids))

    def _respond(self, context: str, rng: np.random.Generator) -> list[int]:
        question, after_question = _last_question(context)
        tools = _offered_tools(context)
        filler = self._filler(rng)
        if tools and "<tool_response>" not in after_question and rng.random() < self.config.tool_use:
            return filler + self._encode("\n" + self._tool_call(tools, question, rng))
        answer = self._answer(question, rng)
        return filler + self._encode(f" Answer: {answer}")

    def _filler(self, rng: np.random.Generator) -> list[int]:
        n = int(min(self.config.max_filler_tokens, max(1, rng.lognormal(self.config.length_mu, self.config.length_sigma))))
        return [int(i) for i in rng.choice(self._filler_ids, size=n)]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _tool_call(self, tools: list[dict[str, Any]], question: str, rng: np.random.Generator) -> str:
        if rng.random() < self.config.malformed_rate:
            return '<tool_call>\n{"name": "calculator", "arguments": {expression}\n</tool_call>'
        tool = tools[0].get("function", tools[0])
        params = tool.get("parameters", {}).get("properties", {})
        match = _QUESTION.search(question)
        expression = match.group(1).strip() if match else question[-100:]
        arguments = {name: expression for name in params} if params else {}
        return "<tool_call>\n" + json.dumps({"name": tool.get("name", "tool"), "arguments": arguments}) + "\n</tool_call>"

    def _answer(self, question: str, rng: np.random.Generator) -> str:
        truth = self._truth(question)
        if truth is not None and rng.random() < self.config.accuracy:
            return truth
        base = float(truth) if truth is not None and _is_number(truth) else 0.0
        wrong = base + float(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
        return str(int(wrong)) if wrong.is_integer() else str(wrong)

    def _truth(self, question: str) -> str | None:
        from workers.envs.local import evaluate_arithmetic

        if question.strip() in self.config.answers:
            from workers.envs.math import gold_answer

            return gold_answer(self.config.answers[question.strip()])  # GSM8K's "... #### 72" is 72
        match = _QUESTION.search(question)
        if not match:
            return None
        try:
            value = evaluate_arithmetic(match.group(1))
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
            return None
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _count_token(req: SimReq) -> None:
    """The scheduler produced a token of `req`: its engine handle counts it (weight-version spans)."""
    req.owner.produced = req.produced


def _rfind(haystack: list[int], needle: list[int]) -> int:
    """Index of the last occurrence of `needle` in `haystack`, or -1."""
    n = len(needle)
    first = needle[0]
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i] == first and haystack[i : i + n] == needle:
            return i
    return -1


def _last_question(context: str) -> tuple[str, str]:
    """(content of the last user turn that is not a tool response, the text after it)."""
    pos = len(context)
    while True:
        start = context.rfind("<|im_start|>user\n", 0, pos)
        if start < 0:
            return "", context
        body_start = start + len("<|im_start|>user\n")
        end = context.find("<|im_end|>", body_start)
        content = context[body_start : end if end >= 0 else len(context)]
        if not content.startswith("<tool_response>"):
            return content, context[body_start:]
        pos = start


def _offered_tools(context: str) -> list[dict[str, Any]]:
    start, end = context.find("<tools>\n"), context.find("\n</tools>")
    if start < 0 or end < start:
        return []
    tools = []
    for line in context[start + 8 : end].splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            tools.append(json.loads(line))
    return tools


_BOARD_ROW = re.compile(r"^(\d+) \|(.*)\|$")
_ACTION = re.compile(r"<action>\s*(.*?)\s*</action>", re.S)
# a move names the direction the tile next to the gap slides: (row, col) of that tile from the gap
_SLIDES = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}


def _puzzle_move(context: str) -> str:
    """The next move of a shortest solution of the sliding puzzle in `context`: its last drawn
    board (rows `1 | 1  2  3 |`, 0 = the gap), with every `<action>move</action>` written after
    the board applied; `view` when no board is drawn (or it is solved or unsolvable here)."""
    board: list[list[int]] = []
    end = pos = 0
    rows: list[str] = []
    for line in context.split("\n"):
        pos += len(line) + 1
        m = _BOARD_ROW.match(line)
        if m and int(m.group(1)) == len(rows) + 1:
            rows.append(m.group(2))
            parsed = _parse_board(rows)
            if parsed is not None:
                board, end = parsed, pos
        else:
            rows = [m.group(2)] if m and m.group(1) == "1" else []
    if not board:
        return "view"
    for action in _ACTION.findall(context[end:]):
        board = _slide(board, action.strip().lower()) or board
    size = len(board)
    goal = tuple(list(range(1, size * size)) + [0])
    start = tuple(v for row in board for v in row)
    seen, frontier = {start: ""}, [start]
    while frontier and goal not in seen and len(seen) < 200_000:
        nxt = []
        for state in frontier:
            grid = [list(state[r * size : (r + 1) * size]) for r in range(size)]
            for move in _SLIDES:
                after = _slide(grid, move)
                key = tuple(v for row in after for v in row) if after else None
                if key is not None and key not in seen:
                    seen[key] = seen[state] + " " + move if seen[state] else move
                    nxt.append(key)
        frontier = nxt
    path = seen.get(goal, "")
    return path.split()[0] if path else "view"


def _parse_board(rows: list[str]) -> list[list[int]] | None:
    """The rows drawn so far as a board when they make a whole one (each tile once, one gap)."""
    n = len(rows)
    if n < 2 or any(len(r) != len(rows[0]) for r in rows) or len(rows[0]) % n:
        return None
    width = len(rows[0]) // n
    cells = [r[c * width : (c + 1) * width].strip() for r in rows for c in range(n)]
    if not all(v == "" or v.isdigit() for v in cells):
        return None
    values = [int(v) if v else 0 for v in cells]
    if sorted(values) != list(range(n * n)):
        return None
    return [values[r * n : (r + 1) * n] for r in range(n)]


def _slide(board: list[list[int]], move: str) -> list[list[int]] | None:
    """The board after `move` (the tile beside the gap slides into it), None if it cannot."""
    if move not in _SLIDES:
        return None
    size = len(board)
    gr, gc = next((r, c) for r in range(size) for c in range(size) if board[r][c] == 0)
    tr, tc = gr + _SLIDES[move][0], gc + _SLIDES[move][1]
    if not (0 <= tr < size and 0 <= tc < size):
        return None
    after = [row[:] for row in board]
    after[gr][gc], after[tr][tc] = after[tr][tc], 0
    return after


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


def _value_error(message: str) -> web.Response:
    """How SGLang's HTTP server answers a ValueError from request handling (HTTP 400)."""
    return web.json_response({"error": {"message": message}}, status=400)


# ---------------------------------------------------------------- serving


# The in-process engine (the demo's, tests') stops as an SGLang process stopped by Ctrl-C does: its
# connections drop. aiohttp would first wait up to 60 s for handlers still running (whose clients,
# the demo's workers, are gone: its Ctrl-C took over a minute); this is that wait. It is no SGLang
# figure and no simulated time. `rollout engine` keeps aiohttp's drain on SIGTERM, as SGLang drains
# its requests then.
SHUTDOWN_GRACE_S = 2.0


@contextlib.asynccontextmanager
async def serve_sim_engine(config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[RunningSim]:
    """Serve the simulator in the current event loop; yields a handle with `.url` and `.engine`."""
    engine = SimEngine(config or SimConfig())
    runner = web.AppRunner(engine.app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    try:
        yield RunningSim(url=f"http://{host}:{bound}", engine=engine)
    finally:
        await runner.cleanup()


@dataclass
class RunningSim:
    url: str
    engine: SimEngine


def load_answers(tasks_path: str) -> dict[str, str]:
    """question text -> label from a tasks.jsonl, for tasks the simulator cannot solve itself."""
    from pipeline.schema import decode_task_json

    answers: dict[str, str] = {}
    with open(tasks_path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            task: Task = decode_task_json(line)
            if task.label is not None:
                prompt = task.prompt if isinstance(task.prompt, str) else str(task.prompt[-1].get("content", ""))
                answers[prompt.strip()] = task.label
    return answers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rollout engine",
        description="Serve the SIMULATED SGLang engine: SGLang's native endpoints (/generate token in, token out; "
                    "/health, /server_info, /update_weight_version, ...) with a scripted policy instead of a model. "
                    "For demos and tests, never for measuring model quality.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only; 0.0.0.0 to expose it)")
    p.add_argument("--port", type=int, default=30000, help="port to serve on (default %(default)s)")
    d = SimConfig()
    answers = p.add_argument_group("answers")
    answers.add_argument("--tasks", default="", help="tasks.jsonl (from `rollout prepare`) whose labels are the right "
                         "answers to its prompts; a GSM8K label '... #### 72' means 72. Without it only arithmetic "
                         "questions ('What is 6 * 7?') have a known answer")
    answers.add_argument("--accuracy", type=float, default=d.accuracy,
                         help="probability that a final answer is the right one, else a wrong number "
                              "(default %(default)s)")
    answers.add_argument("--tool-use", type=float, default=d.tool_use,
                         help="probability to call a tool first when the prompt offers tools (default %(default)s)")
    answers.add_argument("--malformed-rate", type=float, default=d.malformed_rate,
                         help="probability that a tool call is broken JSON (default %(default)s)")
    answers.add_argument("--puzzle", action="store_true",
                         help="play sliding-puzzle games instead of answering questions (NeMo-RL's SlidingPuzzleEnv, "
                              "`kind: nemo_rl` multi_turn): each turn is one move '<action>up</action>' of a shortest "
                              "solution of the last board drawn in the context, cut at the request's stop strings")
    answers.add_argument("--seed", type=int, default=d.seed,
                         help="seed of every turn's plan, with the routing key (default %(default)s)")
    length = p.add_argument_group("response length (lognormal filler tokens before the answer: the long tail)")
    length.add_argument("--length-mu", type=float, default=d.length_mu,
                        help="mu of the lognormal: median exp(mu) tokens (3.5: about 33) (default %(default)s)")
    length.add_argument("--length-sigma", type=float, default=d.length_sigma,
                        help="sigma of the lognormal: larger = longer tail (default %(default)s)")
    length.add_argument("--max-filler-tokens", type=int, default=d.max_filler_tokens,
                        help="cap on the filler (default %(default)s)")
    physics = p.add_argument_group(
        "physics: SGLang's scheduler loop in simulated time (workers/sim/scheduler.py), step times of a real model")
    physics.add_argument("--model", default=d.model,
                         help="the model it plays, with aiconfigurator's measured step times and KV size for it "
                              f"(tables: {', '.join(_table_models())}); default: none (see --token-latency-s)")
    physics.add_argument("--gpu", default=d.gpu, help="GPU of the step times: h100_sxm or h200_sxm (default %(default)s)")
    physics.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default %(default)s)")
    physics.add_argument("--time-scale", type=float, default=d.time_scale,
                         help="simulated seconds per real second: 10 runs the engine 10x faster than the GPU it plays "
                              "(state it beside every figure measured with it) (default %(default)s)")
    physics.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static,
                         help="SGLang's flag: fraction of GPU memory for weights + KV pool (0: SGLang's default for "
                              "the GPU) (default %(default)s)")
    physics.add_argument("--max-total-tokens", type=int, default=d.kv_pool_tokens,
                         help="KV pool size in tokens (0: from model, GPU and memory fraction; no model: 2097152) "
                              "(default %(default)s)")
    physics.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                         help="SGLang's flag: most prompt tokens prefilled in one step, -1 = no chunking "
                              "(default %(default)s)")
    physics.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                         help="SGLang's flag: prefill token budget of one step (default %(default)s)")
    physics.add_argument("--slots", type=int, default=d.slots,
                         help="SGLang's --max-running-requests: requests decoding at once, the rest queue; 0 = "
                              "SGLang's default from the KV pool (default %(default)s)")
    physics.add_argument("--max-running-requests", dest="slots", type=int, default=argparse.SUPPRESS,
                         help="SGLang's name for --slots")
    physics.add_argument("--weight-push-gbps", type=float, default=d.weight_push_gbps,
                         help="with --model: a weight update keeps the GPU busy model bytes / this many GB/s "
                              "(an assumed link speed, not measured); 0 = free (default %(default)s)")
    physics.add_argument("--token-latency-s", type=float, default=d.token_latency_s,
                         help="without --model: every decode step lasts this long, prefill is free (tests); "
                              "0 with no --model = instant answers, no capacity (default %(default)s)")
    physics.add_argument("--step-time-factor", type=float, default=d.step_time_factor,
                         help="every step of the model's table (or --token-latency-s) this many times as long: a "
                              "slower engine per token (default %(default)s)")
    physics.add_argument("--latency-sigma", type=float, default=0.0,
                         help="ignored: the old per-request lognormal speed is gone (every running request gains a "
                              "token per step); accepted so old command lines still start")
    speed = p.add_argument_group("queue and limits")
    speed.add_argument("--enable-priority-scheduling", action="store_true",
                       help="order the waiting queue by each request's `priority`, as SGLang's flag does, and "
                            "preempt running requests past --priority-scheduling-preemption-threshold")
    speed.add_argument("--schedule-low-priority-values-first", action="store_true",
                       help="with --enable-priority-scheduling: lower `priority` values first (SGLang's flag)")
    speed.add_argument("--priority-scheduling-preemption-threshold", type=int, default=d.priority_preemption_threshold,
                       help="SGLang's flag: a waiting request preempts running ones whose priority is worse by more "
                            "than this (default %(default)s)")
    speed.add_argument("--context-length", type=int, default=d.context_length,
                       help="context length in tokens (/server_info); longer requests get SGLang's 400 (default %(default)s)")
    speed.add_argument("--startup-s", type=float, default=d.startup_s,
                       help="answer /health with 503 (and refuse /generate) this long after start (default %(default)s)")
    model = p.add_argument_group("model")
    model.add_argument("--weight-version", default=d.weight_version,
                       help="initial weight version label (POST /update_weight_version changes it) (default %(default)s)")
    model.add_argument("--policy-path", default="",
                       help="a tiny causal LM checkpoint (workers/sim/tinylm.py, needs torch) that decides the tokens "
                            "instead of the scripted policy; POST /update_weights_from_disk replaces its weights")
    model.add_argument("--tokenizer", default="", help="tokenizer directory (default: the shared test tokenizer)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        accuracy=args.accuracy, tool_use=args.tool_use, malformed_rate=args.malformed_rate,
        length_mu=args.length_mu, length_sigma=args.length_sigma, max_filler_tokens=args.max_filler_tokens,
        model=args.model, gpu=args.gpu, tp=args.tp, time_scale=args.time_scale,
        mem_fraction_static=args.mem_fraction_static, kv_pool_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
        weight_push_gbps=args.weight_push_gbps, token_latency_s=args.token_latency_s, slots=args.slots,
        step_time_factor=args.step_time_factor,
        priority_scheduling=args.enable_priority_scheduling,
        priority_preemption_threshold=args.priority_scheduling_preemption_threshold,
        low_priority_values_first=args.schedule_low_priority_values_first,
        context_length=args.context_length, weight_version=args.weight_version, seed=args.seed,
        startup_s=args.startup_s, puzzle=args.puzzle, policy_path=args.policy_path,
        tokenizer_path=args.tokenizer, answers=load_answers(args.tasks) if args.tasks else {},
    )


def _table_models() -> list[str]:
    from workers.sim.physics import available_tables

    return sorted({name.split("--h")[0].replace("--", "/") for name in available_tables()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        engine = SimEngine(config_from_args(args))
    except ValueError as exc:  # an unknown model/GPU, a model that does not fit: a usage error
        print(f"rollout engine: {exc}", file=sys.stderr)
        return 2
    plays = (f"{args.model} on {args.gpu} x tp {args.tp}, KV pool {engine.scheduler.config.kv_pool_tokens} tokens"
             if engine.table and engine.scheduler else "no model")
    print(f"simulated SGLang engine on http://{args.host}:{args.port} ({plays}, time scale {args.time_scale}; "
          f"tokenizer {engine.tokenizer_path})", flush=True)
    web.run_app(engine.app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
