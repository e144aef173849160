"""The tiny policy the simulated engine serves (workers/sim/tinylm.py) across a weight load that
keeps its requests (SGLang's `in_place` / `retract` pause): every token is drawn with the weights
loaded at its step, as SGLang decodes, and its log-prob is those weights' (SGLang's
`output_token_logprobs`: log softmax(logits / temperature) of the token). A request that the
default pause aborts keeps what the old weights drew. Through the engine's HTTP API on loopback,
checked against transformers' own forward pass of each checkpoint."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from workers.sim.engine import SimConfig, serve_sim_engine  # noqa: E402
from workers.sim.tinylm import load_model, new_model, save_checkpoint  # noqa: E402
from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer  # noqa: E402

TEMPERATURE = 0.8
MAX_NEW = 64
STEP_S = 0.02  # a decode step: 64 tokens take ~1.3 s, room to push after the first few


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two freshly initialised tiny LMs (A, B), seeded apart: their log-probs differ everywhere."""
    tokenizer = load_test_tokenizer(default_tokenizer_path())
    root = tmp_path_factory.mktemp("tiny")
    a, b = (save_checkpoint(new_model(len(tokenizer), seed=seed, eos_id=tokenizer.eos_token_id), Path(root) / name)
            for seed, name in ((1, "a"), (2, "b")))
    return a, b


@functools.lru_cache(maxsize=2)
def _model(path: str) -> Any:
    return load_model(path)


def logprobs_of(path: str, prompt: list[int], ids: list[int]) -> list[float]:
    """Each of `ids`' log-probs under the checkpoint at `path`, given the prompt and the ids before it
    (one full forward, no KV cache: the engine's batched cached decode must agree)."""
    import torch

    model = _model(path)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    scaled = torch.log_softmax(logits[len(prompt) - 1 : -1] / TEMPERATURE, dim=-1)
    return [float(v) for v in scaled.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)]


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
async def test_tokens_after_a_weight_load_are_drawn_by_the_new_weights(checkpoints: tuple[str, str], mode: str) -> None:
    a, b = checkpoints
    config = SimConfig(policy_path=a, token_latency_s=STEP_S, weight_version="0")
    async with serve_sim_engine(config) as sim, aiohttp.ClientSession() as session:
        engine = sim.engine
        prompt = engine.tokenizer.encode("<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n")
        body = {"input_ids": prompt, "rid": "long",
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": TEMPERATURE, "n": 2}}
        answering = asyncio.ensure_future(_post(session, f"{sim.url}/generate", body))
        while min((r.produced for r in engine._running.values()), default=0) < 6:  # both mid-answer
            assert not answering.done(), answering.result()
            await asyncio.sleep(0.005)
        await _post(session, f"{sim.url}/pause_generation", {"mode": mode})
        await _post(session, f"{sim.url}/update_weights_from_disk", {"model_path": b, "weight_version": "1"})
        await _post(session, f"{sim.url}/continue_generation", {})
        answers = await answering
        redrawn = engine.stats.get("redrawn_requests", 0)
    assert redrawn == (0 if mode == "abort" else 2)  # both, in the load's one batch
    assert len(answers) == 2
    for answer in answers:
        ids, meta = answer["output_ids"], answer["meta_info"]
        got = [lp for lp, _tok, _ in meta["output_token_logprobs"]]
        if mode == "abort":  # the pause ended it: what it has is the old weights' alone
            assert meta["finish_reason"]["type"] == "abort"
            assert [s["version"] for s in meta["weight_versions"]] == ["0"]
            assert got == pytest.approx(logprobs_of(a, prompt, ids), abs=1e-4)
            continue
        old, new = meta["weight_versions"]
        assert (old["version"], old["start"], new["version"], new["end"]) == ("0", 0, "1", len(ids)), meta
        assert 6 <= old["end"] == new["start"] < len(ids)
        cut = old["end"]
        assert got[:cut] == pytest.approx(logprobs_of(a, prompt, ids)[:cut], abs=1e-4)
        assert got[cut:] == pytest.approx(logprobs_of(b, prompt, ids)[cut:], abs=1e-4)
        eos = engine.tokenizer.eos_token_id
        assert eos not in ids[:-1]
        expected = ({"type": "stop", "matched": eos} if ids[-1] == eos
                    else {"type": "length", "length": MAX_NEW})
        assert meta["finish_reason"] == expected
        assert len(ids) == MAX_NEW or ids[-1] == eos


def test_a_request_goes_on_from_its_emitted_output_within_its_budget(checkpoints: tuple[str, str]) -> None:
    """`GenRequest.emitted` (what a re-draw continues from): the model reads it after the prompt,
    the finish rules see it (the max_new_tokens budget, stop strings), the finish reports the
    whole output's length."""
    from workers.sim.tinylm import GenRequest, TinyPolicy

    tokenizer = load_test_tokenizer(default_tokenizer_path())
    policy = TinyPolicy(checkpoints[1], tokenizer, seed=3)
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    emitted = [tokenizer.encode(" the", add_special_tokens=False)[0]] * 3
    eos = tokenizer.eos_token_id
    [result] = policy.generate([GenRequest(prompt, 5, temperature=TEMPERATURE, emitted=emitted, stop_token_ids=[])])
    assert result.weights == policy.loads == 1
    assert 1 <= len(result.ids) <= 2
    assert result.log_probs == pytest.approx(logprobs_of(checkpoints[1], prompt, emitted + result.ids)[3:], abs=1e-4)
    assert result.finish == ({"type": "stop", "matched": eos} if result.ids[-1] == eos
                             else {"type": "length", "length": 5})
    [done] = policy.generate([GenRequest(prompt, 3, emitted=emitted)])
    assert (done.ids, done.finish) == ([], {"type": "length", "length": 3})
    # a stop string is looked for in the whole output's tail, the emitted tokens too
    [stopped] = policy.generate([GenRequest(prompt, 50, emitted=emitted, stop=["the the"])])
    assert (len(stopped.ids), stopped.finish) == (1, {"type": "stop", "matched": "the the"})


# The front hands the engine the two samples one after the other, and the simulator draws each
# whole answer on its arrival: the second joins the running batch one CPU draw of MAX_NEW tokens
# after the first (~0.3 s here, more on a loaded machine). Slower steps (3.2 s an answer) keep
# both running together long enough for the pause to find them there.
FRONT_STEP_S = 0.05
# SGLang's answer to a weight load whose cache flush it refused (`flush_cache_after_weight_update`)
_FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                  "queued. Retract or finish them, then call /flush_cache.")


