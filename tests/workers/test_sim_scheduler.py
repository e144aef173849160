"""The simulated engine's scheduler (workers/sim/scheduler.py) against the SGLang 0.5.23 rules it
models, each test naming the function its rule comes from. The scheduler is driven step by step
(`BatchScheduler.step`), so these count tokens, steps and orders, never times.
tests/conformance/test_sim_sglang_rules.py drives the same sequences through SGLang's own code."""

from __future__ import annotations

import asyncio

import pytest

from workers.sim.physics import FlatSteps
from workers.sim.radix import RadixCache
from workers.sim.scheduler import MIN_NEW_TOKEN_RATIO, BatchScheduler, SchedulerConfig, SimReq


def scheduler(pool: int = 100_000, max_running: int = 64, **limits) -> BatchScheduler:
    config = SchedulerConfig(kv_pool_tokens=pool, max_running_requests=max_running, **limits)
    return BatchScheduler(config, FlatSteps(0.01), asyncio.Event())


def request(rid: str, n_in: int = 10, n_out: int = 5, *, priority: int | None = None, max_new: int | None = None,
            first: int = 0) -> SimReq:
    return SimReq(rid, list(range(first, first + n_in)), [100_000 + i for i in range(n_out)],
                  n_out if max_new is None else max_new, priority)


def run(sch: BatchScheduler, reqs: list[SimReq], max_steps: int = 100_000) -> list[str]:
    """Step until everything finished; the order requests finished in."""
    finished: list[str] = []
    for _ in range(max_steps):
        if not (sch.waiting or sch.running or sch.chunked):
            break
        sch.step()
        assert sch.kv_used <= sch.config.kv_pool_tokens
        finished += [r.rid for r in reqs if r.done.is_set() and r.rid not in finished]
    assert len(finished) == len(reqs), finished
    return finished


# ------------------------------------------------------------------ queue order


def _admission_order(priorities: list[int | None], **limits) -> list[int]:
    sch = scheduler(max_running=1, preemption_threshold=10**9, **limits)
    reqs = [request(str(i), n_out=2, priority=p) for i, p in enumerate(priorities)]
    for r in reqs:
        sch.add(r)
    return [int(rid) for rid in run(sch, reqs)]


def test_fcfs_ignores_priority():
    """SchedulePolicy.calc_priority with --schedule-policy fcfs (schedule_policy.py): arrival order."""
    assert _admission_order([1, 50, None, 7]) == [0, 1, 2, 3]


def test_priority_scheduling_serves_larger_values_first_then_arrival_and_none_last():
    """SchedulePolicy._sort_by_priority_and_fcfs (schedule_policy.py): (priority x -1, entry time);
    no priority = -sys.maxsize - 1 (tokenizer_manager.py _set_default_priority)."""
    assert _admission_order([1, 50, None, 7, 50], priority_scheduling=True) == [1, 4, 3, 0, 2]


def test_low_values_first_flips_the_order_and_none_is_still_last():
    """--schedule-low-priority-values-first: sign +1, no priority = sys.maxsize (still last)."""
    assert _admission_order([1, 50, None, 7, 1], priority_scheduling=True, low_priority_values_first=True) == [0, 4, 3, 1, 2]


# ------------------------------------------------------------------ priority preemption


@pytest.mark.parametrize(("better_by", "preempts"), [(10, False), (11, True)])
def test_a_waiting_request_preempts_only_past_the_threshold(better_by: int, preempts: bool):
    """PrefillAdder.preempt_to_schedule (schedule_policy.py), reached from
    Scheduler._get_new_batch_prefill_raw when the batch is at max-running-requests: a running
    request is released only when the waiting one is better by MORE than
    --priority-scheduling-preemption-threshold (10); it keeps its output, queues again and
    re-prefills input + output."""
    sch = scheduler(max_running=1, priority_scheduling=True, preemption_threshold=10)
    low = request("low", n_in=30, n_out=40, priority=0)
    sch.add(low)
    for _ in range(5):
        sch.step()
    assert low.produced == 5
    high = request("high", n_in=8, n_out=3, priority=better_by, first=500)
    sch.add(high)
    order = run(sch, [low, high])
    assert order == (["high", "low"] if preempts else ["low", "high"])
    assert sch.stats["preemptions"] == (1 if preempts else 0)
    assert low.produced == 40 and low.retractions == (1 if preempts else 0)


# ------------------------------------------------------------------ admission budget and chunking


