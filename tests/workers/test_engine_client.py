"""SGLang client over real HTTP: through slime's router (smg) -> SGLang 0.5.23's own HTTP front ->
the simulator as scheduler (tests/support/engine_stack.py; 5xx and 400s are the scheduler's aborts, which
SGLang's front answers), and against the simulator alone where a test needs what the front cannot
be (garbage 200s, a proxy's HTML page, an engine replaced at the same port, a closed port, a frozen one)."""

import asyncio
import contextlib
import dataclasses
import socket
import time
from types import SimpleNamespace

import pytest

from pipeline.config import EnvConfig, parse_config
from pipeline.schema import SamplingParams, Status, Task
from pipeline.state import PipelineState
from pipeline.store.jobqueue import RemoteJobError, job_deserializer, job_serializer
from pipeline.store.local_redis import free_port
from tests.support.engine_stack import SHARED_MODEL_CONTEXT, SPARE_CONTEXT, START_TIMEOUT_S, shared_stack
from workers.chat import ChatTokens
from workers.engine import BadRequest, ContextOverflow, EngineClient, EngineError, EngineFacts, EngineLocator
from workers.envs.registry import build_environment
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.sim.engine import SimConfig, serve_sim_engine
from workers.sim.tokenizer import load_test_tokenizer

# a test's timeout includes the module's stack start (engine_stack.START_TIMEOUT_S at most)
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)
MODEL_CONTEXT = SHARED_MODEL_CONTEXT  # the engines get no --context-length, as slime's
# ~2048 filler tokens per turn at 1 ms a token: two turns of a tool episode pass 4096 tokens
STACK_SIM = dict(accuracy=1.0, tool_use=1.0, length_mu=7.7, length_sigma=0.01, max_filler_tokens=2048,
                 token_latency_s=0.001, latency_sigma=0.01, slots=1)


@pytest.fixture(scope="module")
def tokenizer():
    return load_test_tokenizer()


@pytest.fixture
def stack():
    """smg in front of two SGLang fronts at a 4096-token model context (the session's stack),
    one slot each."""
    running = shared_stack()
    running.configure(**STACK_SIM)
    return running


def prompt_ids(tokenizer, text="What is 6 * 7?"):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


async def post(client: EngineClient, path: str, body: dict) -> dict:
    url = await client.locator.get()
    async with client.session.post(f"{url}{path}", json=body) as resp:
        return await resp.json()


async def stats(client: EngineClient) -> dict:
    url = await client.locator.get()
    async with client.session.get(f"{url}/sim/stats") as resp:
        return await resp.json()


async def test_generate_through_the_router_returns_ids_logprobs_and_the_routing_key(stack, tokenizer):
    async with EngineClient(stack.router_url) as client:
        gen = await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=3000), rid="r1",
                                    routing_key="episode-a")
        assert gen.output_ids and len(gen.output_ids) == len(gen.log_probs)
        assert all(lp <= 0.0 for lp in gen.log_probs)
        assert gen.finish == "stop" and gen.output_ids[-1] == tokenizer.eos_token_id
        assert gen.weight_version == "default"  # SGLang's label before any update
        assert tokenizer.decode(gen.output_ids, skip_special_tokens=True) == gen.text
        assert stack.total_stats()["routing_keys"] == {"episode-a": 1}  # the body's routing_key reached the scheduler


