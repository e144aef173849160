"""Conformance with SGLang 0.5.23: the /generate bodies our client sends, judged by SGLang's own
request classes (tests/conformance_support.py imports them; no GPU, no model).

How SGLang 0.5.23's HTTP server turns a POST /generate into a request (read from
sglang/srt/entrypoints/http_server.py, api_contract.py, managers/io_struct.py and
managers/tokenizer_manager.py), reproduced by `admit()` below with their classes:

1. FastAPI validates the JSON body into the `GenerateReqInput` dataclass (pydantic, as
   `pydantic.TypeAdapter(GenerateReqInput)` does); a failure is a `RequestValidationError`, which
   `validation_exception_handler` turns into HTTP **400** (not FastAPI's 422) with the body
   `{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}`.
2. `generate_request` runs the JSON contract gate `generate_contract_error(await request.json())`
   (the schema of proto/sglang/api/v1, `GenerateRequest.from_json_value`): unknown
   `sampling_params` keys and a float where an int belongs are refused there, HTTP **400**,
   body `{"error": "<text>"}` (a string, not an object).
3. `TokenizerManager.generate_request`: `obj.normalize_batch_and_arguments()`; per request
   `_validate_one_request` (context length), then `_create_tokenized_object`:
   `SamplingParams(**obj.sampling_params)`, `.normalize(tokenizer)`, `.verify(vocab_size)`;
   `_init_req_state` refuses a duplicate rid. Each raises `ValueError`, which
   `serve_generate_request` turns into `_create_error_response(e)`: HTTP **400** (or the
   exception's `status_code`), body `{"error": {"message": "<str(e)>"}}`.

The bodies are captured from `workers.engine.EngineClient.generate` over real HTTP (a
recording aiohttp server on loopback), with the pipeline's default sampling, the sampling of
docs/example_config.yaml's environments and the keys slime's own rollout sends.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from conformance_support import require_sglang

pytestmark = pytest.mark.conformance

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 151_936  # Qwen's; verify() uses it only for logit_bias ids


@pytest.fixture(scope="module")
def sgl():
    return require_sglang()


_TOKENIZER: list[Any] = []


def tokenizer():
    """The test tokenizer (Qwen-style chat tokens): SGLang normalizes with the model's tokenizer;
    without one (skip_tokenizer_init) it refuses stop strings and min_new_tokens."""
    if not _TOKENIZER:
        from workers.sim.tokenizer import load_test_tokenizer

        _TOKENIZER.append(load_test_tokenizer())
    return _TOKENIZER[0]


def admit(sgl, body: dict[str, Any]) -> tuple[int, Any]:
    """(200, the normalized GenerateReqInput) or (status, response JSON) as SGLang's server
    answers a POST /generate with this JSON body (steps 1-3 of the module docstring), up to
    the model-dependent checks (context length), which need a TokenizerManager."""
    import pydantic

    try:
        obj = pydantic.TypeAdapter(sgl.GenerateReqInput).validate_python(body)
    except pydantic.ValidationError as exc:
        return 400, {"object": "error", "message": str(exc), "type": "Bad Request", "param": None, "code": 400}
    contract_error = sgl.generate_contract_error(body)
    if contract_error is not None:
        return 400, {"error": contract_error}
    try:
        obj.normalize_batch_and_arguments()
        requests = [obj] if obj.is_single else [obj[i] for i in range(len(obj.rid))]
        for one in requests:
            params = sgl.SamplingParams(**one.sampling_params)
            params.normalize(tokenizer())  # a model's tokenizer: stop strings, min_new_tokens' eos
            params.verify(VOCAB_SIZE)
    except ValueError as exc:
        return getattr(exc, "status_code", 400), {"error": {"message": str(exc)}}
    return 200, obj


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


def test_default_sampling_body_is_admitted_by_sglang(sgl):
    (body,) = capture([_default_sampling()])
    assert set(body) == {"input_ids", "sampling_params", "return_logprob", "rid", "routing_key"}
    status, obj = admit(sgl, body)
    assert status == 200, obj
    assert obj.rid == body["rid"] and obj.input_ids == [1, 2, 3] and obj.return_logprob is True
    assert obj.routing_key == body["routing_key"]  # a GenerateReqInput field, not dropped


def test_example_config_sampling_bodies_are_admitted_by_sglang(sgl):
    samplings = _example_config_samplings()
    bodies = capture(list(samplings.values()))
    verdicts = {where: admit(sgl, body) for where, body in zip(samplings, bodies)}
    assert {where: v for where, v in verdicts.items() if v[0] != 200} == {}


def test_slimes_sampling_keys_go_through_our_client_and_sglang_admits_them(sgl):
    """Every key slime's own rollout sends is accepted by SGLang's contract; the pipeline must
    accept them in its config (pipeline.schema.SamplingParams) and send them unchanged."""
    from pipeline.schema import SamplingParams

    status, _ = admit(sgl, {"input_ids": [1, 2, 3], "sampling_params": SLIME_SAMPLING, "return_logprob": True})
    assert status == 200
    sampling = SamplingParams(**SLIME_SAMPLING)
    (body,) = capture([sampling])
    assert body["sampling_params"] == SLIME_SAMPLING
    status, obj = admit(sgl, body)
    assert status == 200, obj


def test_contract_gate_refuses_what_our_sampling_struct_refuses(sgl):
    """Types are strict on both sides: a float max_new_tokens, an unknown key."""
    base = {"input_ids": [1, 2, 3], "return_logprob": True}
    status, answer = admit(sgl, {**base, "sampling_params": {"max_new_tokens": 8.0}})
    assert status == 400 and answer == {"error": "invalid type: floating point `8.0`, expected i64"}
    status, answer = admit(sgl, {**base, "sampling_params": {"foo": 1}})
    assert status == 400 and answer["error"].startswith("unknown field `foo`, expected one of")


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


def sglang_verdict(sgl, params: dict[str, Any]) -> str | None:
    """SGLang's SamplingParams on these params as the tokenizer manager runs it: the error, or None."""
    try:
        sp = sgl.SamplingParams(**params)
        sp.normalize(tokenizer())
        sp.verify(VOCAB_SIZE)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("params", [p for _, p in CASES], ids=[name for name, _ in CASES])
