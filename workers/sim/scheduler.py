"""The simulated engine's scheduler: SGLang 0.5.23's `Scheduler.event_loop_normal` in simulated
time, one step loop per engine. Each step is a prefill batch or a decode batch (SGLang's default,
no mixed chunks), and lasts what the step model says (workers/sim/physics.py).

Rules, each from the SGLang function named (tests/workers/test_sim_scheduler.py pins them; tests/conformance/test_sim_sglang_rules.py
runs the same sequences through SGLang's own code):
- Admission, `PrefillAdder.add_one_req` / `_select_prefill_admission` (managers/schedule_policy.py),
  called from `Scheduler._get_new_batch_prefill_raw` (managers/scheduler.py) in the queue's order:
  a request needs its uncached input + min(max_new_tokens, CLIP_MAX_NEW_TOKENS) + one page below
  the pool's free + evictable tokens less the running requests' expected growth (their remaining
  max_new_tokens x new_token_ratio, `_get_running_request_total_token_offset`); the pass stops at
  the first that does not fit (NO_TOKEN), when `--chunked-prefill-size` or `max_prefill_tokens`
  is spent (OTHER), or at `--max-running-requests`. A request longer than the chunk budget left
  is chunked (`is_chunked`, reserving no output) and continues first in the next pass
  (`add_chunked_req`).
- Queue order, `SchedulePolicy.calc_priority`: FCFS, or with `--enable-priority-scheduling`
  `_sort_by_priority_and_fcfs` (priority x sign, then the time it entered the queue; a request
  without priority gets the least preferred value, `_set_or_validate_priority`).
- Priority preemption, `PrefillAdder.preempt_to_schedule`: when the running batch is at
  max-running-requests, running requests whose priority is worse than the waiting one's by more
  than `--priority-scheduling-preemption-threshold` (10) are released, worst first, until the
  waiting one fits; they go back to the queue and re-prefill later.
- Prefix cache, `RadixCache` (workers/sim/radix.py): a request prefills only its uncached part
  (`meta_info.cached_tokens`); its input is cached when its prefill ends (`cache_unfinished_req`),
  input + output when it ends (`cache_finished_req`); flushed on a weight update (`WeightUpdater.flush_cache_after_weight_update` -> `Scheduler.flush_cache`,
  refused while requests hold cached nodes, as SGLang refuses it when not idle).
- Decode retraction, `ScheduleBatch.retract_decode` / `check_decode_mem` (managers/schedule_batch.py):
  the check evicts the cache's shortfall and compares the free tokens with one per request; when
  they do not fit, requests are retracted, fewest output tokens first (longest input breaking
  ties), at least one, never the last, until they fit, the batch keeping that order; each
  `release_req` evicts until 20 tokens per request still running are free. They keep their
  output and re-prefill input + output later. new_token_ratio as `NewTokenRatioTracker`: 0.7,
  decaying to 0.098 over 600 decode steps, reset to the retraction estimate.
- KV in use (`kv_used`) as SGLang's token usage (`_get_token_info`): the pool less free and
  evictable tokens.
- Pause (`Scheduler.pause_generation`): `in_place` stops stepping and keeps everything; `retract`
  releases every running request's KV, then the chunked one's (`retract_all`), and they queue
  again in that order to re-prefill after continue.

Simulated time runs at `time_scale` x real time. The loop sleeps only when it is more than
`_SLACK_S` of real time ahead, so thousands of short steps cost no timer wake-ups each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from workers.sim.physics import StepModel
from workers.sim.radix import RadixCache

CLIP_MAX_NEW_TOKENS = 4096  # schedule_policy.py (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)
INIT_NEW_TOKEN_RATIO = 0.7  # environ.py SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
PAGE = 1  # --page-size 1: the per-request page overhead PrefillAdder reserves
_SLACK_S = 0.004


@dataclass
class SchedulerConfig:
    kv_pool_tokens: int  # max_total_num_tokens
    max_running_requests: int
    chunked_prefill_size: int = 8192  # -1: no chunking
    max_prefill_tokens: int = 16384  # --max-prefill-tokens
    priority_scheduling: bool = False
    low_priority_values_first: bool = False
    preemption_threshold: int = 10  # --priority-scheduling-preemption-threshold
    time_scale: float = 1.0  # simulated seconds per real second


@dataclass(eq=False)
class SimReq:
    """One request in the scheduler: its input, the output it will produce, and where it is."""

    rid: str
    input_ids: list[int]
    # everything it will produce (the simulator knows its plan); the ids past `produced` may be
    # re-drawn, longer or shorter, while no step runs (the tiny policy after a weight load,
    # workers/sim/core.py): its length is read at every step, never kept
    output_ids: list[int]
    max_new_tokens: int  # what it asked for (the admission budget, what KV reservations use), >= len(output_ids)
    priority: int | None = None
    produced: int = 0
    cached_tokens: int = 0  # prefix-cache hit at its first admission (meta_info.cached_tokens)
    aborted: bool = False
    retractions: int = 0
    # scheduler state
    entry: int = 0  # order it entered the waiting queue (wait_queue_entry_time)
    filled: int = 0  # tokens of `fill` whose KV exists (prefix + prefilled chunks)
    prefix: int = 0  # cached tokens matched at admission
    private: int = 0  # KV tokens it holds outside the tree
    node: Any = None  # the locked radix node
    owner: Any = None  # the caller's handle (the engine's RunningRequest), for `on_token`
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def fill(self) -> list[int]:
        """What a prefill of it computes: the input and what it produced (after a retraction)."""
        return self.input_ids + self.output_ids[: self.produced] if self.produced else self.input_ids

    @property
    def target(self) -> int:
        return len(self.output_ids)


class BatchScheduler:
    """One engine's step loop. `submit` a request and await its `done`; `stats` counts steps."""

    def __init__(self, config: SchedulerConfig, steps: StepModel, resumed: asyncio.Event,
                 on_token: Callable[[SimReq], None] | None = None):
        self.config = config
        self.steps = steps
        self.resumed = resumed  # cleared while paused in place: no step runs
        self.on_token = on_token
        self.cache = RadixCache()
        self.waiting: list[SimReq] = []
        self.running: list[SimReq] = []
        self.chunked: SimReq | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.sim_now = 0.0
        self._entries = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._anchor: tuple[float, float] | None = None  # (real, simulated) time the clock last synced
        self._hold_until = 0.0  # simulated time a weight push keeps the GPU busy until
        self._frozen = 0  # `frozen()` depth: no step runs while > 0
        self.stats: dict[str, float] = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "prefill_tokens": 0,
                                        "cached_tokens": 0, "retractions": 0, "preemptions": 0,
                                        "busy_s": 0.0, "prefill_busy_s": 0.0, "decode_busy_s": 0.0, "max_kv_used": 0, "kv_used_token_s": 0.0,
                                        # the most the real clock fell behind the simulated one while
                                        # busy, in simulated seconds: ~0 when the machine kept the scale
                                        "max_behind_sim_s": 0.0}

    # ------------------------------------------------------------ interface

    def submit(self, req: SimReq) -> None:
        """Queue `req` and make sure the step loop runs (in the running event loop)."""
        self.add(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def add(self, req: SimReq) -> None:
        """Queue `req` (tests drive `step()` themselves)."""
        self._enqueue(req)
        self._wake.set()

    def abort(self, req: SimReq) -> None:
        """Leaves now: this runs between two steps (the loop is awaiting), where SGLang's scheduler
        handles an AbortReq (a waiting request leaves the queue, a running one the batch, with
        what it produced; its KV is cached as at a finish)."""
        req.aborted = True
        if req in self.waiting:
            self.waiting.remove(req)
            req.done.set()
        elif req is self.chunked:
            self.chunked = None
            self._finish(req)
        elif req in self.running:
            self.running.remove(req)
            self._finish(req)
        self._wake.set()

    @property
    def kv_used(self) -> int:
        """KV tokens in use as SGLang counts them (`SchedulerPoolStatsObserver._get_token_info`:
        the pool less what is free and what the radix cache could evict): the running requests'
        KV and the cached prefixes they lock; unlocked cached prefixes are not "used"."""
        return self.cache.protected_size + sum(r.private for r in self._holders())

    @property
    def kv_free(self) -> int:
        """The allocator's free tokens (`available_size`): the pool less everything held, evictable too."""
        return self.config.kv_pool_tokens - self.kv_used - self.cache.evictable_size

    def retract_all(self) -> None:
        """`Scheduler.pause_generation(mode="retract")`: `retract_all` releases the running batch,
        then the unfinished chunked request (`release_req` each, in that order); they queue again
        in that order."""
        reqs = self._holders()
        for i, req in enumerate(reqs):
            self._retract_one(req, remaining=len(reqs) - i)
            self._enqueue(req)
        self.running, self.chunked = [], None

    def flush_cache(self) -> bool:
        """SGLang's flush_cache: only when no request holds the cache (else refused, False)."""
        if self.running or self.chunked or self.cache.protected_size:
            return False
        self.cache.reset()
        return True

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """No step runs inside (aborts still leave): SGLang's scheduler loads weights inside its
        own loop, between two batches, so no token is stepped while the engine swaps the weights
        and re-draws what its requests have not emitted yet. The clock stops, as in a pause (the
        push's GPU time is `hold`'s)."""
        self._frozen += 1
        try:
            yield
        finally:
            self._frozen -= 1
            self._wake.set()

    def hold(self, seconds: float) -> None:
        """The GPU is busy `seconds` of simulated time from now (a weight push): no step runs."""
        self._sync_clock()
        self._hold_until = max(self._hold_until, self.sim_now) + seconds

    # ------------------------------------------------------------ loop

    async def _loop(self) -> None:
        self._sync_clock()
        while True:
            self._drop_aborted()
            if not (self.waiting or self.running or self.chunked):
                self._anchor = None
                self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # an idle batch resets it
                self._wake.clear()
                await self._wake.wait()
                self._sync_clock()
                continue
            if self._frozen or not self.resumed.is_set():  # paused in place or frozen: only aborts, continue, thaw move it
                self._anchor = None
                self._wake.clear()
                waits = {asyncio.ensure_future(self._wake.wait())}
                if not self._frozen:
                    waits.add(asyncio.ensure_future(self.resumed.wait()))
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                self._sync_clock()
                continue
            if self._hold_until > self.sim_now:
                await self._advance(self._hold_until - self.sim_now)
                continue
            duration = self.step()
            if duration is None:  # nothing fits and nothing runs: wait for a change
                self._wake.clear()
                await self._wake.wait()
                self._sync_clock()
                continue
            await self._advance(duration)

    def _sync_clock(self) -> None:
        now = time.monotonic()
        if self._anchor is None:
            self._anchor = (now, self.sim_now)
            return
        real0, sim0 = self._anchor
        self.sim_now = max(self.sim_now, sim0 + (now - real0) * self.config.time_scale)

    async def _advance(self, duration: float) -> None:
        """Simulated time moves on by `duration`; sleep when real time is behind by more than the slack."""
        used = self.kv_used
        self.stats["kv_used_token_s"] += used * duration
        self.stats["max_kv_used"] = max(self.stats["max_kv_used"], used)
        self.sim_now += duration
        if self._anchor is None:
            self._anchor = (time.monotonic(), self.sim_now - duration)
        real0, sim0 = self._anchor
        ahead = real0 + (self.sim_now - sim0) / self.config.time_scale - time.monotonic()
        if ahead < 0:
            self.stats["max_behind_sim_s"] = max(self.stats["max_behind_sim_s"], -ahead * self.config.time_scale)
        if ahead > _SLACK_S:
            await asyncio.sleep(ahead)
        elif self.stats["steps"] % 64 == 0:
            await asyncio.sleep(0)  # let arrivals and aborts in

    def step(self) -> float | None:
        """One iteration of event_loop_normal: a prefill batch if one can be formed, else a decode."""
        self.stats["steps"] += 1
        batch = self._admit()
        duration = self._run_prefill(batch) if batch else self._run_decode() if self.running else None
        if duration is not None:
            self.stats["busy_s"] += duration
        return duration

    def decode_many(self, most: int, within_s: float = float("inf")) -> tuple[int, float] | None:
        """Up to `most` decode steps at once, those that start within `within_s` simulated
        seconds (an event the caller knows of comes then), where `step()` would run exactly
        these: nothing waits and nothing is chunked (no admission pass can add a request), no
        request finishes before the last of them (it finishes through `step()`), and the pool
        holds their tokens (the cache's shortfall evicted at once, not step by step). `on_token`
        hears once per request. For schedule simulations that are not played in real time
        (scripts/bench/ideal.py): returns (steps, simulated seconds), or None where the next
        step must go through `step()`."""
        batch = self.running
        if self.waiting or self.chunked is not None or not batch:
            return None
        count = min(most, min(r.target - r.produced for r in batch) - 1)
        if count < 2:
            return None
        kv = sum(len(r.input_ids) + r.produced for r in batch)
        duration, taken = 0.0, 0
        while taken < count and duration < within_s:
            duration += self.steps.decode_s(len(batch), kv + taken * len(batch))
            taken += 1
        count = taken
        self._make_room(count * len(batch))
        if count * len(batch) > self.kv_free:
            return None
        self.new_token_ratio = max(self.new_token_ratio - count * NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        for req in batch:
            req.produced += count
            req.private += count
            if self.on_token is not None:
                self.on_token(req)
        for key, value in (("steps", count), ("decode_steps", count), ("busy_s", duration), ("decode_busy_s", duration)):
            self.stats[key] += value
        return count, duration

    # ------------------------------------------------------------ prefill

    def _admit(self) -> list[tuple[SimReq, int]]:
        """PrefillAdder over the waiting queue: [(request, tokens it prefills this step)]."""
        c = self.config
        budget = _Budget(self, sum(self._growth(r) for r in self.running))
        rem_input = c.max_prefill_tokens
        rem_chunk: int | None = c.chunked_prefill_size if c.chunked_prefill_size > 0 else None
        batch: list[tuple[SimReq, int]] = []
        if self.chunked is not None:  # add_chunked_req: the unfinished chunk goes first
            req = self.chunked
            left = len(req.fill) - req.filled
            take = left if rem_chunk is None else min(left, _available_chunk(budget, rem_chunk))
            batch.append((req, take))
            budget.reserve(take, 0 if take < left else self._max_new(req))
            rem_input -= take
            rem_chunk = None if rem_chunk is None else rem_chunk - take
        for req in self._queue_order():
            if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                break  # budget_state: OTHER
            if len(self.running) + len(batch) >= c.max_running_requests:
                if not (c.priority_scheduling and self._preempt_for(req, budget)):
                    break
            fill = req.fill
            prefix, node = self.cache.match_prefix(fill[:-1])  # at least one token is computed
            extend = len(fill) - prefix
            max_new = self._max_new(req)
            self.cache.lock(node)  # _lock_node: its own prefix is no evictable room
            if not extend + max_new + PAGE < budget.remaining_total \
                    or (rem_chunk is None and batch and extend >= rem_input):
                self.cache.unlock(node)
                break  # NO_TOKEN (PrefillBudget.check_prefill); OTHER: unchunked, only the first may exceed
            take = extend
            if rem_chunk is not None and extend > rem_chunk:
                take, max_new = rem_chunk, 0  # chunked: no output reserved yet
            self.waiting.remove(req)
            req.prefix, req.filled, req.node = prefix, prefix, node
            if req.retractions == 0 and req.produced == 0:
                req.cached_tokens = prefix
            self.stats["cached_tokens"] += prefix
            batch.append((req, take))
            budget.reserve(take, max_new)
            rem_input -= take
            rem_chunk = None if rem_chunk is None else rem_chunk - take
            if take < extend or not budget.has_capacity():
                break  # one chunked request per pass; budget_state NO_TOKEN
        return batch

    def _run_prefill(self, batch: list[tuple[SimReq, int]]) -> float:
        tokens = sum(t for _, t in batch)
        seqs = [(take, r.filled) for r, take in batch]  # each sequence's new tokens over its cached KV
        self._make_room(tokens)
        self.chunked = None
        for req, take in batch:
            req.private += take
            req.filled += take
            if req.filled < len(req.fill):
                self.chunked = req
                continue
            self._cache_prompt(req)
            if req.produced < req.target:  # the prefill's forward pass samples the first token
                self._produce(req)
            if req.produced >= req.target:
                self._finish(req)
            else:
                self.running.append(req)
        duration = self.steps.prefill_s(seqs)
        self.stats["prefill_steps"] += 1
        self.stats["prefill_tokens"] += tokens
        self.stats["prefill_busy_s"] += duration
        return duration

    def _cache_prompt(self, req: SimReq) -> None:
        """cache_unfinished_req: the prefilled tokens enter the tree, the request locks them."""
        fill = req.fill
        already = self.cache.insert(fill)
        req.private -= len(fill) - req.prefix  # now in the tree, or a duplicate freed
        _n, node = self.cache.match_prefix(fill)
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node
        del already

    # ------------------------------------------------------------ decode

    def _run_decode(self) -> float:
        if not self._decode_fits(self.running):
            self._retract()
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        batch = self.running
        kv = sum(len(r.input_ids) + r.produced for r in batch)
        self._make_room(len(batch))
        for req in batch:
            self._produce(req)
            req.private += 1
        self.running = [r for r in batch if r.produced < r.target]
        for req in batch:
            if req.produced >= req.target:
                self._finish(req)
        duration = self.steps.decode_s(len(batch), kv)
        self.stats["decode_steps"] += 1
        self.stats["decode_busy_s"] += duration
        return duration

    def _decode_fits(self, reqs: list[SimReq]) -> bool:
        """check_decode_mem (page size 1: one token per request), through the allocator's
        `check_decode_capacity`: evict the shortfall from the cache, then compare the free tokens."""
        self._make_room(len(reqs))
        return len(reqs) <= self.kv_free

    def _retract(self) -> None:
        """retract_decode: fewest output tokens first (longest input breaks ties), at least one,
        never the last, until the next step fits."""
        order = sorted(self.running, key=lambda r: (r.produced, -len(r.input_ids)), reverse=True)
        retracted: list[SimReq] = []
        while order and len(order) > 1 and (not retracted or not self._decode_fits(order)):
            req = order.pop()
            self._retract_one(req, remaining=len(order))
            retracted.append(req)
        self.running = order  # filter_batch(keep_indices=sorted_indices): the batch keeps the retraction order
        decoded = sum(r.produced for r in self.running)
        asked = sum(r.max_new_tokens for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (asked + 1))
        for req in retracted:
            req.retractions += 1
            self.stats["retractions"] += 1
            self._enqueue(req)

    # ------------------------------------------------------------ priority

    def _sign(self) -> int:
        return 1 if self.config.low_priority_values_first else -1

    def _priority(self, req: SimReq) -> int:
        if req.priority is not None:
            return req.priority
        return sys.maxsize if self.config.low_priority_values_first else -sys.maxsize - 1

    def _queue_order(self) -> list[SimReq]:
        if not self.config.priority_scheduling:
            return sorted(self.waiting, key=lambda r: r.entry)
        sign = self._sign()
        return sorted(self.waiting, key=lambda r: (self._priority(r) * sign, r.entry))

    def _preempt_for(self, req: SimReq, budget: _Budget) -> bool:
        """preempt_to_schedule: release running requests worse than `req` by more than the
        threshold, worst (then latest) first, until its input + output fit."""
        sign = self._sign()
        candidates = sorted(self.running, key=lambda r: (self._priority(r) * -sign, -r.entry))
        need = len(req.fill) - req.filled + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS) - budget.remaining_total
        chosen: list[SimReq] = []
        for running in candidates:
            if (self._priority(req) - self._priority(running)) * -sign <= self.config.preemption_threshold:
                break
            chosen.append(running)
            need -= self._growth(running)
            if need <= 0:
                break
        if not chosen or need > 0:
            return False
        released = 0
        for running in [r for r in self.running if r in chosen]:  # released in batch order
            released += 1
            budget.total_offset -= self._growth(running)
            self._retract_one(running, remaining=len(self.running) - released)
            running.retractions += 1
            self.stats["preemptions"] += 1
        self.running = [r for r in self.running if r not in chosen]
        for running in chosen:
            self._enqueue(running)
        return True

    # ------------------------------------------------------------ bookkeeping

    def _max_new(self, req: SimReq) -> int:
        return min(max(req.max_new_tokens - req.produced, 0), CLIP_MAX_NEW_TOKENS)

    def _growth(self, req: SimReq) -> float:
        """_get_running_request_total_token_offset: what a running request may still add."""
        return min(req.max_new_tokens - req.produced, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def _holders(self) -> list[SimReq]:
        return [*self.running, *([self.chunked] if self.chunked else [])]

    def _enqueue(self, req: SimReq) -> None:
        req.entry = next(self._entries)
        req.filled = req.prefix = 0
        self.waiting.append(req)

    def _produce(self, req: SimReq) -> None:
        req.produced += 1
        if self.on_token is not None:
            self.on_token(req)

    def _make_room(self, tokens: int) -> None:
        short = tokens - self.kv_free
        if short > 0:
            self.cache.evict(short)

    def _release(self, req: SimReq, *, cache_it: bool) -> None:
        """Free a request's KV; with `cache_it` its input + output enter the tree (cache_finished_req)."""
        if req.node is None:
            return
        if cache_it and req.filled >= len(req.input_ids):  # the last token has no KV yet (kv_committed_len)
            self.cache.insert(req.input_ids + req.output_ids[: max(req.produced - 1, 0)])
        self.cache.unlock(req.node)
        req.node, req.private, req.filled = None, 0, 0

    def _retract_one(self, req: SimReq, remaining: int) -> None:
        """schedule_batch.release_req: the request's KV freed (nothing cached), then the cache
        evicted until `remaining` requests x SGLANG_RETRACT_DECODE_STEPS tokens are free."""
        self._release(req, cache_it=False)
        self._make_room(remaining * RETRACT_DECODE_STEPS)

    def _finish(self, req: SimReq) -> None:
        self._release(req, cache_it=True)
        req.done.set()

    def _drop_aborted(self) -> None:
        if not any(r.aborted for r in [*self.waiting, *self._holders()]):
            return
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            req.done.set()
        if self.chunked is not None and self.chunked.aborted:
            self._finish(self.chunked)
            self.chunked = None
        gone = [r for r in self.running if r.aborted]
        self.running = [r for r in self.running if not r.aborted]
        for req in gone:
            self._finish(req)


class _Budget:
    """PrefillBudget (mem_cache/prefill_budget.py) for one pass: the pool's free + evictable tokens
    less what is promised (running requests' growth, this pass's admissions), read live, so a
    prefix locked or a request preempted during the pass counts at once."""

    def __init__(self, sch: BatchScheduler, running_offset: float):
        self.sch = sch
        self.total_offset = running_offset
        self.current_offset = 0.0

    def _available_and_evictable(self) -> int:
        return self.sch.kv_free + self.sch.cache.evictable_size

    @property
    def remaining_total(self) -> float:
        return self._available_and_evictable() - self.total_offset

    @property
    def remaining_current(self) -> float:
        return self._available_and_evictable() - self.current_offset

    def has_capacity(self) -> bool:
        return self.remaining_total > 0 and self.remaining_current > 0

    def reserve(self, extend: int, max_new: int) -> None:
        self.total_offset += extend + PAGE + max_new
        self.current_offset += extend + PAGE


def _available_chunk(budget: _Budget, chunk_limit: int) -> int:
    """PrefillBudget.available_chunk_tokens: the chunk budget, cut to the pool's room if any."""
    available = min(chunk_limit, int(budget.remaining_total))
    return available if available > 0 else chunk_limit
