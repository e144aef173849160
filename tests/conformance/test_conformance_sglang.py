"""Conformance with SGLang 0.5.23: the /generate bodies our client sends, judged by SGLang's own
HTTP server (tests/support/engine_stack.py: `sglang.srt.entrypoints.http_server`'s FastAPI app and a real
TokenizerManager over the simulator as scheduler, behind sglang-router 0.3.2, the router slime's
Dockerfile pins; no GPU, no model).

What answers a POST /generate there, read from sglang/srt/entrypoints/http_server.py,
api_contract.py, managers/io_struct.py, managers/tokenizer_manager.py and managers/scheduler.py:

1. FastAPI validates the JSON body into the `GenerateReqInput` dataclass (pydantic); a failure is
   a `RequestValidationError`, which `validation_exception_handler` turns into HTTP **400** (not
   FastAPI's 422) with the body `{"object": "error", "message": ..., "type": "Bad Request", ...}`.
2. `generate_request` runs the JSON contract gate `generate_contract_error(await request.json())`:
   unknown `sampling_params` keys and a float where an int belongs are refused there, HTTP **400**,
   body `{"error": "<text>"}` (a string, not an object).
3. `TokenizerManager.generate_request`: `normalize_batch_and_arguments()`; `_init_req_state`
   refuses a rid in flight; per request `_validate_one_request` (context length), then
   `SamplingParams(**obj.sampling_params)`, `.normalize(tokenizer)`, `.verify(vocab_size)`. Each
   raises `ValueError`, which `serve_generate_request` turns into HTTP **400** (or the exception's
   `status_code`), body `{"error": {"message": "<str(e)>"}}`.
4. The scheduler refuses an input of `max_req_input_len` tokens or more (an abort with status
   400, the same body shape).

The bodies are captured from `workers.engine.EngineClient.generate` over real HTTP (a recording
aiohttp server on loopback), with the pipeline's default sampling, the sampling of
docs/example_config.yaml's environments and the keys slime's own rollout sends, then posted
verbatim to SGLang's front, directly and through the router.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.engine_stack import SHARED_MODEL_CONTEXT, START_TIMEOUT_S, shared_stack

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(START_TIMEOUT_S + 120)]

REPO = Path(__file__).resolve().parents[2]
MODEL_CONTEXT = SHARED_MODEL_CONTEXT
# short answers at 2 ms a token: a request stays in flight long enough to meet a duplicate rid
STACK_SIM = dict(length_mu=4.0, length_sigma=0.01, token_latency_s=0.002, latency_sigma=0.01)


@pytest.fixture
def stack():
    """The session's stack (SGLang fronts at a 4096-token model context); bodies go to the first
    front, and through sglang-router 0.3.2."""
    running = shared_stack()
    running.configure(**STACK_SIM)
    return running


def post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def admit(stack, body: dict[str, Any], via: str = "engine") -> tuple[int, Any]:
    """(status, JSON answer) of SGLang's own server to this POST /generate body."""
    return post(stack.engine_urls[0] if via == "engine" else stack.router_urls["sglang-router"], body)


def refusal(answer: Any) -> str:
    """The message of one of SGLang's three error shapes (module doc)."""
    if isinstance(answer, dict):
        error = answer.get("error", answer)
        if isinstance(error, dict):
            return str(error.get("message"))
        return str(error if "error" in answer else answer.get("message"))
    return str(answer)


# ------------------------------------------------------------------ capturing real bodies