async def test_length_finish_respects_max_new_tokens(stack, tokenizer):
    async with EngineClient(stack.router_url) as client:
        gen = await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=5), rid="r", routing_key="k")
        assert gen.finish == "length" and len(gen.output_ids) == 5


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
async def test_context_limit_is_what_the_engines_behind_the_router_enforce(stack, router):
    """Issue 24, item 2 (fails on fe89cd3: only an integer `context_length` of /server_info or
    /model_info was read, both 404 through the router, so the 32768 guess stood)."""
    async with EngineClient(stack.router_urls[router]) as client:
        # SGLang: context_length null (no --context-length), max_req_input_len = 4096 - 1 - 5
        assert await client.context_length() == MODEL_CONTEXT - 6
        assert sorted(await client.directory.engines()) == sorted(stack.engine_urls)
        limits = {url: facts.limit for url, (facts, _read_at) in client.directory._facts.items()}
        assert limits == {url: MODEL_CONTEXT - 6 for url in stack.engine_urls}  # each engine asked once


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
async def test_due_order_reaches_sglangs_scheduler_as_priority_through_the_router(stack, router, tokenizer):
    """Issue 25 item 3: the engines say --enable-priority-scheduling in /server_info (SGLang's own
    front), so a request carries its group's due order as `priority` (larger first: -order), and the
    router passes it on to SGLang's front: the body the front received has it."""
    stack.configure(token_latency_s=0.0)
    async with EngineClient(stack.router_urls[router]) as client:
        assert await client.directory.priority_order() == -1
        assert await client.priority(2**40) == -(2**31)  # smg parses `priority` as an i32: clamped
        await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=3), rid="due-3", routing_key="k3",
                              due_order=3)
        await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=3), rid="free", routing_key="k4")
    by_rid = {b.get("rid"): b for b in stack.all_bodies()}
    assert by_rid["due-3"]["priority"] == -3
    assert "priority" not in by_rid["free"]
    # and SGLang's TokenizerManager handed it to the scheduler (TokenizedGenerateReqInput.priority)
    assert stack.total_stats()["priorities"] == {"due-3": -3}


async def test_an_engine_without_priority_scheduling_gets_no_priority(tmp_path):
    """Where an engine does not schedule by priority, no `priority` is sent (SGLang would ignore
    it, or refuse the request with --abort-on-priority-when-disabled)."""
    config = SimConfig(token_latency_s=0.0)
    async with serve_sim_engine(config) as sim, EngineClient(sim.url) as client:
        assert await client.directory.priority_order() is None
        assert await client.priority(5) is None
    async with serve_sim_engine(dataclasses.replace(config, priority_scheduling=True, low_priority_values_first=True)) as sim, \
            EngineClient(sim.url) as client:
        assert await client.priority(5) == 5  # lower values first: the clock itself


async def test_a_long_episode_behind_the_router_ends_truncated_by_length_never_by_a_400(stack):
    """Issue 24, item 2: an engine at a 4096 context behind the router; a multi-turn episode ends
    `truncated` with a length finish and its tokens. On fe89cd3 the client found no context (the
    router answers /server_info and /model_info with 404) and took `max_context_tokens`, 32768: the
    first turn already asked for 8192 new tokens (the response budget), SGLang's front refused it
    with a 400 (input + max_new_tokens over 4096), and the episode ended with no token at all."""
    chat = ChatTokens(load_test_tokenizer())
    config = parse_config({"rollout": {"max_response_tokens": 8192}})
    env_config = EnvConfig(kind="calculator")
    env = build_environment("calc", env_config)
    task = Task(id="calc-1", env="calc", prompt="What is 12 * (3 + 4)?", label="84")
    async with EngineClient(stack.router_url, max_retries=0) as client:
        runner = EpisodeRunner(client, chat, env, EpisodeSettings.from_config(config, env_config, SamplingParams()))
        sample = await runner.run(task, "calc-1:0/0/1")
    turns = sample.metadata["turn_log"]
    assert sample.status is Status.TRUNCATED, sample.metadata
    assert [t["finish"] for t in turns] == ["stop", "length"], turns
    assert sample.metadata["tool_calls"] == 1
    assert sample.num_tokens == MODEL_CONTEXT - 6  # the whole context the engine allows, and no more
    assert sample.response_length > 2048 + 1000  # both turns' tokens are in the sample


