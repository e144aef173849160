"""The engine client against a simulator as strict as SGLang 0.5.23 (issue 11): what SGLang
refuses, how it aborts and resumes, and what the client must do about it. Real HTTP on
loopback; the simulator's rules are SGLang's (tests/conformance/test_conformance_sglang.py holds them
against SGLang's own classes)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from pipeline.config import ConfigError, parse_config
from pipeline.schema import SamplingParams, Status, Task
from tests.workers.test_episode import runner_for
from workers.chat import ChatTokens
from workers.engine import BadRequest, ContextOverflow, EngineClient
from workers.sim.engine import SimConfig, serve_sim_engine
from workers.sim.tokenizer import load_test_tokenizer

TASK = Task(id="context-overflow-exceed-1", env="calc", prompt="What is 6 * 7?", label="42")
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def tokenizer():
    return load_test_tokenizer()


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatTokens(tokenizer)


class RecordingClient(EngineClient):
    """The real client, keeping (input ids, sampling params) of every request it made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, input_ids, sampling, *, rid, routing_key, due_order=None):
        self.calls.append((list(input_ids), sampling))
        return await super().generate(input_ids, sampling, rid=rid, routing_key=routing_key)


def prompt(tokenizer, text: str = "What is 6 * 7?") -> list[int]:
    return ChatTokens(tokenizer).prompt_ids([{"role": "user", "content": text}], None)


@contextlib.asynccontextmanager
async def dropping_proxy(target_port: int, drop_first: int = 1):
    """Forwards a request to the engine, then cuts the client off before any answer, for the
    first `drop_first` connections: the engine still runs the request (as SGLang does for a
    few seconds after a client disconnect), the client sees a connection error and retries."""
    state = {"connections": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        if state["connections"] <= drop_first:
            up_writer.write(await reader.read(65536))
            await up_writer.drain()
            await asyncio.sleep(0.1)
            writer.close()  # the engine keeps the request; its rid stays registered
            await asyncio.sleep(2.0)
            up_writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", state
    finally:
        server.close()


async def test_a_retry_after_a_lost_answer_uses_a_fresh_rid(tokenizer):
    slow = SimConfig(token_latency_s=0.02, latency_sigma=0.01, length_mu=4.0, length_sigma=0.01)
    async with serve_sim_engine(slow) as sim:
        port = int(sim.url.rsplit(":", 1)[1])
        async with dropping_proxy(port) as (url, state), EngineClient(url, backoff_s=0.01, max_retries=2) as client:
            gen = await client.generate(prompt(tokenizer), SAMPLING, rid="ep:t0.0", routing_key="ep")
        assert state["connections"] == 2 and gen.finish in ("stop", "length") and gen.output_ids
        # the first attempt's rid was still running when the retry came: reusing it is SGLang's 400
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": prompt(tokenizer), "sampling_params": {"max_new_tokens": 64}, "rid": "dup"}
            first = asyncio.create_task(http.post(f"{sim.url}/generate", json=body))
            await asyncio.sleep(0.2)
            async with http.post(f"{sim.url}/generate", json=body) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["message"] == "Duplicate request ID detected: dup"
            (await first).release()


async def test_n_above_one_is_refused_at_config_load_and_answered_as_an_array_by_the_engine(tokenizer):
    with pytest.raises(ConfigError, match="n must be 1"):
        parse_config({"rollout": {"sampling": {"n": 2}}})
    async with serve_sim_engine() as sim, aiohttp.ClientSession() as http:
        body = {"input_ids": prompt(tokenizer), "sampling_params": {"n": 2, "max_new_tokens": 8}, "return_logprob": True}
        async with http.post(f"{sim.url}/generate", json=body) as resp:
            answer = await resp.json()
    assert isinstance(answer, list) and len(answer) == 2  # SGLang's shape: what the client would not decode


@pytest.mark.parametrize(
    "bad, key",
    [({"top_p": 0.0}, "top_p"), ({"top_k": 0}, "top_k"), ({"temperature": -1.0}, "temperature"),
     ({"max_new_tokens": -1}, "max_new_tokens"), ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
     ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3.0}, "presence_penalty"),
     ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p")],
)
async def test_out_of_range_sampling_fails_at_config_load_and_at_the_engine(tokenizer, bad, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"rollout": {"sampling": bad}})
    async with serve_sim_engine() as sim, aiohttp.ClientSession() as http:
        body = {"input_ids": prompt(tokenizer), "sampling_params": bad}
        async with http.post(f"{sim.url}/generate", json=body) as resp:
            assert resp.status == 400 and key in (await resp.json())["error"]["message"]


async def test_keys_slime_sends_are_accepted_and_unknown_keys_refused(tokenizer):
    slime_params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop": None,
                    "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                    "spaces_between_special_tokens": False, "sampling_seed": -7}
    async with serve_sim_engine() as sim, aiohttp.ClientSession() as http:
        async with http.post(f"{sim.url}/generate", json={"input_ids": prompt(tokenizer), "sampling_params": slime_params}) as r:
            assert r.status == 200
        async with http.post(f"{sim.url}/generate", json={"input_ids": prompt(tokenizer), "sampling_params": {"topp": 1}}) as r:
            assert r.status == 400 and "unknown field `topp`" in (await r.json())["error"]