class Recorder:
    """A loopback HTTP server that records /generate bodies and answers like SGLang."""

    def __init__(self):
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    async def generate(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.bodies.append(json.loads(raw))
        self.headers.append(dict(request.headers))
        return web.json_response({
            "text": "ok",
            "output_ids": [11, 12],
            "meta_info": {
                "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]],
                "finish_reason": {"type": "stop", "matched": 151645},
                "weight_version": "1",
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "cached_tokens": 0,
            },
        })


def capture(sampling_list) -> list[dict[str, Any]]:
    from workers.engine import EngineClient

    async def go():
        recorder = Recorder()
        app = web.Application()
        app.router.add_post("/generate", recorder.generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with EngineClient(f"http://127.0.0.1:{port}", max_retries=0) as client:
                for i, sampling in enumerate(sampling_list):
                    gen = await client.generate([1, 2, 3], sampling, rid=f"task-{i}:0/0/{i}:t0", routing_key=f"task-{i}:0/0/{i}")
                    assert gen.output_ids == [11, 12]
        finally:
            await runner.cleanup()
        return recorder.bodies

    return asyncio.run(go())


def _default_sampling():
    from pipeline.config import parse_config

    return parse_config({}).rollout.sampling


def _example_config_samplings():
    from pipeline.config import load_config
    from pipeline.schema import SamplingParams
    from workers.episode import EpisodeSettings

    config = load_config(REPO / "docs" / "example_config.yaml")
    out = {"rollout.sampling": config.rollout.sampling}
    for name, env in config.environments.items():
        out[f"environments.{name}"] = EpisodeSettings.from_config(config, env, SamplingParams()).sampling
    return out


# what slime's own rollout (slime/rollout/sglang_rollout.py) puts in sampling_params
SLIME_SAMPLING = dict(
    temperature=0.8, top_p=0.95, top_k=-1, max_new_tokens=1024, stop=["</answer>"], stop_token_ids=[151645],
    skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False, sampling_seed=1234,
)


def test_default_sampling_body_is_admitted_by_sglang(stack):
    (body,) = capture([_default_sampling()])
    assert set(body) == {"input_ids", "sampling_params", "return_logprob", "rid", "routing_key"}
    for via in ("engine", "router"):
        status, answer = admit(stack, {**body, "rid": f"{body['rid']}-{via}"}, via)
        assert status == 200, answer
        meta = answer["meta_info"]
        assert meta["id"] == f"{body['rid']}-{via}" and meta["prompt_tokens"] == 3
        assert len(meta["output_token_logprobs"]) == len(answer["output_ids"])  # return_logprob honoured
    received = {b["rid"]: b for b in stack.all_bodies()}
    direct, routed = received[f"{body['rid']}-engine"], received[f"{body['rid']}-router"]
    assert direct == {**body, "rid": f"{body['rid']}-engine"}
    assert routed["sampling_params"] == body["sampling_params"] and routed["return_logprob"] is True
    # sglang-router 0.3.2 re-serializes the body without `routing_key` (smg keeps it); SGLang's
    # scheduler uses it only to pick a data-parallel rank, and the router routes by its own policy
    assert "routing_key" not in routed
    assert stack.total_stats()["routing_keys"][body["routing_key"]] == 1  # a GenerateReqInput field, kept


def test_example_config_sampling_bodies_are_admitted_by_sglang(stack):
    samplings = _example_config_samplings()
    bodies = capture(list(samplings.values()))
    verdicts = {where: admit(stack, body) for where, body in zip(samplings, bodies)}
    assert {where: v for where, v in verdicts.items() if v[0] != 200} == {}


def test_slimes_sampling_keys_go_through_our_client_and_sglang_admits_them(stack):
    """Every key slime's own rollout sends is accepted by SGLang's server; the pipeline must
    accept them in its config (pipeline.schema.SamplingParams) and send them unchanged."""
    from pipeline.schema import SamplingParams

    status, answer = admit(stack, {"input_ids": [1, 2, 3], "sampling_params": SLIME_SAMPLING, "return_logprob": True})
    assert status == 200, answer
    sampling = SamplingParams(**SLIME_SAMPLING)
    (body,) = capture([sampling])
    assert body["sampling_params"] == SLIME_SAMPLING
    status, answer = admit(stack, body)
    assert status == 200, answer


def test_what_each_router_passes_on_of_slimes_keys(stack):
    """Both routers re-serialize /generate: every key slime's rollout sends arrives, except
    `spaces_between_special_tokens`, which SGLang then takes as its default (True). It shapes
    only the `text` of the answer (special tokens joined with spaces); the token ids and
    log-probs the pipeline trains on are the same (docs/architecture.md "The engine")."""
    expected = {k: v for k, v in SLIME_SAMPLING.items() if k != "spaces_between_special_tokens"}
    for name, router in stack.router_urls.items():
        status, answer = post(router, {"input_ids": [1, 2, 3], "sampling_params": SLIME_SAMPLING, "rid": f"keys-{name}"})
        assert status == 200, (name, answer)
    received = {b["rid"]: b for b in stack.all_bodies()}
    for name in stack.router_urls:
        assert received[f"keys-{name}"]["sampling_params"] == expected, name


def test_contract_gate_refuses_what_our_sampling_struct_refuses(stack):
    """Types are strict on both sides: a float max_new_tokens, an unknown key."""
    base = {"input_ids": [1, 2, 3], "return_logprob": True}
    status, answer = admit(stack, {**base, "sampling_params": {"max_new_tokens": 8.0}})
    assert status == 400 and answer == {"error": "invalid type: floating point `8.0`, expected i64"}
    status, answer = admit(stack, {**base, "sampling_params": {"foo": 1}})
    assert status == 400 and answer["error"].startswith("unknown field `foo`, expected one of")


def test_a_body_that_is_not_a_generate_request_gets_sglangs_pydantic_400(stack):
    status, answer = admit(stack, {"input_ids": "not ids", "sampling_params": {}})
    assert status == 400 and answer["object"] == "error" and answer["type"] == "Bad Request", answer


# ------------------------------------------------------------------ sampling-param verdicts

CASES = [
    ("defaults", {}),
    ("pipeline default", {"temperature": 1.0, "top_p": 1.0}),
    ("slime's keys", SLIME_SAMPLING),
    ("greedy", {"temperature": 0.0}),
    ("greedy with top_k 0", {"temperature": 0.0, "top_k": 0}),
    ("top_p 0", {"top_p": 0.0}),
    ("top_p 1", {"top_p": 1.0}),
    ("top_p 1.5", {"top_p": 1.5}),
    ("top_k 0", {"top_k": 0}),
    ("top_k -1", {"top_k": -1}),
    ("top_k -2", {"top_k": -2}),
    ("top_k 1", {"top_k": 1}),
    ("min_p 1.5", {"min_p": 1.5}),
    ("temperature -1", {"temperature": -1.0}),
    ("temperature 1e-7", {"temperature": 1e-7, "top_k": 0}),
    ("max_new_tokens -1", {"max_new_tokens": -1}),
    ("max_new_tokens 0", {"max_new_tokens": 0}),
    ("min_new_tokens > max_new_tokens", {"min_new_tokens": 10, "max_new_tokens": 5}),
    ("min_new_tokens -1", {"min_new_tokens": -1}),
    ("frequency_penalty 3", {"frequency_penalty": 3.0}),
    ("frequency_penalty 2", {"frequency_penalty": 2.0}),
    ("presence_penalty -3", {"presence_penalty": -3.0}),
    ("repetition_penalty 0", {"repetition_penalty": 0.0}),
    ("repetition_penalty 2.5", {"repetition_penalty": 2.5}),
    ("negative seed", {"sampling_seed": -5}),
    ("seed 2**63", {"sampling_seed": 2**63}),
    ("n=2", {"n": 2}),
    ("n=1", {"n": 1}),
    ("two grammars", {"regex": "a+", "ebnf": "root ::= 'a'"}),
    ("33 stop strings", {"stop": [f"s{i}" for i in range(33)]}),
]


def sglang_verdict(stack, params: dict[str, Any]) -> str | None:
    """SGLang's server on a /generate body with these sampling params: its refusal, or None."""
    status, answer = admit(stack, {"input_ids": [1, 2, 3], "sampling_params": params})
    if status == 200:
        return None
    assert status == 400, (status, answer)
    return refusal(answer)


@pytest.mark.parametrize("params", [p for _, p in CASES], ids=[name for name, _ in CASES])
def test_our_validator_agrees_with_sglangs_sampling_params(stack, params):
    """pipeline.schema.validate_sampling(params) -> list of errors naming the key; empty where
    SGLang accepts. `n` != 1 is the pipeline's own refusal (each episode is its own request),
    recorded here as SGLang accepting it."""
    from pipeline.schema import validate_sampling

    theirs = sglang_verdict(stack, params)
    ours = validate_sampling(dict(params))
    if set(params) == {"n"} and params["n"] != 1:
        assert theirs is None
        assert ours and all("n" in e for e in ours)
        return
    if theirs is None:
        assert ours == [], f"SGLang accepts {params}, ours refuses: {ours}"
    else:
        assert ours, f"SGLang refuses {params} ({theirs}), ours accepts"
        keys = [k for k in params if k in " ".join(ours)]
        assert keys, f"our errors {ours} name none of {sorted(params)} (SGLang: {theirs})"


# ------------------------------------------------------------------ error strings


def test_duplicate_rid_message(stack):
    """`_init_req_state` refuses a rid in flight: our client's retries use `rid~attempt`."""
    stack.configure(**{**STACK_SIM, "token_latency_s": 0.02})  # ~55 tokens: ~1.1 s in flight
    body = {"input_ids": [1, 2, 3], "rid": "task:0/0/1:t0", "sampling_params": {"max_new_tokens": 2000}}

    async def both() -> list[tuple[int, Any]]:
        first = asyncio.create_task(asyncio.to_thread(admit, stack, body))
        while not (await asyncio.to_thread(stack.stats, 0))["running"]:  # the first is generating
            await asyncio.sleep(0.02)
        second = await asyncio.to_thread(admit, stack, body)
        return [await first, second]

    (status1, _), (status2, answer) = asyncio.run(both())
    assert status1 == 200
    assert (status2, answer) == (400, {"error": {"message": "Duplicate request ID detected: task:0/0/1:t0"}})


def test_context_overflow_messages_are_recognised_by_our_client(stack):
    """SGLang's three refusals of a request over the context (`_validate_one_request`'s two,
    the scheduler's `validate_input_length`), and our client's reading of them (workers.engine:
    a 400 whose message says the context is exceeded is a ContextOverflow, which ends the
    episode as truncated instead of failing it)."""
    from workers import engine as engine_mod

    answers = [
        admit(stack, {"input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 4}}),
        admit(stack, {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 4090}}),
        admit(stack, {"input_ids": [1] * 4090, "sampling_params": {"max_new_tokens": 1}}),
    ]
    assert [status for status, _ in answers] == [400, 400, 400]
    messages = [refusal(answer) for _, answer in answers]
    assert messages[0] == "The input (5000 tokens) is longer than the model's context length (4096 tokens)."
    assert messages[1] == (
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total "
        "of 4100 tokens: 10 tokens from the input messages and 4090 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."
    )
    assert messages[2] == ("Input length (4090 tokens) exceeds the maximum allowed length (4090 tokens). "
                           "Use a shorter input or enable --allow-auto-truncate.")
    for message in messages:
        body = json.dumps({"error": {"message": message}}).encode()
        assert engine_mod._CONTEXT_OVERFLOW.search(engine_mod._error_message(body)), message


def test_server_info_says_what_the_engine_enforces_and_the_router_lists_the_engine(stack):
    """What workers.engine.EngineDirectory reads (docs/architecture.md "The engine")."""
    from workers.engine import _engine_urls, context_limit

    with urllib.request.urlopen(f"{stack.engine_urls[0]}/server_info", timeout=30) as resp:
        info = json.loads(resp.read())
    assert info["context_length"] is None and info["max_req_input_len"] == MODEL_CONTEXT - 6
    assert context_limit(info) == MODEL_CONTEXT - 6
    for router in stack.router_urls.values():
        with urllib.request.urlopen(f"{router}/workers", timeout=30) as resp:
            assert _engine_urls(json.loads(resp.read())) == sorted(stack.engine_urls)
    for path in ("/server_info", "/abort_request"):  # the router does not pass these on
        request = urllib.request.Request(f"{stack.router_urls['sglang-router']}{path}", method="GET" if path == "/server_info" else "POST",
                                         data=None if path == "/server_info" else b'{"rid": "x"}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info_error:
            urllib.request.urlopen(request, timeout=30)
        assert info_error.value.code == 404


def test_prefix_cache_hits_reach_meta_info_and_a_weight_update_flushes_them(stack):
    """The simulator's radix cache (workers/sim/radix.py, SGLang's RadixCache) answered through
    SGLang's own front: `meta_info.cached_tokens` counts the prefix a request found cached, as
    SGLang's scheduler reports it (Req.cached_tokens -> BatchStrOutput.cached_tokens), and a weight
    update empties the cache (SGLang's update_weights_* flush it), so the next request prefills all."""
    prompt = list(range(5, 205))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}

    def cached() -> int:
        status, answer = admit(stack, body)
        assert status == 200, answer
        return int(answer["meta_info"]["cached_tokens"])

    assert cached() == 0  # a cold cache
    assert cached() >= len(prompt) - 1  # the prompt (SGLang keeps the last token out of the match)
    request = urllib.request.Request(f"{stack.engine_urls[0]}/update_weight_version",
                                     data=json.dumps({"new_version": "flushed"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert json.loads(resp.read())["success"]
    assert cached() == 0