async def test_5xx_is_retried_then_succeeds(stack, tokenizer):
    """SGLang's front answers a request its scheduler aborted with status 503 as it answers a real
    one; the client retries it."""
    stack.sim("fail_next", {"status": 503, "count": 2}, 0)
    async with EngineClient(stack.engine_urls[0], max_retries=3, backoff_s=0.01) as client:
        gen = await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
        assert gen.output_ids
    assert stack.stats(0)["requests"] == 3


async def test_5xx_retries_are_bounded(stack, tokenizer):
    stack.sim("fail_next", {"status": 500, "count": 10, "message": "engine on fire"}, 0)
    async with EngineClient(stack.engine_urls[0], max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(EngineError, match="gave up after 3 attempts.*engine on fire"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
    assert stack.stats(0)["requests"] == 3


async def test_400_bad_params_is_not_retried_and_keeps_the_message(stack, tokenizer):
    """A 400 SGLang's scheduler answers, as its front passes it on: not retried, the message kept."""
    async with EngineClient(stack.engine_urls[0], max_retries=3, backoff_s=0.01) as client:
        stack.sim("fail_next", {"status": 400, "message": "unknown field `foo`"}, 0)
        with pytest.raises(BadRequest, match="unknown field `foo`"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
    assert stack.stats(0)["requests"] == 1


async def test_400_context_overflow_is_its_own_error(stack, tokenizer):
    """SGLang's three refusals of a request over the context, each a ContextOverflow (episode
    truncated), none retried: the front's two (`_validate_one_request`) and the scheduler's
    (`validate_input_length`, at max_req_input_len)."""
    async with EngineClient(stack.router_url, backoff_s=0.01) as client:
        ids = prompt_ids(tokenizer)
        cases = [
            (ids * 300, SamplingParams(max_new_tokens=8), "longer than the model's context length"),
            (ids, SamplingParams(max_new_tokens=MODEL_CONTEXT), "exceeds the model's maximum context length"),
            ([ids[0]] * (MODEL_CONTEXT - 6), SamplingParams(max_new_tokens=1), "exceeds the maximum allowed length"),
        ]
        for i, (input_ids, sampling, message) in enumerate(cases):
            with pytest.raises(ContextOverflow, match=message):
                await client.generate(input_ids, sampling, rid=f"over-{i}", routing_key="k")


async def test_connection_refused_is_retried_then_fails():
    client = EngineClient(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01)
    async with client:
        with pytest.raises(EngineError, match="gave up after 3 attempts: connection error"):
            await client.generate([1, 2, 3], SAMPLING, rid="r", routing_key="k")


async def test_undecodable_200_is_retried_like_a_5xx(tokenizer):
    async with serve_sim_engine() as sim, EngineClient(sim.url, max_retries=2, backoff_s=0.01) as client:
        await post(client, "/sim/fail_next", {"status": 200, "count": 2})  # 200 with a non-/generate JSON body
        gen = await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
        assert gen.output_ids and (await stats(client))["requests"] == 3
        await post(client, "/sim/fail_next", {"status": 200, "count": 3})
        with pytest.raises(EngineError, match="gave up after 3 attempts: undecodable /generate answer"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r2", routing_key="k")


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
async def test_a_timed_out_request_frees_its_engine_slot_within_a_second_through_the_router(stack, tokenizer, router):
    """Issue 24, item 3 (fails on fe89cd3: the abort went to the router's /abort_request, a 404,
    and the engine kept generating ~2 s for nobody; the abort task was not held either)."""
    async with EngineClient(stack.router_urls[router], timeout_s=0.3, max_retries=0) as client:
        started = time.monotonic()
        with pytest.raises(EngineError, match="no answer .* within 0.3s"):  # ~2048 tokens at 1 ms: ~2 s
            await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=3000), rid="slow",
                                  routing_key="slow-episode")
        held = len(getattr(client, "_control_tasks", ()))  # the abort under way, referenced by the client
        freed = None
        while time.monotonic() - started < 0.3 + 1.0:
            counts = [stack.stats(i) for i in range(len(stack.engine_urls))]
            if sum(c["running"] for c in counts) == 0:
                freed = time.monotonic() - started
                break
            await asyncio.sleep(0.05)
        assert freed is not None, f"the slot was still busy 1 s after the timeout: {counts}"
        assert sum(c["aborted"] for c in counts) == 1
        assert held == 1 and not client._control_tasks  # held while it ran, let go when done
        gen = await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=5), rid="next",
                                    routing_key="slow-episode")  # the one slot serves the next request
        assert gen.finish == "length"