def test_admission_stops_at_the_first_request_whose_input_and_output_do_not_fit():
    """PrefillAdder.add_one_req / _select_prefill_admission: a request needs its uncached input +
    min(max_new_tokens, CLIP_MAX_NEW_TOKENS) + one page out of the pool's free + evictable tokens
    less the running requests' expected growth; the pass stops at the first that does not fit
    (NO_TOKEN), even if a later, smaller one would."""
    sch = scheduler(pool=1000)
    reqs = [request(f"r{i}", n_in=100, n_out=300, first=1000 * i) for i in range(3)] + [request("small", n_in=5, n_out=5, first=9000)]
    for r in reqs:
        sch.add(r)
    sch.step()  # 401 + 401 fit in 1000; the third's 401 does not fit in 198, and the pass stops
    assert [r.rid for r in sch.running] == ["r0", "r1"]
    assert [r.rid for r in sch.waiting] == ["r2", "small"]
    run(sch, reqs)


def test_a_long_prompt_is_prefilled_in_chunks_before_anything_decodes():
    """--chunked-prefill-size: _select_prefill_admission cuts the request at the chunk budget
    (is_chunked, no output reserved), add_chunked_req continues it first in the next passes;
    event_loop_normal runs a prefill batch whenever one forms, so the running request waits."""
    sch = scheduler(chunked_prefill_size=100)
    running = request("running", n_in=10, n_out=50)
    sch.add(running)
    sch.step()
    assert running.produced == 1  # the prefill samples the first token
    long = request("long", n_in=250, n_out=5, first=1000)
    sch.add(long)
    chunks = []
    for _ in range(3):
        before = sch.stats["prefill_tokens"]
        sch.step()
        chunks.append(sch.stats["prefill_tokens"] - before)
    assert chunks == [100, 100, 50]
    assert running.produced == 1 and long.produced == 1
    sch.step()  # now one decode step for both
    assert running.produced == 2 and long.produced == 2


def test_max_running_requests_caps_the_batch():
    """Scheduler.get_num_allocatable_reqs: no admission past --max-running-requests."""
    sch = scheduler(max_running=3)
    reqs = [request(str(i), n_out=20, first=100 * i) for i in range(5)]
    for r in reqs:
        sch.add(r)
    sch.step()
    assert len(sch.running) == 3 and len(sch.waiting) == 2
    run(sch, reqs)


# ------------------------------------------------------------------ retraction


def test_a_full_pool_retracts_the_request_with_the_fewest_output_tokens():
    """ScheduleBatch.retract_decode / _get_decode_retraction_order (schedule_batch.py, --retraction-policy
    length): admission counts running requests' growth at new_token_ratio, which decays to 0.098
    (NewTokenRatioTracker); a request admitted on that estimate can fill the pool, and when the
    next decode step's tokens do not fit (check_decode_mem) the one with the fewest output tokens
    (then the longest input) is retracted, at least one, never the last; it keeps its output,
    re-prefills later, and everything finishes inside the pool. (The order itself is checked
    against SGLang's function in tests/conformance/test_sim_sglang_rules.py.)"""
    sch = scheduler(pool=300)
    a = request("a", n_in=40, n_out=200)
    sch.add(a)
    sch.step()
    sch.new_token_ratio = MIN_NEW_TOKEN_RATIO  # as after 600 decode steps
    for _ in range(9):
        sch.step()
    b = request("b", n_in=20, n_out=200, first=1000)
    sch.add(b)
    sch.step()
    assert {r.rid for r in sch.running} == {"a", "b"}  # 221 tokens promised < 300 - 40 - 10 - 190 x 0.098
    while not sch.stats["retractions"]:
        sch.step()
    assert [r.rid for r in sch.waiting] == ["b"] and b.retractions == 1 and 1 < b.produced < a.produced
    kept = b.produced
    run(sch, [a, b])
    assert a.produced == b.produced == 200 and b.produced > kept
    assert sch.stats["max_kv_used"] <= 300


# ------------------------------------------------------------------ prefix cache


def test_a_second_turn_prefills_only_what_the_cache_lacks_and_a_flush_forgets_it():
    """RadixCache (mem_cache/radix_cache.py): cache_finished_req caches input + output (the last
    token has no KV yet); the next turn's match_prefix finds it (meta_info.cached_tokens);
    flush_cache empties it, and is refused while a request holds cached nodes."""
    sch = scheduler()
    first = request("t1", n_in=100, n_out=21)
    sch.add(first)
    run(sch, [first])
    assert first.cached_tokens == 0
    second_input = first.input_ids + first.output_ids + list(range(7000, 7010))
    second = SimReq("t2", second_input, [1, 2, 3], 3)
    sch.add(second)
    before = sch.stats["prefill_tokens"]
    run(sch, [second])
    assert second.cached_tokens == 120
    assert sch.stats["prefill_tokens"] - before == len(second_input) - 120
    holder = request("holder", n_in=20, n_out=50, first=50_000)
    sch.add(holder)
    sch.step()
    assert sch.flush_cache() is False  # not idle
    run(sch, [holder])
    assert sch.flush_cache() is True and sch.cache.total_size == 0
    third = SimReq("t3", second_input, [1], 1)
    sch.add(third)
    run(sch, [third])
    assert third.cached_tokens == 0


