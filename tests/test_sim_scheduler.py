"""The simulated engine's waiting queue models SGLang's (workers/sim/scheduler.py): FCFS by default,
(priority, arrival) with priority scheduling, larger values first unless low values go first, a
request without priority last. Counts the order requests get a slot, never times."""

from __future__ import annotations

import asyncio

import pytest

from workers.sim.scheduler import SlotQueue


async def _order(queue: SlotQueue, priorities: list[int | None]) -> list[int]:
    """One request holds the only slot; the others queue in list order; the order they start."""
    started: list[int] = []
    gate = asyncio.Event()

    async def holder() -> None:
        async with queue.slot():
            await gate.wait()

    async def one(i: int, priority: int | None) -> None:
        async with queue.slot(priority):
            started.append(i)

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    tasks = []
    for i, priority in enumerate(priorities):
        tasks.append(asyncio.create_task(one(i, priority)))
        await asyncio.sleep(0)  # arrival order = list order
    gate.set()
    await asyncio.gather(first, *tasks)
    return started


@pytest.mark.asyncio
async def test_fcfs_ignores_priority():
    assert await _order(SlotQueue(1), [1, 50, None, 7]) == [0, 1, 2, 3]


@pytest.mark.asyncio
async def test_priority_scheduling_serves_larger_values_first_then_arrival_and_none_last():
    assert await _order(SlotQueue(1, by_priority=True), [1, 50, None, 7, 50]) == [1, 4, 3, 0, 2]


@pytest.mark.asyncio
async def test_low_values_first_flips_the_order_and_none_is_still_last():
    assert await _order(SlotQueue(1, by_priority=True, low_values_first=True), [1, 50, None, 7, 1]) == [0, 4, 3, 1, 2]


@pytest.mark.asyncio
async def test_a_cancelled_waiter_gives_up_its_place_and_slots_are_not_lost():
    queue = SlotQueue(1, by_priority=True)
    gate = asyncio.Event()
    started: list[str] = []

    async def run(name: str, priority: int, hold: bool = False) -> None:
        async with queue.slot(priority):
            started.append(name)
            if hold:
                await gate.wait()

    holder = asyncio.create_task(run("holder", 0, hold=True))
    await asyncio.sleep(0)
    doomed = asyncio.create_task(run("doomed", 100))
    later = asyncio.create_task(run("later", 1))
    await asyncio.sleep(0)
    doomed.cancel()
    gate.set()
    await asyncio.gather(holder, later)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert started == ["holder", "later"]
    assert queue.free == 1 and not queue._waiting


async def test_the_engine_gives_a_free_slot_to_the_largest_priority_over_http():
    """`rollout engine --enable-priority-scheduling` over HTTP: one slot, held by a long request;
    three short ones queue with priorities 1, 5, 3 (no priority: last) and end in priority order,
    and /server_info says how the engine orders them (what the workers read, workers/engine.py)."""
    import aiohttp

    from workers.sim.engine import SimConfig, serve_sim_engine
    from workers.sim.tokenizer import load_test_tokenizer

    tok = load_test_tokenizer()
    ids = tok.encode("What is 6 * 7?", add_special_tokens=False)
    config = SimConfig(slots=1, token_latency_s=0.01, latency_sigma=0.0, length_mu=6.0, length_sigma=0.01,
                       priority_scheduling=True)
    finished: list[str] = []
    async with serve_sim_engine(config) as sim, aiohttp.ClientSession() as http:
        async with http.get(f"{sim.url}/server_info") as resp:
            info = await resp.json()
        assert info["enable_priority_scheduling"] is True and info["schedule_low_priority_values_first"] is False

        async def ask(rid: str, max_new: int, priority: int | None) -> None:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}, "rid": rid}
            if priority is not None:
                body["priority"] = priority
            async with http.post(f"{sim.url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
            finished.append(rid)

        holder = asyncio.create_task(ask("holder", 60, None))  # 0.6 s on the only slot
        await asyncio.sleep(0.1)
        waiting = []
        for rid, priority in (("none", None), ("p1", 1), ("p5", 5), ("p3", 3)):
            waiting.append(asyncio.create_task(ask(rid, 2, priority)))
            await asyncio.sleep(0.05)
        await asyncio.gather(holder, *waiting)
        async with http.post(f"{sim.url}/generate", json={"input_ids": ids, "priority": 2**63}) as resp:
            assert resp.status == 400  # SGLang's signed 64-bit check
        assert sim.engine.stats["priorities"] == {"p1": 1, "p5": 5, "p3": 3}
    assert finished == ["holder", "p5", "p3", "p1", "none"]