async def test_auto_url_follows_the_engine_key(redis, keys, tokenizer):
    state = PipelineState(redis, keys)
    async with serve_sim_engine(SimConfig(weight_version="a")) as first, serve_sim_engine(
        SimConfig(weight_version="b")
    ) as second:
        locator = EngineLocator("auto", state, refresh_s=0.0)
        waiting = asyncio.create_task(locator.get())  # no URL yet: it waits, it does not fail episodes
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await state.set_engine(first.url)
        assert await asyncio.wait_for(waiting, 5) == first.url
        async with EngineClient(locator) as client:
            ids = prompt_ids(tokenizer)
            assert (await client.generate(ids, SAMPLING, rid="1", routing_key="k")).weight_version == "a"
            await state.set_engine(second.url)
            assert (await client.generate(ids, SAMPLING, rid="2", routing_key="k")).weight_version == "b"


def test_job_serializer_round_trips_results_and_exceptions():
    job = {"t": 1, "f": "run_group", "a": [b"\x81\xa1x\x01"], "k": {}, "et": 123}
    assert job_deserializer(job_serializer(job)) == job
    cancelled = job_deserializer(job_serializer({**job, "s": False, "r": asyncio.CancelledError()}))
    assert isinstance(cancelled["r"], asyncio.CancelledError)  # what Job.abort() waits for
    failed = job_deserializer(job_serializer({**job, "s": False, "r": ValueError("bad thing")}))
    assert isinstance(failed["r"], RemoteJobError) and "ValueError: bad thing" in str(failed["r"])
    with pytest.raises(TypeError, match="cannot encode object"):
        job_serializer({**job, "r": object()})


async def test_an_engine_that_joins_the_router_is_asked_for_its_limit_and_the_others_are_not(stack):
    """A smaller engine (SGLang's front at --context-length 2048: it refuses an input of 2042
    tokens or more) registered with smg at run time (POST /workers, as slime registers its
    engines) lowers the limit at the next read of the list, and is asked once."""
    import aiohttp

    router = stack.router_url
    asked: list[str] = []
    small = SimpleNamespace(url=stack.spare_urls[0])
    async with EngineClient(router) as client:
        get_json = client.get_json

        async def counting(url: str):
            asked.append(url)
            return await get_json(url)

        client.get_json = counting  # type: ignore[method-assign]
        assert await client.context_length() == MODEL_CONTEXT - 6
        workers: list = []
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{router}/workers", json={"url": small.url}) as resp:
                assert resp.status < 300, await resp.text()
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    async with session.get(f"{router}/workers") as resp:
                        workers = (await resp.json())["workers"]
                    if any(w["url"] == small.url and w.get("is_healthy") for w in workers):
                        break
                    await asyncio.sleep(0.2)
                client.directory.invalidate()  # what the next 30 s refresh, a connection error or an overflow does
                assert await client.context_length() == SPARE_CONTEXT - 6  # max_req_input_len: 2048 - 1 - 5
            finally:
                ids = [w["id"] for w in workers if w["url"] == small.url]
                for worker_id in ids:
                    async with session.delete(f"{router}/workers/{worker_id}") as resp:
                        assert resp.status < 300, await resp.text()
                while any(w["url"] == small.url for w in workers):
                    await asyncio.sleep(0.2)
                    async with session.get(f"{router}/workers") as resp:
                        workers = (await resp.json())["workers"]
    info_reads = [url for url in asked if url.endswith("server_info")]
    # each engine asked once per read of the fleet (invalidate() drops every fact: issue 32)
    assert sorted(info_reads) == sorted([f"{u}/server_info" for u in stack.engine_urls] * 2 + [f"{small.url}/server_info"])