def test_our_validator_agrees_with_sglangs_sampling_params(sgl, params):
    """pipeline.schema.validate_sampling(params) -> list of errors naming the key; empty where
    SGLang accepts. `n` != 1 is the pipeline's own refusal (each episode is its own request),
    recorded here as SGLang accepting it."""
    from pipeline.schema import validate_sampling

    theirs = sglang_verdict(sgl, params)
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

def _tokenizer_manager_module(sgl):
    from conformance_support import _import_with_stubs

    return _import_with_stubs("sglang.srt.managers.tokenizer_manager", ("torchvision",))


def _tokenizer_manager(sgl):
    return _tokenizer_manager_module(sgl).TokenizerManager


def test_duplicate_rid_message(sgl):
    """`_init_req_state` refuses a rid already in flight: our client's retries use `rid~attempt`."""
    manager = SimpleNamespace(enable_trace=False, rid_to_state={"task:0/0/1:t0": object()})
    status, obj = admit(sgl, {"input_ids": [1, 2, 3], "rid": "task:0/0/1:t0", "sampling_params": {}})
    assert status == 200
    with pytest.raises(ValueError) as info:
        _tokenizer_manager(sgl)._init_req_state(manager, obj, None)
    assert str(info.value) == "Duplicate request ID detected: task:0/0/1:t0"


def test_context_overflow_messages_are_recognised_by_our_client(sgl, monkeypatch):
    """`_validate_one_request`'s two refusals, and our client's reading of them
    (workers.engine: a 400 whose message says the context is exceeded is a ContextOverflow,
    which ends the episode as truncated instead of failing it)."""
    from workers import engine as engine_mod

    module = _tokenizer_manager_module(sgl)
    tm = module.TokenizerManager
    # the server's published settings (absent without a server): encoder-SWA replay off, its default
    features = SimpleNamespace(enable_encoder_swa_bounded_replay=False)
    monkeypatch.setattr(module, "get_exec", lambda: SimpleNamespace(features=features))
    model_config = SimpleNamespace(joint_head_config=None, pointer_head=None)
    manager = SimpleNamespace(
        context_len=16, allow_auto_truncate=False, num_reserved_tokens=0, validate_total_tokens=True,
        model_config=model_config,
    )
    manager._validate_joint_schema_request = lambda obj, ids: tm._validate_joint_schema_request(manager, obj, ids)
    messages = []
    for ids, max_new in (([1] * 20, 4), ([1] * 10, 10)):
        status, obj = admit(sgl, {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}})
        assert status == 200
        with pytest.raises(ValueError) as info:
            tm._validate_one_request(manager, obj, list(ids))
        messages.append(str(info.value))
    assert messages[0] == "The input (20 tokens) is longer than the model's context length (16 tokens)."
    assert messages[1] == (
        "Requested token count exceeds the model's maximum context length of 16 tokens. You requested a total "
        "of 20 tokens: 10 tokens from the input messages and 10 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."
    )
    for message in messages:
        body = json.dumps({"error": {"message": message}}).encode()
        assert engine_mod._CONTEXT_OVERFLOW.search(engine_mod._error_message(body)), message
