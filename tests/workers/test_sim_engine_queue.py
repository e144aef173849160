"""The simulated engine when requests arrive together (issue 25's frontier runs slime's fully async
rollout at 2x and 4x the slots): no two requests share a request id. Counts, not times."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from workers.sim.engine import SimConfig, serve_sim_engine


@pytest.mark.asyncio
async def test_a_request_whose_body_comes_late_keeps_its_own_rid():
    """Without a rid the engine names a request by its number. It took the number after reading
    the body, so a request whose body came in a later TCP segment took the number of one that
    arrived meanwhile: both ran under one rid and the first to finish removed the other's entry
    (KeyError, HTTP 500: 20 of them in a fully-async run at 2x the slots)."""
    config = SimConfig(slots=4, token_latency_s=0.002, length_mu=3.0, length_sigma=0.1)
    async with serve_sim_engine(config) as sim, aiohttp.ClientSession() as session:
        prompt = sim.engine.tokenizer.encode("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
        body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 64}}).encode()
        arrived = asyncio.Event()

        async def slow_body():
            yield body[:10]
            await arrived.wait()  # the second request is in before the rest of this body
            yield body[10:]

        async def post(data, key: str) -> tuple[int, str]:
            headers = {"X-SMG-Routing-Key": key, "Content-Type": "application/json"}
            async with session.post(f"{sim.url}/generate", data=data, headers=headers) as reply:
                return reply.status, (await reply.json())["meta_info"]["id"] if reply.status == 200 else ""

        first = asyncio.create_task(post(slow_body(), "a"))
        while sim.engine.stats["requests"] < 1:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(post(body, "b"))
        while sim.engine.stats["requests"] < 2:
            await asyncio.sleep(0.01)
        arrived.set()
        answers = [await first, await second]
    assert [status for status, _ in answers] == [200, 200], answers
    assert answers[0][1] != answers[1][1], answers


@pytest.mark.asyncio
async def test_a_stopping_engine_does_not_wait_a_minute_on_requests_in_flight():
    """The demo's Ctrl-C sometimes took over 60 s: the in-process engine's aiohttp runner waited
    its default 60 s shutdown grace for /generate handlers whose clients (the worker pool) were
    already gone. It now stops as a killed SGLang process does: within twice SHUTDOWN_GRACE_S
    (aiohttp waits it once for the handler, once more after cancelling it) every connection in
    flight drops, whether its request was generating or waiting out a pause; no request is
    answered as if it had ended."""
    import time

    from workers.sim.engine import SHUTDOWN_GRACE_S

    config = SimConfig(slots=4, token_latency_s=0.05, length_mu=7.0, length_sigma=0.01, max_filler_tokens=4096)
    async with aiohttp.ClientSession() as session:
        async with serve_sim_engine(config) as sim:
            prompt = sim.engine.tokenizer.encode("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")

            async def generate(key: str) -> dict:
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4096}}
                async with session.post(f"{sim.url}/generate", json=body, headers={"X-SMG-Routing-Key": key}) as reply:
                    return await reply.json()

            running = asyncio.create_task(generate("running"))  # ~1,100 tokens at 50 ms: a minute
            while sim.engine.stats["requests"] < 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # a few tokens out
            async with session.post(f"{sim.url}/pause_generation", json={"mode": "in_place"}) as reply:
                assert reply.status == 200
            waiting = asyncio.create_task(generate("waiting"))  # arrives paused: waits for a resume
            while sim.engine.stats["requests"] < 2:
                await asyncio.sleep(0.01)
            stopping = time.monotonic()
        stopped_s = time.monotonic() - stopping
        ended = await asyncio.gather(running, waiting, return_exceptions=True)
    assert stopped_s < 2 * SHUTDOWN_GRACE_S + 3, stopped_s
    assert all(isinstance(e, aiohttp.ClientError) for e in ended), ended