# ------------------------------------------------------------ facts that were not read (issue 39, items 1-4)


@contextlib.asynccontextmanager
async def frozen_engine():
    """What a frozen engine (SIGSTOPped, or a /server_info that waits on a stuck scheduler) is on
    the wire: the kernel completes the TCP handshake and queues the request; nothing answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@contextlib.asynccontextmanager
async def proxy_to(upstream: str):
    """A reverse proxy in front of `upstream` that, while `broken` holds, answers every GET with
    200 and its HTML error page (a misconfigured proxy, a captive portal)."""
    import aiohttp
    from aiohttp import web

    state = {"broken": True}
    async with aiohttp.ClientSession() as session:

        async def forward(request: web.Request) -> web.Response:
            if state["broken"]:
                return web.Response(status=200, text="<html><body>upstream error</body></html>", content_type="text/html")
            async with session.get(f"{upstream}{request.path}") as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)

        app = web.Application()
        app.router.add_get("/{path:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", state
        finally:
            await runner.cleanup()


async def test_a_200_that_is_not_json_is_no_fact_and_no_engine(monkeypatch):
    """Issue 39 item 1 (fails on e13e9eb: a /server_info 200 with an HTML body was kept as
    EngineFacts(None, None) for 30 s, and the same page from /workers made the URL an engine)."""
    monkeypatch.setattr("workers.engine._FACTS_RETRY_S", 0.05, raising=False)  # the backoffs after a failed read
    monkeypatch.setattr("workers.engine._LIST_RETRY_S", 0.05)
    async with serve_sim_engine(SimConfig(context_length=8000)) as sim, proxy_to(sim.url) as (url, proxy), \
            EngineClient(url) as client:
        assert await client.directory.engines() == []  # an HTML page at /workers names no engine
        assert await client.directory.facts_of(url) == EngineFacts()  # and says no context
        assert url not in client.directory._facts
        proxy["broken"] = False  # the proxy heals: the next read after the backoff is the engine's
        await asyncio.sleep(0.1)
        assert await client.directory.facts_of(url) == EngineFacts(limit=8000)
        assert await client.directory.engines() == [sim.url]  # the sim lists itself (as slime's router would)


async def test_a_read_under_way_at_invalidate_is_neither_joined_nor_kept():
    """Issue 39 item 2 (fails on e13e9eb: callers after `invalidate()` joined the read started
    before it, keyed by URL only, and its answer was kept with a fresh time: the engine replaced
    at the same URL by one with a 2048 context stayed at 8000)."""
    port = free_port()
    held, release = asyncio.Event(), asyncio.Event()
    async with EngineClient(f"http://127.0.0.1:{port}") as client:
        get_json = client.get_json

        async def late(url: str):  # the old engine's answer arrives after the fleet changed
            answer = await get_json(url)
            if not held.is_set():
                held.set()
                await release.wait()
            return answer

        client.get_json = late  # type: ignore[method-assign]
        async with serve_sim_engine(SimConfig(context_length=8000), port=port):
            before = asyncio.create_task(client.directory.limit_of(client.locator._fixed))
            await held.wait()
        async with serve_sim_engine(SimConfig(context_length=2048), port=port):
            client.directory.invalidate()  # the engine was replaced: what a connection error calls
            after = asyncio.create_task(client.directory.limit_of(client.locator._fixed))
            done, _ = await asyncio.wait({after}, timeout=5)
            assert done, "the read after invalidate() waited for the one before it"
            release.set()
            assert await before == 8000  # its own caller gets what it asked for
            assert await after == 2048
            assert await client.context_length() == 2048  # the old answer was not kept


async def test_a_hung_server_info_is_not_waited_for_at_every_request(monkeypatch):
    """Issue 39 item 3 (fails on e13e9eb: no backoff after a failed read, so every request's
    `priority()` waited `control_timeout_s` on an engine whose /server_info hangs, or on a router
    whose /workers does)."""
    async with frozen_engine() as url, EngineClient(url, control_timeout_s=0.3) as client:
        for read in (lambda: client.directory.facts_of(url), lambda: client.priority(5)):
            started = time.monotonic()
            assert await read() in (EngineFacts(), None)  # the one read: no answer within 0.3 s
            assert 0.3 <= time.monotonic() - started < 1.0
            started = time.monotonic()
            for _ in range(5):  # the next requests go without the facts instead of waiting again
                assert await read() in (EngineFacts(), None)
            assert time.monotonic() - started < 0.1


async def test_close_with_an_abort_pending_leaves_no_session_open():
    """Issue 39 item 4 (fails on e13e9eb: close() closed the session while an abort was still
    reading the engine list; the abort then opened a new ClientSession through `session` that
    nobody closed)."""
    async with frozen_engine() as url:
        client = EngineClient(url, control_timeout_s=0.2)
        client._hold(asyncio.create_task(client.abort("rid-1")))
        await client.close()
        first = client._session
        assert not client._control_tasks  # nothing of the client runs past close()
        await asyncio.sleep(0.5)  # past where the abort would read the list again
        assert client._session is first and (first is None or first.closed)


# ------------------------------------------------------------ SGLang's own rules in the front (issue 39, item 5)


async def test_max_new_tokens_null_is_sglangs_unset(stack, tokenizer):
    """Issue 39 item 5: `max_new_tokens: null` is SGLang's scheduler's 1 << 30, clipped to what the
    engine allows (`Scheduler.init_req_max_new_tokens`, run by the stack); fails on e13e9eb, where
    the stack's copy took 128 and cut a 300-token answer at 128 with a length finish."""
    stack.configure(length_mu=5.7, length_sigma=0.01)  # ~300 filler tokens
    async with EngineClient(stack.engine_urls[0]) as client:
        answer = await post(client, "/generate", {"input_ids": prompt_ids(tokenizer), "rid": "unset",
                                                   "sampling_params": {"max_new_tokens": None}})
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] > 128, meta


