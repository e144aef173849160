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
