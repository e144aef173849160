"""Weight-version spans checked where they arrive (issue 47 item 2).

SGLang answers every finished request with `meta_info.weight_versions`: spans `[version, start,
end)` that tile the output tokens. An engine (or a proxy) that sends spans which do not (a
negative start gave 18 token versions for 10 tokens) must not reach the trainer as a sample whose
per-token versions disagree with its tokens: the worker's engine client checks them, and the
episode is a failed one with the reason (loss removed), not retried.

The engine is the simulator (workers/sim/engine.py) on loopback behind a real HTTP proxy that
replaces each /generate answer's spans with one bad shape; the worker side is the real engine
client with its policy clock on the session's redis-server and the episode runner."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
from aiohttp import web

from pipeline.config import EnvConfig, parse_config
from pipeline.schema import SamplingParams, Status, Task
from pipeline.state import PipelineState, PolicyClock
from workers.chat import ChatTokens
from workers.engine import EngineClient
from workers.envs.registry import build_environment
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.sim.engine import SimConfig, serve_sim_engine
from workers.sim.tokenizer import load_test_tokenizer

Spans = list[list]
TASK = Task(id="span-1", env="calc", prompt="What is 6 * 7?", label="42")

# Each bad shape as a function of the answer's token count n (the simulator's answers here are
# 20 tokens or more, so every shape below is well defined and wrong).
BAD_SPANS: dict[str, Callable[[int], Spans]] = {
    "negative start": lambda n: [["default", -8, n]],
    "overlap": lambda n: [["default", 0, n // 2 + 2], ["1", n // 2, n]],
    "gap": lambda n: [["default", 0, n // 2 - 2], ["1", n // 2, n]],
    "beyond the end": lambda n: [["default", 0, n // 2], ["1", n // 2, n + 3]],
    "short of the end": lambda n: [["default", 0, n - 4]],
    "empty span": lambda n: [["default", 0, n // 2], ["1", n // 2, n // 2], ["1", n // 2, n]],
    "out of order": lambda n: [["1", n // 2, n], ["default", 0, n // 2]],
}


@dataclass
class Proxy:
    url: str = ""
    generate_answers: int = 0  # /generate answers passed back


@contextlib.asynccontextmanager
async def spans_replaced(upstream: str, spans_for: Callable[[int], Spans]) -> AsyncIterator[Proxy]:
    """A proxy in front of `upstream` whose /generate answers carry `spans_for(n)` as their
    `meta_info.weight_versions` (n: the answer's output tokens); every other route is passed on
    as it is."""
    proxy = Proxy()
    async with aiohttp.ClientSession() as http:

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            async with http.request(request.method, f"{upstream}{request.rel_url}", data=body,
                                    headers={"Content-Type": request.content_type}) as resp:
                payload, status = await resp.read(), resp.status
            if request.path == "/generate" and status == 200:
                proxy.generate_answers += 1
                answer = msgspec.json.decode(payload)
                meta = answer["meta_info"]
                spans = spans_for(len(meta["output_token_logprobs"]))
                meta["weight_versions"] = [{"version": v, "start": s, "end": e} for v, s, e in spans]
                meta["weight_version"] = spans[-1][0]
                payload = msgspec.json.encode(answer)
            return web.Response(status=status, body=payload, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{path:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            proxy.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            yield proxy
        finally:
            await runner.cleanup()


async def _episode(redis, keys, spans_for: Callable[[int], Spans]):
    """One single-turn episode through the proxy, as a worker runs it (policy clock: the engines
    hold label "default" = version 0, the next push "1" is version 1); returns the sample and the
    number of /generate requests the engine answered."""
    state = PipelineState(redis, keys)
    run = await state.begin_run()
    await state.publish_policy(run=run, start=0, engine_version=0, rollout_id=0, labels={"default": 0, "1": 1})
    env_config = EnvConfig(kind="arithmetic")
    settings = EpisodeSettings.from_config(parse_config({}), env_config, SamplingParams())
    sim = SimConfig(accuracy=1.0, tool_use=0.0, length_mu=3.5, length_sigma=0.01)  # ~33 filler tokens
    async with serve_sim_engine(sim) as engine, spans_replaced(engine.url, spans_for) as proxy, \
            EngineClient(proxy.url, max_retries=3, backoff_s=0.01, clock=PolicyClock(state)) as client:
        runner = EpisodeRunner(client, ChatTokens(load_test_tokenizer()), build_environment("calc", env_config),
                               settings)
        sample = await runner.run(TASK, "span-1:0/0/1")
        return sample, proxy.generate_answers


@pytest.mark.parametrize("shape", sorted(BAD_SPANS))
async def test_spans_that_do_not_tile_the_answer_fail_the_episode_with_the_reason(redis, keys, shape):
    """Fails on 37671f7: the spans were laid over the tokens as they came (a negative start grew
    the token versions past the tokens, a gap or a short span left tokens on the call's version),
    and the episode was completed (or its sample refused at the trainer)."""
    sample, requests = await _episode(redis, keys, BAD_SPANS[shape])
    assert sample.status is Status.FAILED, (shape, sample.status, sample.metadata.get("error"))
    error = sample.metadata["error"]
    assert "do not tile" in error and "rid span-1:0/0/1:t0.0" in error, error
    assert sample.reward == 0.0 and not sample.loss_mask_array().any()  # nothing of it is trained
    assert requests == 1  # the engine's own bookkeeping: not retried


async def test_spans_that_tile_the_answer_give_each_token_its_version(redis, keys):
    """The check refuses no answer SGLang sends: two spans across a push, each token its span's version."""
    split: dict[str, int] = {}

    def two_spans(n: int) -> Spans:
        split["at"], split["n"] = n // 3, n
        return [["default", 0, n // 3], ["1", n // 3, n]]

    sample, requests = await _episode(redis, keys, two_spans)
    assert sample.status is Status.COMPLETED and sample.reward == 1.0, sample.metadata
    assert requests == 1 and sample.weight_versions == ["default", "1"]
    model = sample.token_versions()[sample.loss_mask_array() == 1].tolist()
    assert model == [0] * split["at"] + [1] * (split["n"] - split["at"])