async def test_every_finished_request_carries_sglangs_version_spans(stack, tokenizer):
    """Issue 39 item 5: SGLang sends `meta_info.weight_versions` for every finished request, and
    records a weight update only for a request that has output (`record_weight_version_events`).
    Fails on e13e9eb: spans only when there were two or more, and a request still queued at an
    in_place update got a zero-token span of the old label."""
    stack.configure(slots=1, token_latency_s=0.005, length_mu=4.5, length_sigma=0.01)  # ~90 tokens, ~0.5 s
    engine = stack.engine_urls[0]
    async with EngineClient(engine) as client:
        plain = await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=3), rid="plain", routing_key="k")
        assert plain.version_spans == (("default", 0, 3),)
        answer = await post(client, "/generate", {"input_ids": prompt_ids(tokenizer), "rid": "raw",
                                                   "sampling_params": {"max_new_tokens": 3}})
        assert answer["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
        running = asyncio.create_task(client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=200),
                                                      rid="running", routing_key="a"))
        await asyncio.sleep(0.2)  # it runs; the next one waits for the engine's one slot
        queued = asyncio.create_task(client.generate(prompt_ids(tokenizer, "What is 2 + 2?"),
                                                     SamplingParams(max_new_tokens=200), rid="queued", routing_key="b"))
        await asyncio.sleep(0.1)
        try:
            await post(client, "/pause_generation", {"mode": "in_place"})
            await post(client, "/update_weight_version", {"new_version": "2", "abort_all_requests": False})
        finally:
            await post(client, "/continue_generation", {})
        first, second = await running, await queued
    assert [label for label, _, _ in first.version_spans] == ["default", "2"], first.version_spans
    assert second.version_spans == (("2", 0, len(second.output_ids)),)  # no output under "default"