async def test_context_is_learned_from_server_info_and_every_turn_fits(chat):
    """Prompt fits, prompt + the response budget does not: each request is sized to the
    engine's context, so SGLang never answers 400 and the episode ends truncated by length."""
    async with serve_sim_engine(SimConfig(context_length=400, length_mu=6.5, length_sigma=0.01)) as sim:
        async with RecordingClient(sim.url) as client:
            sample = await runner_for(client, chat).run(TASK, "e1")
            assert await client.context_length() == 400
        assert sample.status is Status.TRUNCATED and sample.num_tokens == 400
        for ids, sampling in client.calls:
            assert len(ids) + sampling.max_new_tokens <= 400


async def test_context_400s_are_recognised_by_sglang_messages_only(tokenizer):
    async with serve_sim_engine(SimConfig(context_length=30)) as sim, EngineClient(sim.url) as client:
        with pytest.raises(ContextOverflow, match="longer than the model's context length"):
            await client.generate(prompt(tokenizer) * 3, SAMPLING, rid="r1", routing_key="k")
        with pytest.raises(ContextOverflow, match="Requested token count exceeds"):
            await client.generate(prompt(tokenizer), SamplingParams(max_new_tokens=29), rid="r2", routing_key="k")
        # a message that merely mentions "context" (SGLang echoes rids) is a plain bad request
        async with client.session.post(f"{sim.url}/sim/fail_next", json={
            "status": 400, "message": "Duplicate request ID detected: context-overflow-exceed-1"}):
            pass
        with pytest.raises(BadRequest):
            await client.generate(prompt(tokenizer), SAMPLING, rid="context-overflow-exceed-1", routing_key="k")


async def test_a_version_update_aborts_running_requests_and_the_episode_resumes(chat):
    """SGLang aborts a running request on a version update; the turn resumes from its tokens
    with what is left of its budget, `min_new_tokens` included: a resume that sent the turn's
    own min_new_tokens (63) over the tokens left (the client before 129e6ee did) is a 400
    `min_new_tokens must be in [0, max_new_tokens(..)]` and fails the episode."""
    slow = SimConfig(token_latency_s=0.01, latency_sigma=0.01, length_mu=4.5, length_sigma=0.01, accuracy=1.0)
    async with serve_sim_engine(slow) as sim, RecordingClient(sim.url) as client:
        runner = runner_for(client, chat, sampling={"max_new_tokens": 64, "min_new_tokens": 63})
        episode = asyncio.create_task(runner.run(TASK, "e1"))
        while not await _running(client, sim.url):  # the first turn is generating
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a few of its 64 tokens are out (one per 10 ms)
        async with client.session.post(f"{sim.url}/update_weight_version", json={"new_version": "7"}) as r:
            assert (await r.json())["new_version"] == "7"
        sample = await episode
    assert sample.status is not Status.FAILED, sample.metadata
    assert sample.metadata["turn_log"][0]["aborts"] == 1
    assert sample.weight_versions[:2] == ["default", "7"]
    first, resumed = client.calls[0][1], client.calls[1][1]
    assert first.max_new_tokens == 64 and 0 < resumed.max_new_tokens < 63
    assert resumed.min_new_tokens == resumed.max_new_tokens  # min(63, tokens left)


async def _running(client: EngineClient, url: str) -> int:
    async with client.session.get(f"{url}/v1/loads") as r:
        return sum(load["num_running_reqs"] for load in (await r.json())["loads"])


async def test_in_place_pause_keeps_requests_and_reports_version_spans(tokenizer):
    slow = SimConfig(token_latency_s=0.01, latency_sigma=0.01, length_mu=4.5, length_sigma=0.01)
    async with serve_sim_engine(slow) as sim, EngineClient(sim.url) as client:
        request = asyncio.create_task(
            client.generate(prompt(tokenizer), SamplingParams(max_new_tokens=200), rid="p1", routing_key="k"))
        await asyncio.sleep(0.3)
        for path, body in (("/pause_generation", {"mode": "in_place"}),
                           ("/update_weight_version", {"new_version": "2", "abort_all_requests": False}),
                           ("/continue_generation", {})):
            async with client.session.post(f"{sim.url}{path}", json=body) as r:
                assert r.status == 200
        gen = await request
    assert gen.finish != "abort"
    assert gen.weight_versions == ("default", "2") and gen.weight_version == "2"


async def test_every_finished_request_carries_its_version_spans(tokenizer):
    """SGLang sends `meta_info.weight_versions` for every finished request (issue 39 item 5; fails
    on e13e9eb: the simulator sent them only when there were two or more)."""
    async with serve_sim_engine() as sim, aiohttp.ClientSession() as http:
        body = {"input_ids": prompt(tokenizer), "sampling_params": {"max_new_tokens": 4}}
        async with http.post(f"{sim.url}/generate", json=body) as r:
            meta = (await r.json())["meta_info"]
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": meta["completion_tokens"]}]


async def test_health_is_503_while_the_engine_starts(tokenizer):
    async with serve_sim_engine(SimConfig(startup_s=0.5)) as sim, aiohttp.ClientSession() as http:
        async with http.get(f"{sim.url}/health") as r:
            assert r.status == 503
        await asyncio.sleep(0.6)
        async with http.get(f"{sim.url}/health") as r:
            assert r.status == 200
        async with http.get(f"{sim.url}/server_info") as r:
            assert (await r.json())["context_length"] == SimConfig().context_length
