"""The simulated engine's core: the requests it holds, the time they take, what a pause, an abort
or a weight update does to them. No HTTP here: the fronts (workers/sim/http_front.py, SGLang's
native routes; workers/sim/sglang_front.py, SGLang's own front on its ZMQ sockets) parse
requests and hand them to `SimEngine.run`.

Time: the scheduler's step loop (workers/sim/scheduler.py, SGLang's event_loop_normal in
simulated time: admission by KV pool and chunked-prefill budget, max running requests, FCFS or
priority with preemption, decode retraction, a radix prefix cache) with a named model's measured
step times on a named GPU (`model`/`gpu`/`tp`, workers/sim/physics.py), or without a model a flat
`token_latency_s` per decode step, or none at all (instant answers, unit tests). Every running
request gains one token per step; there is no per-request speed.

Tokens: one `Policy` (workers/sim/policy.py) draws each request's answer, the scripted one or,
with `policy_path`, the tiny LM; the engine emits it through the step loop and never asks which
policy it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from workers.sim.config import SimConfig, engine_physics, weight_push_s
from workers.sim.policy import Draft, Policy
from workers.sim.scheduler import BatchScheduler, SimReq
from workers.sim.scripted import ScriptedPolicy
from workers.sim.tinylm import TinyLMPolicy


@dataclass
class RunningRequest:
    """A request the engine holds, from its arrival until its answer (SGLang's rid_to_state)."""

    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    message: str = ""
    produced: int = 0
    priority: int | None = None  # the `priority` it is scheduled by
    cached_tokens: int = 0  # prefix-cache hit (meta_info.cached_tokens)
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (old label, tokens so far) per update
    draft: Draft | None = None  # its answer as the policy drew it, once drawn (a weight load may re-draw its tail)


class SimEngine:
    def __init__(self, config: SimConfig):
        from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

        self.config = config
        self.tokenizer_path = config.tokenizer_path or default_tokenizer_path()
        self.tokenizer = load_test_tokenizer(self.tokenizer_path)
        self.eos_id: int = self.tokenizer.eos_token_id
        self.weight_version = config.weight_version
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.scheduler: BatchScheduler | None = None
        self._apply_config()
        self.policy: Policy
        self._loading = asyncio.Lock()  # one weight load at a time (SGLang's scheduler runs them in turn)
        self.set_policy(config.policy_path)
        self._paused_in_place = False  # in_place/retract: running requests wait instead of aborting
        self._started_at = time.monotonic()
        self._running: dict[str, RunningRequest] = {}
        self._faults: list[tuple[int, str]] = []  # (HTTP status, message) the next requests fail with
        self.stats: dict[str, Any] = {"requests": 0, "aborted": 0, "max_running": 0, "routing_keys": {}, "errors": 0,
                                      "output_tokens": 0,  # every token answered, aborted partial outputs included
                                      # the plan's full response length per routing key, at its first
                                      # fresh turn (benchmarks compare trained lengths with it)
                                      "planned": {},
                                      # input tokens of requests resuming a turn (an abort's re-prefill)
                                      "resumed_requests": 0, "resumed_input_tokens": 0,
                                      "priorities": {}}  # rid -> the `priority` it was scheduled by

    # ------------------------------------------------------------ configuration

    def _apply_config(self) -> None:
        """(Re)build the physics from `self.config`: the step model, the KV pool, the scheduler's
        limits. A scheduler already running keeps its queue, batch and cache."""
        physics = engine_physics(self.config)
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

    def set_policy(self, path: str) -> None:
        """Serve the tiny LM checkpoint at `path` (workers/sim/tinylm.py), or the scripted policy ("")."""
        self.config = dataclasses.replace(self.config, policy_path=path)
        self.policy = (TinyLMPolicy(path, self.tokenizer, seed=self.config.seed) if path
                       else ScriptedPolicy(self.tokenizer))

    def starting(self) -> bool:
        """Within `startup_s` of the start: /health answers 503 and /generate is refused."""
        return time.monotonic() - self._started_at < self.config.startup_s

    # ------------------------------------------------------------ requests held

    def track(self, rids: list[str]) -> list[RunningRequest]:
        """Hold `rids` from now until their answer (`release`), as SGLang's rid_to_state."""
        held = [RunningRequest(rid) for rid in rids]
        self._running.update((running.rid, running) for running in held)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        return held

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self._running.pop(rid, None)

    def held(self, rid: str) -> RunningRequest | None:
        return self._running.get(rid)

    def held_count(self) -> int:
        return len(self._running)

    async def until_resumed(self) -> None:
        """Returns once generation is not paused (at once when it is not)."""
        await self._resumed.wait()

    def take_fault(self) -> tuple[int, str] | None:
        """The (status, message) the next request fails with (`queue_faults`), if any."""
        return self._faults.pop(0) if self._faults else None

    def queue_faults(self, status: int, message: str, count: int) -> int:
        """The next `count` requests fail with HTTP `status`; returns how many are queued."""
        self._faults += [(status, message)] * count
        return len(self._faults)

    def abort(self, rid: str, message: str) -> None:
        running = self._running.get(rid)
        if running is not None:
            running.message = message
            running.aborted.set()

    def abort_all(self, message: str) -> None:
        for running in self._running.values():
            running.message = message
            running.aborted.set()

    def pause(self, mode: str) -> None:
        """abort (SGLang's default): abort running requests; in_place / retract: they stay and
        wait. New requests wait until `resume` in every mode."""
        self._resumed.clear()
        self._paused_in_place = mode != "abort"
        if mode == "abort":
            self.abort_all("Abort for pause generation")
        elif mode == "retract" and self.scheduler is not None:
            self.scheduler.retract_all()  # their KV is freed: they re-prefill after continue

    def resume(self) -> None:
        self._paused_in_place = False
        self._resumed.set()

    # ------------------------------------------------------------ weights

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
        refusal = self.policy.weights_refusal()
        if refusal is not None:
            return False, refusal, True
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
        """The policy re-draws, in one batch, the rest of every request in flight that no abort
        ended. As SGLang decodes after `/update_weights_from_disk` under an `in_place` / `retract`
        pause, up to the KV: SGLang's `in_place` keeps the prefix's KV the old weights computed,
        where the tiny model recomputes the whole prefix on the new weights (`retract`
        recomputes it in SGLang too)."""
        in_flight = [(running.draft, running.produced) for running in self._running.values()
                     if running.draft is not None and not running.aborted.is_set()
                     and running.produced < len(running.draft.ids)]
        redrawn = await self.policy.redraw(in_flight) if in_flight else 0
        if redrawn:
            self.stats["redrawn_requests"] = self.stats.get("redrawn_requests", 0) + redrawn

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

    # ------------------------------------------------------------ counters

    def stats_report(self) -> dict[str, Any]:
        """GET /sim/stats: the engine's counters, the step loop's, the weight version, the requests held."""
        return {**self.stats, **self.physics_stats(), "weight_version": self.weight_version,
                "running": self.held_count()}

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

    # ------------------------------------------------------------ running a request

    def note_priority(self, rid: str, priority: int | None) -> None:
        """The `priority` `rid` is scheduled by."""
        if priority is not None:
            self.stats["priorities"][rid] = priority
        running = self._running.get(rid)
        if running is not None:
            running.priority = priority

    async def run(
        self, running: RunningRequest, input_ids: list[int], routing_key: str, params: dict[str, Any]
    ) -> tuple[list[int], list[float], dict[str, Any], list[dict[str, Any]]]:
        """The request's answer: (ids, log-probs, finish_reason, weight-version spans). The policy
        draws it, the step loop times it, an abort cuts it where the scheduler was."""
        draft = running.draft = await self.policy.draft(input_ids, routing_key, params, self.config)
        if draft.resumed:
            self.stats["resumed_requests"] += 1
            self.stats["resumed_input_tokens"] += len(input_ids)
        elif draft.planned is not None:
            self.stats["planned"].setdefault(routing_key, draft.planned)
        produced = await self._emit(running, input_ids, draft.ids, draft.max_new_tokens)
        finish = draft.finish  # read after the emit: a weight load may have re-drawn the draft's tail
        if produced < len(draft.ids):
            self.stats["aborted"] += 1
            finish = {"type": "abort", "message": running.message}
        return draft.ids[:produced], draft.log_probs[:produced], finish, self._spans(running, produced)

    def _spans(self, running: RunningRequest, produced: int) -> list[dict[str, Any]]:
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

    async def _emit(self, running: RunningRequest, input_ids: list[int], ids: list[int], max_new: int | None) -> int:
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


def _count_token(req: SimReq) -> None:
    """The scheduler produced a token of `req`: its engine handle counts it (weight-version spans)."""
    req.owner.produced = req.produced
