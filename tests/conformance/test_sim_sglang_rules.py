"""The simulated scheduler's rules checked against SGLang 0.5.23's own code, run on CPU: the same
request sequences go through SGLang's functions and through workers/sim/scheduler.py and
workers/sim/radix.py, and their decisions must be the same.

- queue order: `SchedulePolicy._sort_by_priority_and_fcfs` (managers/schedule_policy.py);
- the decode step's memory check and retraction: `ScheduleBatch.check_decode_mem` and
  `retract_decode` (managers/schedule_batch.py, --retraction-policy length) over SGLang's
  `RadixCache`, with its `release_req` and `NewTokenRatioTracker`;
- priority preemption: `PrefillAdder.preempt_to_schedule` (managers/schedule_policy.py): which
  running requests it releases, and whether the waiting one may then be scheduled;
- admission and chunking: `PrefillAdder.add_one_req` with SGLang's `PrefillBudget`
  (mem_cache/prefill_budget.py) in `Scheduler._get_new_batch_prefill_raw`'s loop, with and
  without cached prefixes in SGLang's `RadixCache`; chunk continuation over passes
  (`add_chunked_req`);
- the radix cache: `RadixCache` insert / match / lock / evict (mem_cache/radix_cache.py);
- pause: `Scheduler.pause_generation(retract)`; the other modes pinned against the source.

SGLang's side runs in a subprocess (`python tests/conformance/test_sim_sglang_rules.py probe`): it publishes
process-wide server args, which must stay out of the test process (tests/support/engine_stack.py says why).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workers.sim.physics import FlatSteps
from workers.sim.radix import RadixCache
from workers.sim.scheduler import BatchScheduler, SchedulerConfig, SimReq

pytestmark = pytest.mark.conformance
REPO = Path(__file__).resolve().parents[2]


def _cases(seed: int = 31) -> dict[str, list[Any]]:
    rng = random.Random(seed)
    choices = [None, -3, 0, 1, 5, 7, 10, 11, 12, 25, 50, 100]
    sort = [{"priorities": [rng.choice(choices) for _ in range(rng.randint(1, 9))], "low_first": low}
            for low in (False, True) for _ in range(40)]
    preempt = []
    for low in (False, True):
        for _ in range(60):
            running = []
            for _ in range(rng.randint(1, 6)):
                max_new = rng.randint(1, 60)
                running.append({"priority": rng.choice(choices[1:]), "max_new": max_new, "out": rng.randint(0, max_new)})
            preempt.append({"running": running, "low_first": low, "threshold": rng.choice([0, 5, 10]),
                            "new": {"priority": rng.choice(choices[1:]), "input": rng.randint(1, 40),
                                    "max_new": rng.randint(1, 60)},
                            "rem_total": rng.randint(-50, 80), "ratio": rng.choice([0.7, 0.3, 1.0])})
    admit = []
    for _ in range(150):
        running = []
        for _ in range(rng.randint(0, 4)):
            max_new = rng.randint(1, 500)
            running.append({"max_new": max_new, "out": rng.randint(0, max_new)})
        admit.append({"free": rng.randint(50, 3000), "running": running, "chunk": rng.choice([-1, 64, 256, 1024]),
                      "max_prefill": rng.choice([128, 1024, 16384]), "max_running": rng.randint(2, 8),
                      "ratio": rng.choice([0.7, 0.3, 0.098]),
                      "waiting": [{"input": rng.randint(1, 700), "max_new": rng.randint(1, 600)}
                                  for _ in range(rng.randint(1, 6))]})
    for free in (100, 101, 102):  # the budget's edge: 50 input + 50 output + 1 page against `free`
        admit.append({"free": free, "running": [], "chunk": -1, "max_prefill": 16384, "max_running": 4, "ratio": 0.7,
                      "waiting": [{"input": 50, "max_new": 50}]})
    for _ in range(60):  # prefix-cache admission: waiting requests extend cached sequences
        cached = _token_seqs(rng, rng.randint(1, 5), 1, 300)
        waiting = []
        for _ in range(rng.randint(1, 6)):
            base = rng.choice(cached)
            prefix = base[: rng.randint(1, len(base))]
            own = 0 if rng.random() < 0.3 else rng.randint(1, 300)  # 0: all of it cached, its last token computed
            waiting.append({"prefix": prefix, "input": own, "max_new": rng.randint(1, 400)})
        admit.append({"free": rng.randint(0, 1500), "running": [], "chunk": rng.choice([-1, 64, 256]),
                      "max_prefill": rng.choice([1024, 16384]), "max_running": 8, "ratio": 0.7,
                      "cached": cached, "waiting": waiting})
    decode = []
    for _ in range(120):
        running = []
        for _ in range(rng.randint(2, 10)):  # few distinct lengths: ties on the output count are common
            n_out = rng.choice([0, 1, 2, 5, 9])
            running.append([rng.choice([1, 2, 4, 10, 30]), n_out, n_out + rng.randint(1, 100)])
        decode.append({"running": running, "free": rng.randint(0, 8), "cached": _token_seqs(rng, rng.randint(0, 3), 1, 20)})
    radix = [_radix_ops(rng) for _ in range(80)]
    chunks = []
    for _ in range(40):
        chunks.append({"free": rng.randint(200, 3000), "chunk": rng.choice([64, 128, 512]),
                       "max_prefill": rng.choice([256, 16384]), "ratio": rng.choice([0.7, 0.098]),
                       "waiting": [{"input": rng.randint(1, 900), "max_new": rng.randint(1, 1000)}
                                   for _ in range(rng.randint(1, 5))]})
    pause = [{"running": [rng.randint(1, 40) for _ in range(rng.randint(0, 5))], "chunked": rng.randint(0, 60),
              "free": rng.randint(0, 50), "cached": _token_seqs(rng, rng.randint(0, 4), 10, 80)} for _ in range(30)]
    return {"sort": sort, "preempt": preempt, "admit": admit, "decode": decode, "radix": radix,
            "chunks": chunks, "pause": pause, "spans": _span_cases(rng)}


def _span_cases(rng: random.Random) -> list[Any]:
    """Weight updates a request lived through: (old label, its output tokens then) each, with
    output (the sim records none without: SGLang's `record_weight_version_events`), the label at
    its end, and its output tokens (more than at the last update, or as many: an abort)."""
    cases = []
    for _ in range(80):
        events, produced = [], 0
        for _ in range(rng.randint(0, 4)):
            produced += rng.randint(0, 5)
            if produced:
                events.append([rng.choice("abc"), produced])
        cases.append({"events": events, "current": rng.choice("abc"), "produced": produced + rng.randint(0, 5)})
    return cases


def _token_seqs(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    """Sequences over a 4-token alphabet, many sharing prefixes (the tree splits and matches
    inside edges), none touching the requests' own ids (those are >= 10,000)."""
    seqs: list[list[int]] = []
    for _ in range(count):
        head = rng.choice(seqs)[: rng.randint(0, 20)] if seqs and rng.random() < 0.6 else []
        seqs.append(head + [rng.randint(0, 3) for _ in range(rng.randint(low, high))])
    return seqs


def _radix_ops(rng: random.Random) -> list[list[Any]]:
    """insert / match / lock (match, then lock its node) / unlock (the k-th lock still held) / evict."""
    ops: list[list[Any]] = []
    seen: list[list[int]] = []
    for _ in range(rng.randint(5, 40)):
        kind = rng.choice(["insert", "insert", "match", "lock", "unlock", "evict"])
        if kind in ("insert", "match", "lock"):
            if seen and rng.random() < 0.7:
                base = rng.choice(seen)
                ids = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
            else:
                ids = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
            ids = ids or [rng.randint(0, 3)]
            seen.append(ids)
            ops.append([kind, ids])
        else:
            ops.append([kind, rng.randint(0, 12)])
    return ops


def _ids(i: int, n: int) -> list[int]:
    """Request i's own tokens: never in another request or a cached sequence."""
    return [10_000 * (i + 1) + t for t in range(n)]


@pytest.fixture(scope="module")
def sglang_answers(tmp_path_factory) -> dict[str, list[Any]]:
    import importlib.util

    from tests.support.conformance_support import unavailable

    if importlib.util.find_spec("sglang") is None:
        unavailable("sglang is not installed (see .ci/run)")
    workdir = tmp_path_factory.mktemp("sglang-rules")
    result = subprocess.run([sys.executable, str(Path(__file__)), "probe", str(workdir)],
                            input=json.dumps(_cases()), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _scheduler(**limits: Any) -> BatchScheduler:
    return BatchScheduler(SchedulerConfig(kv_pool_tokens=10**9, max_running_requests=64, **limits),
                          FlatSteps(0.01), asyncio.Event())


def test_weight_version_spans_are_sglangs(sglang_answers):
    """The simulator's spans (workers/sim/core.py `_spans`, its own: it runs without sglang)
    are SGLang's `compute_weight_version_spans` of the same events (issue 39 item 5)."""
    from workers.sim.engine import SimEngine

    for case, theirs in zip(_cases()["spans"], sglang_answers["spans"]):
        running = SimpleNamespace(version_events=[tuple(event) for event in case["events"]])
        spans = SimEngine._spans(SimpleNamespace(weight_version=case["current"]), running, case["produced"])  # type: ignore[arg-type]
        assert [[s["version"], s["start"], s["end"]] for s in spans] == theirs, case


def test_queue_order_is_sglangs(sglang_answers):
    for case, theirs in zip(_cases()["sort"], sglang_answers["sort"]):
        sch = _scheduler(priority_scheduling=True, low_priority_values_first=case["low_first"])
        reqs = [SimReq(str(i), [1], [1], 1, p) for i, p in enumerate(case["priorities"])]
        for r in reqs:
            sch.add(r)
        assert [int(r.rid) for r in sch._queue_order()] == theirs, case


def _decode_state(case: dict[str, Any]) -> BatchScheduler:
    """A running batch as after its prefills: each request's input cached and locked, its
    outputs' KV its own; `cached` sequences nobody locks (evictable); `free` tokens left."""
    held = sum(n_in + n_out for n_in, n_out, _ in case["running"])
    sch = BatchScheduler(SchedulerConfig(kv_pool_tokens=10**6, max_running_requests=64), FlatSteps(0.01),
                         asyncio.Event())
    for ids in case["cached"]:
        sch.cache.insert(ids)
    sch.config.kv_pool_tokens = held + sch.cache.total_size + case["free"]
    for i, (n_in, n_out, max_new) in enumerate(case["running"]):
        req = SimReq(f"r{i}", _ids(i, n_in), [7] * max_new, max_new)
        sch.cache.insert(req.input_ids)
        _n, req.node = sch.cache.match_prefix(req.input_ids)
        sch.cache.lock(req.node)
        req.produced, req.prefix, req.filled, req.private = n_out, n_in, n_in + n_out, n_out
        sch.running.append(req)
    assert sch.kv_free == case["free"]
    return sch


def test_check_decode_mem_and_retraction_are_sglangs(sglang_answers):
    """The decode step's memory check and retraction, against SGLang's own `ScheduleBatch`:
    `check_decode_mem` (one token per request at page size 1, through the allocator's
    `check_decode_capacity`, which evicts the shortfall from SGLang's `RadixCache` first), then
    `retract_decode` (its `_get_decode_retraction_order`, the loop that retracts at least one and
    never the last until `check_decode_mem` passes, `release_req` freeing each one's KV and
    evicting to keep SGLANG_RETRACT_DECODE_STEPS tokens per remaining request, and
    `NewTokenRatioTracker.estimate_new_token_ratio_after_retract`): whether the batch fits, which
    requests are retracted in which order, the new token ratio, and the free and evictable
    tokens after; and the KV in use then as SGLang's token usage counts it
    (`SchedulerPoolStatsObserver._get_token_info`: the pool less free and evictable). Mutations caught: flipping the tie-break in `BatchScheduler._retract`
    (`-len(r.input_ids)` -> `len(r.input_ids)`); `_decode_fits` counting the evictable cache
    without evicting it (`len(reqs) <= self.kv_free + self.cache.evictable_size`); `_retract_one`
    without the eviction; `kv_used` counting the whole tree (`self.cache.total_size + ...`)."""
    outcomes = sglang_answers["decode"]
    assert {o["fits"] for o in outcomes} == {True, False} and any(len(o["retracted"]) > 1 for o in outcomes)
    for case, theirs in zip(_cases()["decode"], outcomes):
        sch = _decode_state(case)
        fits = sch._decode_fits(sch.running)
        if not fits:
            sch._retract()
        ours = {"fits": fits, "retracted": [r.rid for r in sch.waiting], "kept": [r.rid for r in sch.running],
                "ratio": round(sch.new_token_ratio, 9) if not fits else None,
                "free": sch.kv_free, "evictable": sch.cache.evictable_size, "used": sch.kv_used}
        assert ours == theirs, case


def test_the_radix_cache_is_sglangs(sglang_answers):
    """workers/sim/radix.py against SGLang's `RadixCache` (mem_cache/radix_cache.py, page size 1,
    LRU) on the same operations: what `insert` found cached, what `match_prefix` matched (split
    inside an edge), the evictable and protected sizes after each `inc_lock_ref` /
    `dec_lock_ref`, and what `evict` frees in which order (the matches after each eviction).
    Mutations caught: `match_prefix` refreshing the access time of the upper half only when it
    splits an edge (`child.last_access = now` after `_split`); `evict` taking the most recently
    used leaf first (`-n.last_access`)."""
    for ops, theirs in zip(_cases()["radix"], sglang_answers["radix"]):
        cache = RadixCache()
        locks: list[Any] = []
        ours: list[Any] = []
        seen: list[list[int]] = []
        for kind, arg in ops:
            if kind == "insert":
                out: Any = cache.insert(arg)
            elif kind in ("match", "lock"):
                out, node = cache.match_prefix(arg)
                if kind == "lock":
                    cache.lock(node)
                    locks.append(node)
            elif kind == "unlock":
                out = None
                if locks:
                    cache.unlock(locks.pop(arg % len(locks)))
            else:
                out = [cache.evict(arg), [cache.match_prefix(ids)[0] for ids in seen]]
            if kind != "evict" and kind != "unlock":
                seen.append(arg)
            ours.append([out, cache.evictable_size, cache.protected_size])
        assert ours == theirs, ops


def test_prefill_chunks_continue_as_sglangs(sglang_answers):
    """Chunk continuation over successive prefill passes, against SGLang's `PrefillAdder`: the
    unfinished chunked request goes first in the next pass (`add_chunked_req`, cut at what is
    left of `--chunked-prefill-size` and the pool, `PrefillBudget.available_chunk_tokens`),
    reserving its output only with its last chunk; then the waiting queue (`add_one_req`), each
    admitted request then running and growing at new_token_ratio. The passes until nothing is
    admitted: which requests prefill how many tokens in each. Mutation caught:
    `BatchScheduler._admit` reserving no output for the continuing request's last chunk
    (`budget.reserve(take, 0 if take < left else self._max_new(req))` -> `budget.reserve(take, 0)`:
    the requests after it in that pass then get room SGLang does not give them)."""
    outcomes = sglang_answers["chunks"]
    assert any(len(passes) > 2 for passes in outcomes)
    for case, theirs in zip(_cases()["chunks"], outcomes):
        sch = BatchScheduler(SchedulerConfig(kv_pool_tokens=case["free"], max_running_requests=64,
                                             chunked_prefill_size=case["chunk"], max_prefill_tokens=case["max_prefill"]),
                             FlatSteps(0.01), asyncio.Event())
        sch.new_token_ratio = case["ratio"]
        for i, w in enumerate(case["waiting"]):
            sch.add(SimReq(f"w{i}", _ids(i, w["input"]), [1] * w["max_new"], w["max_new"]))
        passes = []
        for _ in range(60):
            batch = sch._admit()
            if not batch:
                break
            passes.append([[r.rid, take] for r, take in batch])
            sch._run_prefill(batch)
        assert passes == theirs, case


def test_retract_pause_is_sglangs(sglang_answers):
    """`/pause_generation {"mode": "retract"}` against SGLang's own `Scheduler.pause_generation`
    (managers/scheduler.py) on a scheduler whose running batch, chunked request and cache are
    these: `retract_all` releases the running requests then the chunked one (each `release_req`:
    KV freed, nothing cached, the cache evicted to keep SGLANG_RETRACT_DECODE_STEPS tokens per
    request still to release), and they queue again in that order. Compared: the waiting
    queue's order, the free and evictable tokens after. Mutation caught:
    `BatchScheduler.retract_all` releasing the chunked request first (`reqs = self._holders()`
    -> `reqs = self._holders()[::-1]`). The modes SGLang's scheduler never sees are pinned
    against the source in test_pause_modes_follow_sglangs_source."""
    for case, theirs in zip(_cases()["pause"], sglang_answers["pause"]):
        sch = _pause_state(case)
        sch.retract_all()
        assert [[r.rid for r in sch.waiting], sch.kv_free, sch.cache.evictable_size] == theirs, case


def test_in_place_pause_is_sglangs(sglang_answers):
    """`/pause_generation {"mode": "in_place"}` against SGLang's own `Scheduler.pause_generation`:
    it only sets `_engine_paused` (the running batch, the chunked request, the pool and the cache
    stay as they were; `event_loop_normal` runs no batch while it is set, pinned in
    test_pause_modes_follow_sglangs_source). Ours: with the step loop's `resumed` cleared (what
    the engine's in_place pause does) no step runs and nothing moves, until it is set again.
    Mutation caught: `BatchScheduler._loop` without its paused branch (`if not
    self.resumed.is_set(): ...` deleted)."""
    for case, theirs in zip(_cases()["pause"], sglang_answers["in_place"]):
        assert asyncio.run(_paused_then_resumed(_pause_state(case))) == theirs, case


def _pause_state(case: dict[str, Any]) -> BatchScheduler:
    """A running batch (as `_decode_state`), and a request mid-chunk whose first chunk's KV is its own."""
    sch = _decode_state({"running": [[n, 1, 50] for n in case["running"]], "free": case["free"],
                         "cached": case["cached"]})
    if case["chunked"]:
        req = SimReq("chunked", _ids(99, case["chunked"] * 2), [7], 1)
        req.filled = req.private = case["chunked"]
        req.node = sch.cache.root  # nothing cached matched
        sch.chunked = req
        sch.config.kv_pool_tokens += case["chunked"]
    return sch


async def _paused_then_resumed(sch: BatchScheduler) -> list[Any]:
    """The step loop with `resumed` cleared (an in_place pause), a request arriving meanwhile:
    the state while paused; then it must step once resumed."""
    assert not sch.resumed.is_set()
    sch.submit(SimReq("late", _ids(98, 3), [7], 1))
    await asyncio.sleep(0.02)
    assert sch.stats["steps"] == 0
    state = [[r.rid for r in sch.waiting if r.rid != "late"], [r.rid for r in sch.running],
             sch.chunked.rid if sch.chunked else None, sch.kv_free, sch.cache.evictable_size]
    sch.resumed.set()
    await asyncio.sleep(0.02)
    assert sch.stats["steps"] > 0 and sch._task is not None
    sch._task.cancel()
    return state


def test_pause_modes_follow_sglangs_source():
    """What SGLang does for each pause mode, read from its source where its scheduler cannot be
    driven here (an event loop over ZMQ): `TokenizerManager.pause_generation` sends `in_place`
    and `retract` to the scheduler and handles `abort` itself (`abort_request(abort_all=True)`:
    every request ends with what it produced); `Scheduler.pause_generation(in_place)` only sets
    `_engine_paused` (state untouched), and `event_loop_normal` runs no batch while it is set.
    The simulator: abort ends every request (`/pause_generation` -> `abort_all`), in_place and
    retract clear the step loop's `resumed` (no step runs), retract also `retract_all`."""
    import ast
    import importlib.util
    import inspect

    from tests.support.conformance_support import unavailable

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        unavailable("sglang is not installed (see .ci/run)")
    managers = Path(spec.origin).parent / "srt" / "managers"

    def method(path: Path, cls: str, name: str) -> str:
        source = path.read_text()
        owner = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls)
        found = next(n for n in owner.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
        return ast.get_source_segment(source, found) or ""

    pause = method(managers / "tokenizer_manager.py", "TokenizerManager", "pause_generation")
    assert 'if obj.mode != "abort":' in pause and "self.abort_request(abort_all=True)" in pause
    body = method(managers / "scheduler.py", "Scheduler", "pause_generation")
    in_place = body[: body.index("if self.enable_overlap and self.last_batch:")]
    assert 'if recv_req.mode == "in_place":' in in_place and in_place.rstrip().endswith("return")
    assert "retract_all(" in body
    loop = method(managers / "scheduler.py", "Scheduler", "event_loop_normal")
    loop = loop[: loop.index("get_next_batch_to_run")]
    assert "if self._engine_paused:" in loop and "continue" in loop

    from workers.sim import engine

    ours = inspect.getsource(engine.SimEngine.pause)
    assert 'self.abort_all("Abort for pause generation")' in ours and "self.scheduler.retract_all()" in ours
    assert "self._resumed.clear()" in ours


class _FixedBudget:
    def __init__(self, remaining_total: float):
        self.remaining_total = remaining_total
        self.total_offset = 0.0


def test_priority_preemption_releases_what_sglang_releases(sglang_answers):
    outcomes = sglang_answers["preempt"]
    assert {ok for ok, _ in outcomes} == {True, False} and any(len(released) > 1 for _, released in outcomes)
    for case, theirs in zip(_cases()["preempt"], sglang_answers["preempt"]):
        sch = _scheduler(priority_scheduling=True, low_priority_values_first=case["low_first"],
                         preemption_threshold=case["threshold"])
        sch.new_token_ratio = case["ratio"]
        for i, r in enumerate(case["running"]):
            req = SimReq(f"r{i}", [1], [1] * (r["out"] + 1), r["max_new"], r["priority"])
            req.produced, req.entry = r["out"], i
            sch.running.append(req)
        new = case["new"]
        waiting = SimReq("new", [2] * new["input"], [2], new["max_new"], new["priority"])
        ok = sch._preempt_for(waiting, _FixedBudget(case["rem_total"]))  # type: ignore[arg-type]
        released = sorted(int(r.rid[1:]) for r in sch.waiting)
        assert [ok, released] == theirs, case


def test_admission_and_chunking_are_sglangs(sglang_answers):
    """One prefill pass over a waiting queue (Scheduler._get_new_batch_prefill_raw's loop around
    PrefillAdder.add_one_req, with SGLang's real PrefillBudget): which requests are admitted, and
    how many tokens each prefills (a chunk where --chunked-prefill-size cuts it), from the pool's
    free tokens, the running requests' growth at new_token_ratio, --max-prefill-tokens and
    --max-running-requests; and with a prefix cache (SGLang's own `RadixCache`, matched as
    `Req.init_next_round_input` matches: all but the last token), each one's cached prefix, the
    evictable tokens counting as room except the prefix the request itself locks (`_lock_node`).
    Mutation caught: `_admit` matching the whole input (`match_prefix(fill)` instead of
    `fill[:-1]`); `_admit` not locking the matched prefix while it checks the budget."""
    outcomes = sglang_answers["admit"]
    assert any(len(a) > 1 for a in outcomes) and any(not a for a in outcomes)
    assert any(take < case["waiting"][int(rid[1:])]["input"]  # some are chunked
               for case, a in zip(_cases()["admit"], outcomes) for rid, take, _prefix in a)
    assert any(prefix for case, a in zip(_cases()["admit"], outcomes) for _rid, _take, prefix in a)  # cache hits
    for case, theirs in zip(_cases()["admit"], outcomes):
        sch = BatchScheduler(SchedulerConfig(kv_pool_tokens=case["free"], max_running_requests=case["max_running"],
                                             chunked_prefill_size=case["chunk"], max_prefill_tokens=case["max_prefill"]),
                             FlatSteps(0.01), asyncio.Event())
        sch.new_token_ratio = case["ratio"]
        for ids in case.get("cached", []):  # cached and unlocked: evictable, part of the pool
            sch.config.kv_pool_tokens += len(ids) - sch.cache.insert(ids)
        for i, r in enumerate(case["running"]):
            req = SimReq(f"r{i}", [1], [1] * r["max_new"], r["max_new"])
            req.produced = r["out"]
            sch.running.append(req)
        for i, w in enumerate(case["waiting"]):
            sch.add(SimReq(f"w{i}", w.get("prefix", []) + _ids(i, w["input"]), [1], w["max_new"]))
        ours = [[r.rid, take, r.prefix] for r, take in sch._admit()]
        assert ours == theirs, case


# ------------------------------------------------------------------ SGLang's side (subprocess)


def _probe(workdir: Path) -> None:
    sys.path[:0] = [str(REPO)]
    from tests.support.conformance_support import _import_with_stubs
    from tests.support.engine_stack import _model_dir

    cases = json.loads(sys.stdin.read())
    policy = _import_with_stubs("sglang.srt.managers.schedule_policy", ("torchvision",))
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    model = str(_model_dir(workdir, 32768))

    def configure(low_first: bool, threshold: int = 10) -> None:
        publish(ServerArgs(model_path=model, device="cpu", enable_priority_scheduling=True,
                           schedule_low_priority_values_first=low_first,
                           priority_scheduling_preemption_threshold=threshold), role="scheduler")

    sort = []
    for case in cases["sort"]:
        low = case["low_first"]
        default = sys.maxsize if low else -sys.maxsize - 1  # tokenizer_manager.py _set_default_priority
        queue = [SimpleNamespace(i=i, priority=default if p is None else p,
                                 time_stats=SimpleNamespace(wait_queue_entry_time=float(i)))
                 for i, p in enumerate(case["priorities"])]
        policy.SchedulePolicy._sort_by_priority_and_fcfs(queue, 1 if low else -1)
        sort.append([q.i for q in queue])
    preempt = []
    for case in cases["preempt"]:
        configure(case["low_first"], case["threshold"])
        preempt.append(_sglang_preempt(policy.PrefillAdder, case))
    configure(False)
    admit = [_sglang_admit(policy, case) for case in cases["admit"]]
    decode = [_sglang_decode(case) for case in cases["decode"]]
    radix = [_sglang_radix(ops) for ops in cases["radix"]]
    chunks = [_sglang_chunks(policy, case) for case in cases["chunks"]]
    scheduler = _import_with_stubs("sglang.srt.managers.scheduler", ("torchvision",))
    pause = [_sglang_pause(scheduler, case) for case in cases["pause"]]
    in_place = [_sglang_pause(scheduler, case, "in_place") for case in cases["pause"]]
    from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans

    spans = [[[s.version, s.start, s.end] for s in compute_weight_version_spans(
        [WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in case["events"]],
        current_version=case["current"], num_output_tokens=case["produced"])] for case in cases["spans"]]
    print(json.dumps({"sort": sort, "preempt": preempt, "admit": admit, "decode": decode, "radix": radix,
                      "chunks": chunks, "pause": pause, "in_place": in_place, "spans": spans}))


class _Pool:
    """A token pool of `free` tokens at page size 1 with SGLang's own capacity check
    (`BaseTokenToKVPoolAllocator.check_decode_capacity` / `evict_to_free_tokens`); what its
    `RadixCache` evicts comes back here (`free_segment`)."""

    page_size = 1
    device = "cpu"

    def __init__(self, free: int):
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

        self.free = free
        self._base = BaseTokenToKVPoolAllocator

    def available_size(self) -> int:
        return self.free

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        self.free += len(value) - start_pos

    def check_decode_capacity(self, **kw: Any) -> bool:
        return bool(self._base.check_decode_capacity(self, **kw))

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> Any:
        return self._base.evict_to_free_tokens(self, tree_cache, num_tokens)

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        from sglang.srt.mem_cache.prefill_budget import PrefillBudget

        return PrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def request_slot_reserve(self, **_kw: Any) -> int:
        return 0


def _key(ids: list[int]) -> Any:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", ids))


def _tree(pool: _Pool, cached: list[list[int]] = ()) -> Any:  # type: ignore[assignment]
    """SGLang's RadixCache without device pools (`create_simulated`), holding `cached` unlocked."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    tree = RadixCache.create_simulated(mock_allocator=pool)
    for ids in cached:
        tree.insert(InsertParams(key=_key(ids)))
    return tree


def _cache_and_lock(tree: Any, ids: list[int]) -> Any:
    """The request's input cached and locked, as `cache_unfinished_req` leaves it after prefill."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    tree.insert(InsertParams(key=_key(ids)))
    return tree.lock(tree.match_prefix(MatchPrefixParams(key=_key(ids))).last_device_node)


def _sglang_decode(case: dict[str, Any]) -> dict[str, Any]:
    """Scheduler.update_running_batch's memory check, then ScheduleBatch.retract_decode, on a
    ScheduleBatch holding only what they read. `release_req` is SGLang's; the KV release inside
    it (`release_kv_cache`: free the request's own KV, unlock its cached input) and
    `filter_batch` (tensor bookkeeping) stand in for the device pools."""
    from sglang.srt.managers import schedule_batch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    pool = _Pool(case["free"])
    tree = _tree(pool, case["cached"])
    reqs = []
    for i, (n_in, n_out, max_new) in enumerate(case["running"]):
        ids = _ids(i, n_in)
        reqs.append(_Req(rid=f"r{i}", origin_input_ids=ids, output_ids=[7] * n_out, priority=None, beam_group=None,
                         sampling_params=SimpleNamespace(max_new_tokens=max_new), own_kv=n_out,
                         kv=SimpleNamespace(kv_committed_len=n_in + n_out), lock=_cache_and_lock(tree, ids),
                         finished=lambda: False, reset_for_retract=lambda: None))

    def release_kv_cache(req: Any, tree_cache: Any, checkpoint: bool = False) -> None:
        pool.free += req.own_kv
        tree_cache.unlock(req.lock)

    schedule_batch.release_kv_cache = release_kv_cache
    batch = schedule_batch.ScheduleBatch.__new__(schedule_batch.ScheduleBatch)
    batch.reqs, batch.tree_cache, batch.token_to_kv_pool_allocator = reqs, tree, pool
    batch.req_to_token_pool = batch.hisparse_coordinator = None
    batch.spec_algorithm = SpeculativeAlgorithm.NONE
    batch.filter_batch = lambda keep_indices: setattr(batch, "reqs", [batch.reqs[i] for i in keep_indices])
    fits = bool(batch.check_decode_mem())
    retracted, ratio = [], None
    if not fits:
        out, ratio, aborted = batch.retract_decode()
        assert not aborted
        retracted = [r.rid for r in out]
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

    total = sum(n_in + n_out for n_in, n_out, _ in case["running"]) + case["free"] + len(
        {tuple(ids[:k]) for ids in case["cached"] for k in range(1, len(ids) + 1)})  # the cached tokens, shared once
    usage = SchedulerPoolStatsObserver._get_token_info(SimpleNamespace(  # type: ignore[arg-type]
        token_to_kv_pool_allocator=pool, tree_cache=tree, max_total_num_tokens=total))
    return {"fits": fits, "retracted": retracted, "kept": [r.rid for r in batch.reqs],
            "ratio": None if ratio is None else round(ratio, 9), "free": pool.free, "evictable": tree.evictable_size(),
            "used": usage.full_num_used}


def _sglang_radix(ops: list[list[Any]]) -> list[Any]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

    pool = _Pool(0)
    tree = _tree(pool)
    locks: list[Any] = []
    seen: list[list[int]] = []
    out: list[Any] = []
    for kind, arg in ops:
        if kind == "insert":
            got: Any = tree.insert(InsertParams(key=_key(arg))).prefix_len
        elif kind in ("match", "lock"):
            match = tree.match_prefix(MatchPrefixParams(key=_key(arg)))
            got = match.device_prefix_len
            if kind == "lock":
                locks.append(tree.lock(match.last_device_node))
        elif kind == "unlock":
            got = None
            if locks:
                tree.unlock(locks.pop(arg % len(locks)))
        else:
            evicted = tree.evict(EvictParams(num_tokens=arg)).num_tokens_evicted
            got = [evicted, [tree.match_prefix(MatchPrefixParams(key=_key(ids))).device_prefix_len for ids in seen]]
        if kind not in ("evict", "unlock"):
            seen.append(arg)
        out.append([got, tree.evictable_size(), tree.protected_size()])
    return out


def _sglang_chunks(policy: Any, case: dict[str, Any]) -> list[list[list[Any]]]:
    """Scheduler._get_new_batch_prefill_raw pass after pass (no decode between: a prefill batch
    forms whenever it can): the chunked request first (`add_chunked_req`), then the queue; each
    pass's tokens taken from the pool; a request whose prefill ends runs (one output token)."""
    pool = _Pool(case["free"])
    running: list[Any] = []
    waiting = [_sglang_req(f"w{i}", w["input"], w["max_new"]) for i, w in enumerate(case["waiting"])]
    for i, req in enumerate(waiting):
        req.full_untruncated_fill_ids = _ids(i, len(req.full_untruncated_fill_ids))
    chunked = None
    passes = []
    for _ in range(60):
        adder = policy.PrefillAdder(1, _Tree(), pool, SimpleNamespace(reqs=running, batch_size=lambda: len(running)),
                                    case["ratio"], case["max_prefill"], case["chunk"])
        if chunked is not None:
            chunked = adder.add_chunked_req(chunked)
        for req in list(waiting):
            if adder.budget_state() == policy.AddReqResult.OTHER:
                break
            if adder.add_one_req(req, has_chunked_req=chunked is not None,
                                 truncation_align_size=None) != policy.AddReqResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            chunked = adder.new_chunked_req
        if not adder.can_run_list:
            break
        passes.append([[r.rid, r.extend_end - r.prefix_len] for r in adder.can_run_list])
        for req in adder.can_run_list:
            pool.free -= req.extend_end - req.prefix_len
            req.prefix_len = req.extend_end  # cache_unfinished_req: the prefilled part is its prefix now
            if req in waiting:
                waiting.remove(req)
            if req is not chunked:
                req.output_ids = [0]  # the prefill sampled the first token
                running.append(req)
    return passes


def _sglang_pause(scheduler: Any, case: dict[str, Any], mode: str = "retract") -> list[Any]:
    """Scheduler.pause_generation(mode) on a scheduler with these fields; its `retract_all` ->
    `release_req` are SGLang's (the KV release inside stands in for the pools)."""
    from sglang.srt.managers import schedule_batch
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    pool = _Pool(case["free"])
    tree = _tree(pool, case["cached"])

    def req(rid: str, ids: list[int], own_kv: int, lock: Any) -> Any:
        return _Req(rid=rid, own_kv=own_kv, lock=lock, finished=lambda: False, reset_for_retract=lambda: None)

    running = [req(f"r{i}", _ids(i, n), 1, _cache_and_lock(tree, _ids(i, n))) for i, n in enumerate(case["running"])]
    chunked = req("chunked", [], case["chunked"], None) if case["chunked"] else None

    def release_kv_cache(r: Any, tree_cache: Any, checkpoint: bool = False) -> None:
        pool.free += r.own_kv
        tree_cache.unlock(r.lock)

    schedule_batch.release_kv_cache = release_kv_cache
    queue: list[Any] = []
    fake = SimpleNamespace(
        _engine_paused=False, _pause_started_at=None, enable_overlap=False, enable_overlap_mlx=False, last_batch=None,
        running_batch=SimpleNamespace(reqs=running, batch_is_full=True), chunked_req=chunked,
        disaggregation_mode=scheduler.DisaggregationMode.NULL, cur_batch_for_debug=None, decode_offload_manager=None,
        req_to_token_pool=None, token_to_kv_pool_allocator=pool, tree_cache=tree, hisparse_coordinator=None,
        _add_request_to_queue=queue.append,
        metrics_reporter=SimpleNamespace(last_gen_throughput=0.0, current_scheduler_metrics_enabled=False),
        kv_events_publisher=SimpleNamespace(publish_kv_events=lambda: None))
    scheduler.Scheduler.pause_generation(fake, PauseGenerationReqInput(mode=mode))
    assert fake._engine_paused
    if mode == "in_place":  # what stays where it was
        return [[r.rid for r in queue], [r.rid for r in fake.running_batch.reqs],
                fake.chunked_req.rid if fake.chunked_req else None, pool.free, tree.evictable_size()]
    assert fake.chunked_req is None and not fake.running_batch.reqs
    return [[r.rid for r in queue], pool.free, tree.evictable_size()]


class _Tree:
    """A radix cache with nothing cached, as PrefillAdder calls it."""

    buffer_pipeline = None
    disable = False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def lock(self, node: Any) -> None:
        return None

    def unlock(self, lock: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def finish_storage_prefetch_admission(self, *args: Any, **kwargs: Any) -> None:
        return None

    def load_back_is_cache_owned(self) -> bool:
        return False


def _sglang_req(rid: str, n_in: int, max_new: int, out: int = 0) -> _Req:
    return _Req(rid=rid, sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=False),
                output_ids=[0] * out, full_untruncated_fill_ids=[0] * n_in, prefix_len=0, host_hit_length=0,
                swa_host_hit_length=0, last_node=None, needs_host_load_back=lambda: False, retracted_stain=False,
                kv=SimpleNamespace(holds_mamba=False, req_pool_idx=None), mamba_host_hit_length=0,
                auxiliary_swa_host_hit_length=0, extend_end=0, storage_hit_length=0, cache_request_handle=None,
                fulfilled_storage_hit_len=lambda _p: 0, finished=lambda: False, materialized_host_hit_len=lambda: 0,
                storage_hit_start=0, host_hit_is_storage=False)


def _sglang_admit(policy: Any, case: dict[str, Any]) -> list[list[Any]]:
    """Scheduler._get_new_batch_prefill_raw's admission loop, one pass; with `cached`, over
    SGLang's RadixCache, each request matched right before `add_one_req` as
    `Req.init_next_round_input` matches it (its fill but the last token)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    running = [_sglang_req(f"r{i}", 1, r["max_new"], r["out"]) for i, r in enumerate(case["running"])]
    chunk = case["chunk"] if case["chunk"] > 0 else None
    pool = _Pool(case["free"])
    tree = _tree(pool, case["cached"]) if "cached" in case else _Tree()
    adder = policy.PrefillAdder(1, tree, pool, SimpleNamespace(reqs=running, batch_size=lambda: len(running)),
                                case["ratio"], case["max_prefill"], chunk)
    allocatable = case["max_running"] - len(running)  # get_num_allocatable_reqs
    for i, w in enumerate(case["waiting"]):
        if adder.budget_state() == policy.AddReqResult.OTHER or len(adder.can_run_list) >= allocatable:
            break
        req = _sglang_req(f"w{i}", w["input"], w["max_new"])
        req.full_untruncated_fill_ids = w.get("prefix", []) + _ids(i, w["input"])
        if "cached" in case:
            match = tree.match_prefix(MatchPrefixParams(key=_key(req.full_untruncated_fill_ids[:-1])))
            req.prefix_len, req.last_node = match.device_prefix_len, match.last_device_node
        if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != policy.AddReqResult.CONTINUE:
            break
    return [[r.rid, r.extend_end - r.prefix_len, r.prefix_len] for r in adder.can_run_list]


def _sglang_preempt(adder_class: Any, case: dict[str, Any]) -> list[Any]:
    """PrefillAdder.preempt_to_schedule on a running batch of plain objects with the fields it reads."""
    def req(name: str, priority: int, entry: float, max_new: int, out: int, n_in: int) -> _Req:
        return _Req(rid=name, priority=priority, time_stats=SimpleNamespace(wait_queue_entry_time=entry),
                               sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=False),
                               output_ids=[0] * out, full_untruncated_fill_ids=[0] * n_in, prefix_len=0,
                               kv=SimpleNamespace(req_pool_idx=None), finished=lambda: False)

    running = [req(f"r{i}", r["priority"], float(i), r["max_new"], r["out"], 1) for i, r in enumerate(case["running"])]
    adder = adder_class.__new__(adder_class)
    adder.running_batch = SimpleNamespace(reqs=running, release_req=lambda i, n: None,
                                          filter_batch=lambda keep_indices: None)
    adder.preempt_list = []
    adder.priority_scheduling_preemption_threshold = case["threshold"]
    adder.memory_budget = SimpleNamespace(remaining_total=case["rem_total"], total_offset=0.0)
    adder.new_token_ratio = case["ratio"]
    adder.token_to_kv_pool_allocator = SimpleNamespace(request_slot_reserve=lambda **_kw: 0)
    new = case["new"]
    ok = adder.preempt_to_schedule(req("new", new["priority"], 99.0, new["max_new"], 0, new["input"]))
    return [bool(ok), sorted(int(r.rid[1:]) for r in adder.preempt_list)]


class _Req:
    """A request's fields as PrefillAdder reads them; hashed by identity, as SGLang's Req."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    @property
    def extend_len(self) -> int:  # Req.extend_len
        return int(self.extend_end - self.prefix_len)


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        _probe(Path(sys.argv[2]))
