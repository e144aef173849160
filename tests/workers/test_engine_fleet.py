"""The engine client under a changing fleet (issue 32), through the session's stack (router ->
SGLang's own front -> the simulator): what it caches from a failure, an engine replaced at the
same URL, a slow router, concurrent first reads, and a cancelled request's abort.

A `Relay` (a real HTTP server on loopback) stands between the client and the stack where a test
needs a fault the stack cannot make on cue: it passes every request on, except the ones a test
tells it to fail or delay, and counts what it was asked."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from pipeline.config import parse_config
from pipeline.schema import PromptJob, SamplingParams, Task
from tests.support.engine_stack import SHARED_MODEL_CONTEXT, START_TIMEOUT_S, EngineStack, shared_stack
from tests.support.env_helpers import OneTurnSession
from tests.support.policy_helpers import trainer_started
from workers.engine import ContextOverflow, EngineClient, EngineDirectory, EngineError
from workers.envs.base import Environment, EnvSession
from workers.jobs import SoftDeadline, _within, run_episodes
from workers.settings import _build_context
from workers.sim.engine import SimConfig, serve_sim_engine
from workers.sim.tokenizer import load_test_tokenizer

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)
LIMIT = SHARED_MODEL_CONTEXT - 6  # SGLang's max_req_input_len at the stack's 4096 context
# ~2048 tokens at 1 ms a token: a request runs ~2 s unless it is aborted
LONG = dict(length_mu=7.7, length_sigma=0.01, max_filler_tokens=2048, token_latency_s=0.001, latency_sigma=0.01,
            slots=1)


@pytest.fixture
def stack() -> EngineStack:
    running = shared_stack()
    running.configure(**LONG)
    return running


@dataclass
class Relay:
    """Passes requests on to `target`; `faults[path]` is a list consumed one per request of that
    path: an int answers that status, a float waits that many seconds first."""

    target: str
    url: str = ""
    faults: dict[str, list[int | float]] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.asked.append(path)
        fault = self.faults.get(path, []).pop(0) if self.faults.get(path) else None
        if isinstance(fault, int):
            return web.json_response({"error": "relay fault"}, status=fault)
        if isinstance(fault, float):
            await asyncio.sleep(fault)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-smg-routing-key")}
        async with aiohttp.ClientSession() as session, session.request(
            request.method, f"{self.target}{request.path_qs}", data=body, headers=headers
        ) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)


@contextlib.asynccontextmanager
async def relay(target: str) -> AsyncIterator[Relay]:
    r = Relay(target)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", r.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    r.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield r
    finally:
        await runner.cleanup()


def prompt_ids(n: int = 20) -> list[int]:
    tokenizer = load_test_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n] if n > len(ids) else ids


async def freed_within(stack: EngineStack, seconds: float) -> float | None:
    """Seconds until no engine of the stack runs a request, or None if one still does after `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if sum(stack.stats(i)["running"] for i in range(len(stack.engine_urls))) == 0:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    return None


# ---------------------------------------------------------------- what is cached, and when it is read again


async def test_a_failed_server_info_read_is_not_kept_as_a_fact(stack):
    """Item 1 (fails on 2a5bbd0: the failed read was stored as limit None / no priority order for
    the life of the process, so the engine's 4090-token limit and its priority scheduling were
    never learnt)."""
    async with relay(stack.engine_urls[0]) as front, EngineClient(front.url) as client:
        front.faults.update({"/server_info": [503], "/get_server_info": [503]})  # a restarting engine, once
        assert await client.context_length() is None  # nothing known yet: the caller's own cap applies
        assert await client.context_length() == LIMIT  # asked again, and this time it answered
        assert await client.directory.priority_order() == -1
        assert front.asked.count("/server_info") == 2  # and kept once it answered
        assert await client.context_length() == LIMIT
        assert front.asked.count("/server_info") == 2


async def test_an_engine_replaced_at_the_same_url_with_a_smaller_context_is_read_again(stack):
    """Item 2 (fails on 2a5bbd0: facts were keyed by URL and kept for ever, so the replacement's
    2048-token context was never read and every long episode ended on a 400). slime's recover()
    restarts engines on ports counted again from 15000: the URL often stays. Here the relay's URL
    is the engine's: first a stack engine (4096), then a 2048-token engine behind the same URL."""
    async with relay(stack.engine_urls[0]) as front, serve_sim_engine(SimConfig(context_length=2048)) as small:
        async with EngineClient(front.url, max_retries=0) as client:
            assert await client.context_length() == LIMIT
            front.target = small.url  # the engine restarts: same URL, another --context-length
            front.faults["/workers"] = [404] * 10  # what SGLang's front answers (the simulator lists itself)
            with pytest.raises(ContextOverflow):  # sized for the old engine: the new one refuses it
                await client.generate(prompt_ids(3000), SamplingParams(max_new_tokens=16), rid="r", routing_key="k")
            assert await client.context_length() == 2048  # the overflow made it read the engine again
        front.target = stack.engine_urls[0]
        async with EngineClient(front.url) as client:  # and with no overflow: once its facts are refresh_s old
            client.directory = EngineDirectory(client, refresh_s=0.3)
            assert await client.context_length() == LIMIT
            front.target = small.url
            front.faults["/workers"] = [404] * 10
            await asyncio.sleep(0.4)
            assert await client.context_length() == 2048


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
async def test_a_router_slow_to_list_its_engines_is_never_taken_for_an_engine(stack, router):
    """Item 3 (fails on 2a5bbd0: a `/workers` read that timed out put the router's URL in the
    engine list for 30 s: the abort of a timed-out request went to the router, a 404, and the
    engine ran the request to its end for nobody)."""
    async with relay(stack.router_urls[router]) as front:
        async with EngineClient(front.url, timeout_s=0.3, max_retries=0, control_timeout_s=0.5) as client:
            assert sorted(await client.directory.engines()) == sorted(stack.engine_urls)
            front.faults["/workers"] = [2.0]  # the next read of the list times out (a router busy with joins)
            client.directory.invalidate()  # the 30 s refresh, due now
            assert sorted(await client.directory.engines()) == sorted(stack.engine_urls)  # the last list stands
            front.faults["/workers"] = [2.0]
            client.directory.invalidate()
            with pytest.raises(EngineError, match="within 0.3s"):
                await client.generate(prompt_ids(), SamplingParams(max_new_tokens=3000), rid="slow", routing_key="s")
            assert await freed_within(stack, 1.5) is not None, "the engine still runs the request"
        assert "/abort_request" not in front.asked  # never the router
        assert sum(stack.stats(i)["aborted"] for i in range(len(stack.engine_urls))) == 1


async def test_a_router_that_has_not_answered_yet_gets_no_abort_either(stack):
    """Item 3, the first read: the list was never read and the read times out; the abort asks again
    instead of sending itself to the router."""
    async with relay(stack.router_url) as front:
        async with EngineClient(front.url, timeout_s=0.3, max_retries=0, control_timeout_s=0.3) as client:
            front.faults["/workers"] = [1.0]
            assert await client.directory.engines() == []  # unknown: no engine to name, not the router
            front.faults["/workers"] = [1.0]
            with pytest.raises(EngineError, match="within 0.3s"):
                await client.generate(prompt_ids(), SamplingParams(max_new_tokens=3000), rid="slow", routing_key="s")
            assert await freed_within(stack, 1.5) is not None, "the engine still runs the request"
        assert "/abort_request" not in front.asked


async def test_64_concurrent_first_reads_make_one_read_per_engine(stack):
    """Item 4 (fails on 2a5bbd0: 64 `/workers` and 128 `/server_info` reads): a worker starting
    its episodes all at once asks the router once and each engine once."""
    async with relay(stack.router_url) as front, EngineClient(front.url) as client:
        asked: list[str] = []
        get_json = client.get_json

        async def counting(url: str):  # the directory's reads, and where they went
            asked.append(url)
            return await get_json(url)

        client.get_json = counting  # type: ignore[method-assign]
        limits = await asyncio.gather(*(client.context_length() for _ in range(64)),
                                      *(client.directory.priority_order() for _ in range(64)))
    assert limits[:64] == [LIMIT] * 64 and limits[64:] == [-1] * 64
    assert front.asked.count("/workers") == 1
    assert sorted(u for u in asked if u.endswith("/server_info")) == sorted(f"{u}/server_info" for u in stack.engine_urls)


# ---------------------------------------------------------------- a cancelled request is aborted


class OneSlowEpisodeThenABug(Environment):
    """The first episode's session is a plain one-turn session (its turn runs ~2 s); the second
    raises a bug 0.3 s in: its sibling is cancelled with the group (jobs.run_episodes)."""

    started = 0

    async def start(self, task: Task) -> EnvSession:
        type(self).started += 1
        if type(self).started % 2 == 0:
            await asyncio.sleep(0.3)
            raise TypeError("a bug in the environment")
        return OneTurnSession(task)


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
async def test_a_soft_deadline_aborts_the_episodes_request_through_the_router(stack, router, redis, redis_url, keys):
    """Item 5 (fails on 2a5bbd0: a cancelled call sent no /abort_request; the slot stayed busy
    until SGLang's own disconnect poll, ~3.5 s, or the generation's end)."""
    config = parse_config({"redis": {"url": redis_url, "namespace": keys.ns},
                           "engine": {"url": stack.router_urls[router], "max_retries": 0},
                           "rollout": {"max_response_tokens": 3000, "n_samples_per_prompt": 1},
                           "environments": {"calc": {"kind": "calculator"}}})
    await trainer_started(redis, keys)
    w = await _build_context(config, keys, "w-soft")
    try:
        task = Task(id="t1", env="calc", prompt="What is 6 * 7?", label="42")
        job = PromptJob(task=task, epoch=0, n_samples=1, admission_version=0)
        with pytest.raises(SoftDeadline):
            await _within(run_episodes(w, job, 1), 0.5)  # what run_group does at its soft deadline
        assert await freed_within(stack, 1.0) is not None, "the slot was still busy 1 s after the deadline"
        assert sum(stack.stats(i)["aborted"] for i in range(len(stack.engine_urls))) == 1
    finally:
        await w.aclose()


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
async def test_a_sibling_cancelled_with_its_group_is_aborted_through_the_router(stack, router, redis, redis_url, keys):
    """Item 5: one episode of a group raises a bug, run_episodes cancels the others; their
    requests are aborted at the engine (fails on 2a5bbd0: they ran on for nobody)."""
    config = parse_config({"redis": {"url": redis_url, "namespace": keys.ns},
                           "engine": {"url": stack.router_urls[router], "max_retries": 0},
                           "rollout": {"max_response_tokens": 3000, "n_samples_per_prompt": 2},
                           "environments": {"slow": {"kind": f"{__name__}.OneSlowEpisodeThenABug"}}})
    await trainer_started(redis, keys)
    w = await _build_context(config, keys, "w-sibling")
    OneSlowEpisodeThenABug.started = 0
    try:
        job = PromptJob(task=Task(id="t2", env="slow", prompt="What is 6 * 7?"), epoch=0, n_samples=2,
                        admission_version=0)
        with pytest.raises(TypeError, match="a bug in the environment"):
            await run_episodes(w, job, 1)
        assert await freed_within(stack, 1.0) is not None, "the sibling's slot was still busy 1 s after the cancel"
        assert sum(stack.stats(i)["aborted"] for i in range(len(stack.engine_urls))) == 1
    finally:
        await w.aclose()


# ---------------------------------------------------------------- per-token policy versions


async def test_a_call_that_lives_through_a_weight_update_keeps_each_tokens_version(stack, redis, keys):
    """Item 7 (fails on 2a5bbd0: the sample kept one label per call, so every token of a call
    paused in place across a weight push counted as the older version and the lag metrics could
    not tell): SGLang's `/pause_generation {"mode": "in_place"}`, a push, `/continue_generation`;
    the answer's `meta_info.weight_versions` spans become per-token versions in the sample, and
    the trainer's batch metrics count each token at its own lag."""
    from pipeline.schema import SampleGroup, decode_group, encode
    from pipeline.slime.data_source import METRIC_PREFIX, BatchStats
    from pipeline.state import PipelineState, PolicyClock
    from workers.chat import ChatTokens
    from workers.envs.registry import build_environment
    from workers.episode import EpisodeRunner, EpisodeSettings

    stack.configure(**{**LONG, "token_latency_s": 0.002})  # ~4 s of generation: time to push mid-call
    state = PipelineState(redis, keys)
    run = await state.begin_run()
    # slime's labels: the engines hold "default" = version 0; the next push, labelled "1", is version 1
    await state.publish_policy(run=run, start=0, engine_version=0, rollout_id=0, labels={"default": 0, "1": 1})
    config = parse_config({"rollout": {"max_response_tokens": 3000}})
    env_config = parse_config({"environments": {"calc": {"kind": "calculator"}}}).env("calc")
    env = build_environment("calc", env_config)
    task = Task(id="v1", env="calc", prompt="What is 6 * 7?", label="42")
    async with EngineClient(stack.router_url, max_retries=0, clock=PolicyClock(state)) as client:
        runner = EpisodeRunner(client, ChatTokens(load_test_tokenizer()), env,
                               EpisodeSettings.from_config(config, env_config, SamplingParams()))
        episode = asyncio.create_task(runner.run(task, "v1:0/0/1"))
        await asyncio.sleep(1.5)
        async with aiohttp.ClientSession() as http:
            for path, body in (("/pause_generation", {"mode": "in_place"}),
                               ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
                               ("/continue_generation", {})):
                for url in stack.engine_urls:
                    async with http.post(f"{url}{path}", json=body) as r:
                        assert r.status == 200, await r.text()
        sample = await episode
    assert sample.metadata["turn_log"][0]["weight_versions"] == ["default", "1"]  # one call, two policies
    versions = sample.token_versions()
    model = versions[sample.loss_mask_array() == 1]
    old, new = int((model == 0).sum()), int((model == 1).sum())
    assert old > 100 and new > 100 and old + new == len(model), (old, new)
    assert list(model) == sorted(model)  # version 0 first, then 1
    # on the wire and back (an old payload without the field still decodes: test_schema)
    group = decode_group(encode(SampleGroup(group_id="v1:0", task=task, admission_version=0, n_samples=1,
                                            samples=[sample])))
    assert group.token_version_counts() == {0: old, 1: new}
    stats = BatchStats()
    stats.add_token_lags(group, 1, {}, run)  # what the data source does for a group it trains at version 1
    metrics = stats.metrics(0, 0, {})
    assert metrics[f"{METRIC_PREFIX}/token_staleness_mean"] == pytest.approx(old / (old + new))
    assert metrics[f"{METRIC_PREFIX}/token_staleness_max"] == 1