@pytest.mark.timeout(300)  # the session's engine stack may start here (~50 s idle, more on a loaded machine)
@pytest.mark.parametrize("mode, flush_cache, status", [
    ("in_place", False, 200),  # what an in_place push must send: no flush while requests hold KV
    ("in_place", None, 400),  # SGLang's default flush_cache: refused, the call fails, the weights are loaded
    ("retract", None, 200),  # retracted requests hold no KV: the flush goes through
])
async def test_a_weight_load_through_sglangs_front_redraws_what_the_paused_requests_have_not_emitted(
        checkpoints: tuple[str, str], mode: str, flush_cache: bool | None, status: int) -> None:
    """The push above through SGLang's own HTTP front and TokenizerManager (tests/support/engine_stack.py),
    on one engine of the session's stack: pause in `mode`, `/update_weights_from_disk` (applied at
    once while paused), continue. The spans are SGLang's `compute_weight_version_spans`, the bodies
    and answers SGLang's; every token before the cut is checkpoint A's, every one after it B's."""
    from tests.support.engine_stack import shared_stack

    a, b = checkpoints
    stack = await asyncio.to_thread(shared_stack)
    url = stack.engine_urls[0]  # SGLang's front itself: a pause and a load are per engine
    await asyncio.to_thread(stack.configure, 0, policy_path=a, token_latency_s=FRONT_STEP_S)
    try:
        prompt = load_test_tokenizer(default_tokenizer_path()).encode(
            "<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n")
        body = {"input_ids": prompt, "rid": "long", "return_logprob": True,  # SGLang's front: only when asked
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": TEMPERATURE, "n": 2}}
        load = {"model_path": b, "weight_version": "1"} | ({} if flush_cache is None else {"flush_cache": flush_cache})
        before = await asyncio.to_thread(stack.stats, 0)  # configure's own label reset flushes the cache
        async with aiohttp.ClientSession() as session:
            answering = asyncio.ensure_future(_post(session, f"{url}/generate", body))
            # both mid-answer: each sample is drawn when it reaches the engine, so they may join the
            # running batch steps apart; 8 decode steps after both are in it, each has 8 tokens or more
            running = await _stats_when(stack, answering, lambda s: s.get("num_running_reqs", 0) == 2)
            await _stats_when(stack, answering, lambda s: s["decode_steps"] >= running["decode_steps"] + 8)
            await _post(session, f"{url}/pause_generation", {"mode": mode})
            async with session.post(f"{url}/update_weights_from_disk", json=load) as reply:
                loaded = (reply.status, await reply.json())
            await _post(session, f"{url}/continue_generation", {})
            answers = await answering
        stats = await asyncio.to_thread(stack.stats, 0)
    finally:
        await asyncio.to_thread(stack.configure)  # the scripted policy and instant answers back
    expected = ({"success": True, "message": "Succeeded to update model weights. Weight version updated to 1.",
                 "num_paused_requests": 0} if status == 200
                else {"success": False, "message": _FLUSH_REFUSED, "num_paused_requests": 0})
    assert loaded == (status, expected)
    assert len(answers) == 2
    label = SimConfig().weight_version  # what `configure` labels the stack's weights
    for answer in answers:
        ids, meta = answer["output_ids"], answer["meta_info"]
        got = [lp for lp, _tok, _ in meta["output_token_logprobs"]]
        old, new = meta["weight_versions"]
        assert (old["version"], old["start"], new["version"], new["end"]) == (label, 0, "1", len(ids)), meta
        assert 8 <= old["end"] == new["start"] < len(ids), meta
        cut = old["end"]
        assert got[:cut] == pytest.approx(logprobs_of(a, prompt, ids)[:cut], abs=1e-4)
        assert got[cut:] == pytest.approx(logprobs_of(b, prompt, ids)[cut:], abs=1e-4)
        eos = load_test_tokenizer(default_tokenizer_path()).eos_token_id
        assert eos not in ids[:-1]
        finish = {"type": "stop", "matched": eos} if ids[-1] == eos else {"type": "length", "length": MAX_NEW}
        assert meta["finish_reason"] == finish
        assert len(ids) == MAX_NEW or ids[-1] == eos
    assert stats["redrawn_requests"] == 2, stats  # both samples, in the load's one batch
    assert stats["cache_flushes"] - before.get("cache_flushes", 0) == (mode == "retract"), stats  # the load's


async def _stats_when(stack: Any, answering: asyncio.Future[Any], ready: Any) -> dict[str, Any]:
    """Engine 0's simulator counters once `ready` holds of them, the request still unanswered."""
    while not ready(stats := await asyncio.to_thread(stack.stats, 0)):
        assert not answering.done(), f"answered before the pause found both samples running: {answering.result()}"
        await asyncio.sleep(0.01)
    return stats