def test_kv_used_is_sglangs_token_usage_cached_prefixes_nobody_locks_are_not_used():
    """SchedulerPoolStatsObserver._get_token_info (managers/scheduler_components/pool_stats_observer.py):
    used = pool - (allocator's available + radix cache's evictable): a running request's KV and
    the cached prefix it locks are used, a finished request's cached input + output are not (they
    are evictable), and the pool's free tokens exclude them until evicted. The stats the frontier
    prints as KV pool use (max_kv_used, kv_used_token_s) follow. Mutation caught: `kv_used`
    counting the whole tree (`self.cache.total_size + ...`, the old count)."""
    sch = scheduler(pool=1000)
    first = request("a", n_in=100, n_out=5)
    sch.add(first)
    sch.step()  # prefill: the input is cached and locked, the first token sampled
    assert (sch.kv_used, sch.kv_free) == (100, 900)
    run(sch, [first])
    assert sch.cache.evictable_size == 104 and sch.cache.protected_size == 0  # input + 4 outputs with KV
    assert (sch.kv_used, sch.kv_free) == (0, 896)
    second = SimReq("b", first.input_ids[:60] + list(range(5000, 5040)), [1, 2, 3], 3)
    sch.add(second)
    sch.step()  # shares 60 cached tokens (now locked: used) and adds 40 of its own
    assert (sch.kv_used, sch.cache.evictable_size) == (100, 44)
    asyncio.run(sch._advance(0.5))  # the step loop's clock records KV use as the step runs
    assert (sch.stats["max_kv_used"], sch.stats["kv_used_token_s"]) == (100, 50)
    run(sch, [second])
    assert sch.kv_used == 0 and sch.kv_free == 1000 - sch.cache.total_size


def test_eviction_frees_the_least_recently_used_unlocked_leaves_first():
    """RadixCache.evict: a heap of leaves by last access; locked nodes (inc_lock_ref) stay."""
    cache = RadixCache()
    cache.insert(list(range(10)))
    cache.insert(list(range(100, 110)))
    cache.insert(list(range(200, 210)))
    cache.match_prefix(list(range(10)))  # touched: now the most recent
    _n, locked = cache.match_prefix(list(range(100, 110)))
    cache.lock(locked)
    assert cache.evict(5) == 10  # a whole leaf: 200.. (least recent, unlocked)
    assert cache.match_prefix(list(range(200, 210)))[0] == 0
    assert cache.match_prefix(list(range(10)))[0] == 10
    assert cache.evict(100) == 10 and cache.total_size == 10 == cache.protected_size
    cache.unlock(locked)
    assert cache.evictable_size == 10


def test_a_shared_prefix_is_split_and_matched_token_exactly():
    """_split_node: page size 1, a match may end inside an edge."""
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5])
    assert cache.insert([1, 2, 3, 9, 9]) == 3
    assert cache.match_prefix([1, 2, 3, 4, 7])[0] == 4
    assert cache.total_size == 7


def test_an_abort_takes_a_request_out_between_steps_with_what_it_produced():
    """Scheduler.abort_request (managers/scheduler.py): handled between steps; a waiting request
    leaves the queue, a running one the batch with its output so far (finish abort), and its KV
    goes to the cache as a finished request's does. slime's abort reads /v1/loads right after
    its /abort_request, so the engine must already be idle then (tests/workers/test_inprocess.py)."""
    sch = scheduler(max_running=1)
    running, waiting = request("running", n_in=30, n_out=50), request("waiting", n_in=10, n_out=5, first=500)
    sch.add(running)
    sch.add(waiting)
    for _ in range(4):
        sch.step()
    sch.abort(running)
    sch.abort(waiting)
    assert running.done.is_set() and waiting.done.is_set() and not (sch.running or sch.waiting)
    assert running.produced == 4 and waiting.produced == 0
    assert sch.cache.protected_size == 0 and sch.cache.evictable_size == 30 + 3


# ------------------------------------------------------------------ pause


def test_retract_pause_frees_every_running_request_and_they_re_prefill_after_continue():
    """Scheduler.pause_generation(mode="retract"): retract_all releases the running requests' KV and
    queues them; after continue they prefill input + output again (cached prompt parts excepted)."""
    sch = scheduler()
    reqs = [request(str(i), n_in=30, n_out=20, first=100 * i) for i in range(3)]
    for r in reqs:
        sch.add(r)
    for _ in range(5):
        sch.step()
    sch.retract_all()
    assert not sch.running and len(sch.waiting) == 3
    before = sch.stats["prefill_tokens"]
    sch.step()
    assert sch.stats["prefill_tokens"] - before == 3 * 5  # the prompts were cached; the 5 outputs each were not
    run(sch, reqs)
    assert all(r.produced == 20 for r in reqs)


