"""The engine's own capacity (issue 38 item 2; scripts/bench/peer_steady.py says what it is for):
the same engine as the contenders', saturated with the workload's requests and nothing else, its
generated tokens per second of its own clock over a window after a warm-up."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.bench.harness import fleet_of, get_json
from scripts.bench.ideal import task_prompts
from scripts.bench.peer_measure import SlotSampler, mark
from scripts.bench.peer_steady import CAPACITY, per_busy_s
from scripts.bench.peer_workload import Result, Workload


def capacity_prompts(wl: Workload, tasks: Path) -> list[list[int]]:
    """The workload's prompts as the engine sees them (chat template, as every contender sends)."""
    return task_prompts(tasks)


def capacity_outstanding(wl: Workload) -> int:
    """Requests kept in flight: four times the pool-bound unit, so the queue never empties (the
    capacity run reports the share of samples with a waiting queue to show it)."""
    return 4 * wl.slots


async def _saturate(url: str, wl: Workload, prompts: list[list[int]], outstanding: int, stop: asyncio.Event) -> int:
    import aiohttp

    sent = 0
    params = {"max_new_tokens": wl.max_response_len, "temperature": 1.0}

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while not stop.is_set():
            i = sent
            sent += 1
            body = {"input_ids": prompts[i % len(prompts)], "sampling_params": params, "routing_key": f"capacity-{i}"}
            try:
                async with session.post(url + "/generate", json=body) as reply:
                    await reply.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.sleep(0.1)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(outstanding)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return sent


def measure_capacity(wl: Workload, urls: Sequence[str], prompts: list[list[int]], *, warmup_s: float,
                     window_s: float, outstanding: int) -> Result:
    """Saturate the engine(s) at `urls[0]` for warmup_s + window_s seconds OF THE ENGINE'S CLOCK
    (a loaded machine slows the step loop: the window stays as long in engine time); read the
    window. A wall-clock cap of ten times the scaled durations ends a loop that cannot move."""
    result = Result("cap", CAPACITY, label=CAPACITY, concurrency=outstanding)
    sampler = SlotSampler(urls[0])
    waiting: list[int] = []

    async def run() -> None:
        stop = asyncio.Event()
        load = asyncio.create_task(_saturate(urls[0], wl, prompts, outstanding, stop))
        sampler.start()
        started = sampler.started
        give_up = started + 10 * (warmup_s + window_s) / wl.time_scale + 30.0

        async def until(clock_s: float) -> None:
            while time.monotonic() < give_up:
                stats = await asyncio.to_thread(get_json, urls[0] + "/sim/stats")
                if float(stats.get("sim_time_s", 0.0)) >= clock_s:
                    return
                if result.step_marks:
                    waiting.append(int(stats.get("num_waiting_reqs", 0)))
                await asyncio.sleep(0.5)

        await until(warmup_s)
        mark(result, started, urls)
        await until(result.step_marks[0][4] + window_s)
        mark(result, started, urls)
        stop.set()
        await load

    asyncio.run(run())
    sampler.finish(result)
    a, b = result.step_marks
    result.wall_s = b[0] - a[0]
    result.engine_tokens = int(b[2] - a[2])
    # generated (nothing trains here) per second of the engine's clock (never idle: it moved all along)
    result.trained_tokens_per_s = result.engine_tokens / (b[5] - a[5])
    result.run_tokens_per_s = result.engine_tokens / result.wall_s  # per wall second, at the time scale
    result.window = {"wall_s": round(result.wall_s, 2), "played_s": round(b[5] - a[5], 2),
                     "generated_tokens": result.engine_tokens, "busy_s": round(b[3] - a[3], 2),
                     "clock_rate": round((b[5] - a[5]) / result.wall_s / wl.time_scale, 3)}
    result.ran, result.steps = True, 1
    stats = get_json(urls[0] + "/sim/stats")
    result.engine_stats = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    running = [b for _t, b in result.slot_samples[len(result.slot_samples) // 3:]]
    result.notes.append(f"window {b[5] - a[5]:.0f} s engine clock ({result.wall_s:.1f} s wall) after {a[4]:.0f} s "
                        f"warm-up; {outstanding} requests in "
                        f"flight; mean running {statistics.mean(running) if running else float('nan'):.1f}; waiting "
                        f"queue non-empty in {sum(w > 0 for w in waiting)}/{len(waiting)} samples")
    return result


CAPACITY_WARMUP_STEPS, CAPACITY_WINDOW_STEPS = 3, 9  # trainer steps of the engine's clock


def capacity_run(wl: Workload, workdir: Path, tasks: Path, *, label: str = "") -> Result:
    """A fresh engine with the workload's arguments, saturated (`measure_capacity`). Warm-up and
    window: CAPACITY_WARMUP_STEPS and CAPACITY_WINDOW_STEPS trainer steps of the engine's clock."""
    sub = workdir / (label or "capacity").replace(" ", "_")
    sub.mkdir(exist_ok=True)
    try:
        with fleet_of(wl.engine_args(str(tasks)), 1, sub) as fleet:
            return measure_capacity(wl, fleet.engines, capacity_prompts(wl, tasks),
                                    warmup_s=CAPACITY_WARMUP_STEPS * wl.train_step_s,
                                    window_s=CAPACITY_WINDOW_STEPS * wl.train_step_s, outstanding=capacity_outstanding(wl))
    except Exception as exc:  # noqa: BLE001 - reported as "could not run", with the reason
        return Result("cap", CAPACITY, label=CAPACITY, reason=f"{type(exc).__name__}: {exc}")


def capacity_summary(r: Result, wl: Workload) -> dict[str, Any]:
    return {"repeat": r.repeat, "tokens_per_engine_s": round(r.trained_tokens_per_s, 1),
            "per_busy_engine_s": round(per_busy_s(r), 1), "tokens_per_wall_s": round(r.run_tokens_per_s, 1),
            "window": r.window, "outstanding": r.concurrency, "notes": r.notes}
