"""SGLang client against the simulated engine over real HTTP (and a closed port)."""

import asyncio

import pytest

from pipeline.jobqueue import RemoteJobError, job_deserializer, job_serializer
from pipeline.local_redis import free_port
from pipeline.schema import SamplingParams
from pipeline.state import PipelineState
from workers.engine import BadRequest, ContextOverflow, EngineClient, EngineError, EngineLocator
from workers.sim.engine import SimConfig, serve_sim_engine
from workers.sim.tokenizer import load_test_tokenizer

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)


@pytest.fixture(scope="module")
def tokenizer():
    return load_test_tokenizer()


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


async def test_generate_returns_ids_logprobs_and_routes_by_key(tokenizer):
    async with serve_sim_engine(SimConfig(weight_version="7")) as sim, EngineClient(sim.url) as client:
        gen = await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r1", routing_key="episode-a")
        assert gen.output_ids and len(gen.output_ids) == len(gen.log_probs)
        assert all(lp <= 0.0 for lp in gen.log_probs)
        assert gen.finish == "stop" and gen.output_ids[-1] == tokenizer.eos_token_id
        assert gen.weight_version == "7"
        assert tokenizer.decode(gen.output_ids, skip_special_tokens=True) == gen.text
        assert (await stats(client))["routing_keys"] == {"episode-a": 1}


async def test_length_finish_respects_max_new_tokens(tokenizer):
    async with serve_sim_engine(SimConfig(length_mu=6.0, length_sigma=0.01)) as sim, EngineClient(sim.url) as client:
        gen = await client.generate(prompt_ids(tokenizer), SamplingParams(max_new_tokens=5), rid="r", routing_key="k")
        assert gen.finish == "length" and len(gen.output_ids) == 5


async def test_5xx_is_retried_then_succeeds(tokenizer):
    async with serve_sim_engine() as sim, EngineClient(sim.url, max_retries=3, backoff_s=0.01) as client:
        await post(client, "/sim/fail_next", {"status": 503, "count": 2})
        gen = await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
        assert gen.output_ids
        assert (await stats(client))["requests"] == 3


async def test_5xx_retries_are_bounded(tokenizer):
    async with serve_sim_engine() as sim, EngineClient(sim.url, max_retries=2, backoff_s=0.01) as client:
        await post(client, "/sim/fail_next", {"status": 500, "count": 10, "message": "engine on fire"})
        with pytest.raises(EngineError, match="gave up after 3 attempts.*engine on fire"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
        assert (await stats(client))["requests"] == 3


async def test_400_bad_params_is_not_retried_and_keeps_the_message(tokenizer):
    async with serve_sim_engine() as sim, EngineClient(sim.url, max_retries=3, backoff_s=0.01) as client:
        await post(client, "/sim/fail_next", {"status": 400, "message": "unknown field `foo`"})
        with pytest.raises(BadRequest, match="unknown field `foo`"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
        assert (await stats(client))["requests"] == 1


async def test_400_context_overflow_is_its_own_error(tokenizer):
    async with serve_sim_engine(SimConfig(context_length=16)) as sim, EngineClient(sim.url, backoff_s=0.01) as client:
        with pytest.raises(ContextOverflow, match="longer than the model's context length"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="r", routing_key="k")
        assert (await stats(client))["requests"] == 1


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


async def test_request_timeout_fails_and_aborts_on_the_engine(tokenizer):
    config = SimConfig(token_latency_s=0.05, latency_sigma=0.01, length_mu=6.0, length_sigma=0.01)
    async with serve_sim_engine(config) as sim, EngineClient(sim.url, timeout_s=0.3) as client:
        with pytest.raises(EngineError, match="no answer .* within 0.3s"):
            await client.generate(prompt_ids(tokenizer), SAMPLING, rid="slow", routing_key="k")
        for _ in range(50):  # the best-effort /abort_request frees the engine's slot
            if sim.engine.stats["aborted"] == 1:
                break
            await asyncio.sleep(0.05)
        assert sim.engine.stats["aborted"] == 1


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
