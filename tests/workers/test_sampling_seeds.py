"""Seeds and integer fields as the engines and slime's router take them (issue 24, item 4).

SGLang 0.5.23 reads `sampling_seed` only under `--enable-deterministic-inference`, and then
seeds every request (42 when it sends none); slime's router (smg 1.13.0) reads the seed as
u64 and `max_new_tokens` as an integer, answering 422 otherwise. The config refuses a seed
that would do nothing, deterministic inference without a seed, and a negative seed; every
sampling body the client builds (per-turn copies included) is checked again; the seeds a
real worker sends for one group are distinct, non-negative integers (recorded on the wire
by a proxy between the worker and the simulated engine).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import pytest
from aiohttp import web

from pipeline.config import ConfigError, parse_config
from pipeline.schema import PromptJob, SamplingParams, SchemaError, Task
from tests.support.engine_stack import START_TIMEOUT_S, shared_stack
from tests.support.policy_helpers import trainer_started
from workers.chat import ChatTokens
from workers.jobs import run_episodes
from workers.settings import _build_context
from workers.sim.engine import serve_sim_engine
from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

N = 4


def test_a_seed_without_deterministic_inference_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="does nothing.*--enable-deterministic-inference") as info:
        parse_config({"rollout": {"sampling": {"sampling_seed": 7}}})
    assert "\n" not in str(info.value)  # one line


def test_deterministic_inference_without_a_seed_is_refused():
    """SGLang would seed every request 42: all samples of a group identical."""
    with pytest.raises(ConfigError, match="identical"):
        parse_config({"engine": {"deterministic_inference": True}})


def test_a_seed_with_deterministic_inference_is_accepted():
    config = parse_config({"engine": {"deterministic_inference": True}, "rollout": {"sampling": {"sampling_seed": 7}}})
    assert config.rollout.sampling.sampling_seed == 7


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_a_seed_the_router_refuses_is_refused_at_load(seed):
    with pytest.raises(ConfigError, match=r"sampling_seed must be in \[0, 2\*\*63 - 1\]"):
        parse_config({"engine": {"deterministic_inference": True}, "rollout": {"sampling": {"sampling_seed": seed}}})


def test_room_for_every_samples_seed():
    top = 2**63 - 1
    with pytest.raises(ConfigError, match="exceeds"):
        parse_config({"engine": {"deterministic_inference": True},
                      "rollout": {"n_samples_per_prompt": N, "sampling": {"sampling_seed": top - N + 2}}})
    parse_config({"engine": {"deterministic_inference": True},
                  "rollout": {"n_samples_per_prompt": N, "sampling": {"sampling_seed": top - N + 1}}})


@pytest.mark.parametrize("change", [{"max_new_tokens": 8.0}, {"min_new_tokens": 1.5}, {"sampling_seed": -3},
                                    {"max_new_tokens": True}])
def test_a_copy_with_a_value_the_router_refuses_cannot_be_built(change):
    """The episode runner derives each request's params with `msgspec.structs.replace`, which
    skips msgspec's type checks: `__post_init__` checks the router's rules again."""
    base = SamplingParams(temperature=1.0, max_new_tokens=16)
    with pytest.raises(SchemaError, match=next(iter(change))):
        msgspec.structs.replace(base, **change)


@asynccontextmanager
async def recording_proxy(target: str) -> AsyncIterator[tuple[str, list[dict]]]:
    """A loopback HTTP proxy that keeps every JSON body POSTed to /generate, as sent."""
    bodies: list[dict] = []
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.path == "/generate":
            bodies.append(json.loads(raw))
        async with session.request(request.method, target + request.path_qs, data=raw or None,
                                   headers={k: v for k, v in request.headers.items() if k.lower() != "host"}) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        await runner.cleanup()
        await session.close()


async def test_a_groups_seeds_on_the_wire_are_distinct_non_negative_integers(redis, redis_url, keys, namespace):
    """One group through the worker's own job code (`run_episodes`): every `/generate` body
    carries a u64-safe integer seed, one per episode, none shared within the group, and an
    integer `max_new_tokens`."""
    await trainer_started(redis, keys)
    async with serve_sim_engine() as sim, recording_proxy(sim.url) as (url, bodies):
        group = await _seeded_group(redis_url, namespace, keys, {"url": url}, seed=0, task_id="seeded")
    assert len(group.samples) == N and bodies
    seed_of_episode: dict[str, set[int]] = {}
    for body in bodies:
        params = body["sampling_params"]
        assert type(params["max_new_tokens"]) is int and type(params["sampling_seed"]) is int
        assert 0 <= params["sampling_seed"] <= 2**63 - 1
        episode = body["rid"].split(":t")[0]  # `{job}/{episode}/{try}:t{turn}.{resume}`
        seed_of_episode.setdefault(episode, set()).add(params["sampling_seed"])
    assert len(seed_of_episode) == N
    assert all(len(seeds) == 1 for seeds in seed_of_episode.values()), seed_of_episode  # one seed per episode
    assert len({seed for seeds in seed_of_episode.values() for seed in seeds}) == N  # none shared in the group


async def _post_status(url: str, body: dict) -> int:
    async with aiohttp.ClientSession() as http, http.post(f"{url}/generate", json=body) as r:
        await r.read()
        return r.status


@pytest.mark.timeout(START_TIMEOUT_S + 120)
async def test_seeds_through_slimes_router_and_sglangs_front(redis, redis_url, keys, namespace):
    """The real path (tests/support/engine_stack.py: smg -> SGLang 0.5.23's own front -> the simulator):
    smg refuses (422 text/plain) the negative seed SGLang takes and the float `max_new_tokens`
    SGLang refuses with its own 400 (why the pipeline never sends either); a seeded group run by the worker's job code through it has every
    body admitted, one seed per episode, none shared."""
    stack = await asyncio.to_thread(shared_stack)
    stack.configure()
    ids = ChatTokens(load_test_tokenizer()).prompt_ids([{"role": "user", "content": "What is 6 * 7?"}], None)
    # (params, what the router answers, what SGLang's front answers)
    for params, router, front in (({"max_new_tokens": 4, "sampling_seed": -1}, 422, 200),
                                  ({"max_new_tokens": 4.0}, 422, 400)):
        assert await _post_status(stack.router_url, {"input_ids": ids, "sampling_params": params}) == router, params
        assert await _post_status(stack.engine_urls[0], {"input_ids": ids, "sampling_params": params}) == front, params
    stack.configure()  # a clean slate of kept bodies

    await trainer_started(redis, keys)
    group = await _seeded_group(redis_url, namespace, keys,
                                {"url": stack.router_url, "tokenizer": default_tokenizer_path()},
                                seed=2**63 - N, task_id="seeded-router")
    assert all(s.response_length > 0 and "error" not in s.metadata for s in group.samples), \
        [s.metadata.get("error") for s in group.samples]
    seeds = {body["rid"].split(":t")[0]: body["sampling_params"]["sampling_seed"] for body in stack.all_bodies()}
    assert sorted(seeds.values()) == [2**63 - N + i for i in range(N)]


async def _seeded_group(redis_url, namespace, keys, engine: dict, *, seed: int, task_id: str):
    """One calculator group of N samples run by the real episode runner with `sampling_seed` = seed
    and deterministic inference on, against the engine at engine["url"]."""
    config = parse_config({
        "redis": {"url": redis_url, "namespace": namespace},
        "engine": {**engine, "deterministic_inference": True},
        "rollout": {"n_samples_per_prompt": N, "max_response_tokens": 256, "sampling": {"sampling_seed": seed}},
        "environments": {"calc": {"kind": "calculator"}},
    })
    task = Task(id=task_id, env="calc", prompt="What is 6 * 7?", label="42")
    job = PromptJob(task=task, epoch=0, n_samples=N, sampling=config.rollout.sampling, enqueued_at=time.time())
    context = await _build_context(config, keys, "seeds")
    try:
        return await run_episodes(context, job, 1)
    finally:
        await context.aclose()