async def _holder_and_three(threshold: int) -> tuple[list[str], list[int], dict]:
    """One slot; a 100-token request of priority 0, then three 2-token ones of priorities 100, 500,
    300 while it runs: (the order they finished, their token counts, the engine's counters)."""
    import aiohttp

    from workers.sim.engine import SimConfig, serve_sim_engine

    config = SimConfig(slots=1, token_latency_s=0.02, length_mu=6.0, length_sigma=0.01,
                       priority_scheduling=True, priority_preemption_threshold=threshold)
    finished: list[str] = []
    async with serve_sim_engine(config) as sim, aiohttp.ClientSession() as http:
        ids = sim.engine.tokenizer.encode("What is 6 * 7?", add_special_tokens=False)
        async with http.get(f"{sim.url}/server_info") as resp:
            info = await resp.json()
        assert info["enable_priority_scheduling"] is True
        assert info["priority_scheduling_preemption_threshold"] == threshold

        async def ask(rid: str, max_new: int, priority: int) -> int:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}, "rid": rid, "priority": priority}
            async with http.post(f"{sim.url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                tokens = (await resp.json())["meta_info"]["completion_tokens"]
            finished.append(rid)
            return int(tokens)

        holder = asyncio.create_task(ask("holder", 100, 0))  # 2 s on the only slot
        while not sim.engine.scheduler or not sim.engine.scheduler.running:
            await asyncio.sleep(0.01)
        short = [asyncio.create_task(ask(rid, 2, p)) for rid, p in (("p100", 100), ("p500", 500), ("p300", 300))]
        tokens = await asyncio.gather(holder, *short)
        return finished, tokens, sim.engine.physics_stats()


async def test_the_engine_preempts_over_http_and_the_preempted_request_still_finishes_whole():
    """`rollout engine --enable-priority-scheduling` over HTTP, one running request at a time: a
    long request of priority 0 runs; three short ones with priorities 100, 500, 300 preempt it
    (better by more than SGLang's default threshold, 10) and finish first; it then finishes with
    every token; with a threshold of 10**6 nothing preempts. (A request without priority would be
    preempted whatever the threshold: its default is -sys.maxsize - 1.)"""
    finished, tokens, stats = await _holder_and_three(10)
    assert finished[-1] == "holder" and tokens[0] == 100 and stats["preemptions"] >= 1
    finished, tokens, stats = await _holder_and_three(10**6)
    assert finished[0] == "holder" and tokens[0] == 100 and stats["preemptions"] == 0


async def test_a_weight_update_holds_the_gpu_for_the_push_and_flushes_the_prefix_cache():
    """WeightUpdater.flush_cache_after_weight_update (managers/scheduler_components/weight_updater.py):
    after a weight update the scheduler flushes its cache, so the same prompt is prefilled whole
    again (meta_info.cached_tokens 0); the push itself keeps the GPU busy model bytes /
    --weight-push-gbps of simulated time (Qwen3-8B's 16.4 GB at 25 GB/s: 0.655 s)."""
    import aiohttp

    from workers.sim.engine import SimConfig, serve_sim_engine

    config = SimConfig(model="Qwen/Qwen3-8B", gpu="h100_sxm", time_scale=50.0, length_mu=3.0, length_sigma=0.01)
    async with serve_sim_engine(config) as sim, aiohttp.ClientSession() as http:
        body = {"input_ids": list(range(1000, 1600)), "sampling_params": {"max_new_tokens": 8}}

        async def cached() -> int:
            async with http.post(f"{sim.url}/generate", json=body) as resp:
                return int((await resp.json())["meta_info"]["cached_tokens"])

        assert [await cached(), await cached()] == [0, 599]  # at least one token is always computed
        async with http.post(f"{sim.url}/update_weight_version", json={"new_version": "1"}) as resp:
            assert resp.status == 200
        assert await cached() == 0
        stats = sim.engine.physics_stats()
        assert sim.engine.stats["weight_push_s"] == pytest.approx(16_380_854_272 / 25e9)
        assert sim.engine.stats["cache_flushes"] == 1 and stats["sim_time_s"] >= sim.engine.stats["weight_push_s"]


def test_a_model_without_a_table_is_a_usage_error_that_lists_the_tables(capsys):
    """`rollout engine --model M --gpu G --tp N` plays only what a committed table measured."""
    from workers.sim.engine import main

    assert main(["--model", "Qwen/Qwen3-8B", "--gpu", "h100_sxm", "--tp", "2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no step-time table for model 'Qwen/Qwen3-8B' on 'h100_sxm' with tp 2" in err
    assert "Qwen--Qwen3-8B--h100_sxm--tp1" in err and "scripts/gen_step_tables.py" in err
