"""pipeline/slime/weight_push.py: slime's own SGLangEngine pauses in the mode ROLLOUT_PUSH_MODE sets, and a
request running through the push lives on, through SGLang 0.5.23's front (tests/support/engine_stack.py)."""

import asyncio

import aiohttp
import pytest

from pipeline.slime.weight_push import PUSH_MODE_ENV, PushMode, install, parse_push_mode, pause_body, ray_worker_setup
from tests.support.conformance_support import require_slime
from tests.support.engine_stack import START_TIMEOUT_S, shared_stack

ENGINE_MODULE = "slime.backends.sglang_utils.sglang_engine"


@pytest.fixture
def engine_cls():
    """slime's SGLangEngine (the class its Ray actors run) with slime's own methods, before each test
    (whatever an earlier test in this process installed, in any order) and after it."""
    ns = require_slime(ENGINE_MODULE)
    cls = ns.modules[ENGINE_MODULE].SGLangEngine
    install(PushMode.ABORT, cls)
    yield cls
    install(PushMode.ABORT, cls)


def _engine(cls, url: str):
    """An SGLangEngine bound to a running server, as slime's actor holds one after init."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    engine = object.__new__(cls)
    engine.node_rank, engine.server_host, engine.server_port = 0, host, int(port)
    return engine


def test_modes_parse_and_name_bad_input():
    assert parse_push_mode("in_place") is PushMode.IN_PLACE and PushMode.RETRACT.keeps_requests
    assert pause_body(PushMode.ABORT) == {} and pause_body(PushMode.RETRACT) == {"mode": "retract"}
    with pytest.raises(ValueError, match="ROLLOUT_PUSH_MODE: unknown weight-push mode 'inplace'; one of abort"):
        parse_push_mode("inplace")


@pytest.mark.conformance
def test_the_ray_hook_installs_the_environments_mode(engine_cls, monkeypatch):
    slimes = engine_cls.pause_generation
    monkeypatch.setenv(PUSH_MODE_ENV, "retract")
    ray_worker_setup()
    assert engine_cls.pause_generation is not slimes and "retract" in engine_cls.pause_generation.__doc__
    monkeypatch.setenv(PUSH_MODE_ENV, "abort")
    ray_worker_setup()  # abort: nothing installed, slime's own methods stay as they are
    assert "retract" in engine_cls.pause_generation.__doc__
    install(PushMode.ABORT, engine_cls)
    assert engine_cls.pause_generation is slimes
    monkeypatch.setenv(PUSH_MODE_ENV, "bogus")
    with pytest.raises(ValueError, match="ROLLOUT_PUSH_MODE"):
        ray_worker_setup()


@pytest.mark.conformance
@pytest.mark.timeout(START_TIMEOUT_S + 60)
@pytest.mark.parametrize("mode", [PushMode.ABORT, PushMode.IN_PLACE, PushMode.RETRACT])
async def test_slimes_push_sequence_keeps_running_requests_unless_abort(engine_cls, mode):
    """slime's update_weights_from_distributed order on one engine: pause, flush, update, continue,
    with slime's own SGLangEngine methods after `install(mode)`, the update stood in for by
    `/update_weight_version` (abort_all_requests false, as slime's update calls send it). abort
    answers the running request at once with its partial output; in_place and retract let it
    finish with two weight-version spans. In place, the installed flush returns at once without
    calling the server (SGLang refuses a flush while a request holds KV: `Scheduler.flush_cache`)."""
    stack = await asyncio.to_thread(shared_stack)
    await asyncio.to_thread(stack.configure, length_mu=6.0, length_sigma=0.01, max_filler_tokens=2048,
                            token_latency_s=0.004)
    url = stack.engine_urls[0]
    install(mode, engine_cls)
    engine = _engine(engine_cls, url)
    body = {"text": "What is 6 * 7?", "sampling_params": {"max_new_tokens": 1000, "temperature": 1.0},
            "return_logprob": True, "rid": f"push-{mode.value}"}
    async with aiohttp.ClientSession() as http:
        async def generate():
            async with http.post(f"{url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        request = asyncio.create_task(generate())
        await asyncio.sleep(0.4)
        assert not request.done()
        await asyncio.to_thread(engine.pause_generation)
        if mode is PushMode.IN_PLACE:  # the installed flush: skipped (slime's would retry SGLang's 400 for 60 s)
            await asyncio.wait_for(asyncio.to_thread(engine.flush_cache), 1)
        async with http.post(f"{url}/update_weight_version",
                             json={"new_version": "7", "abort_all_requests": False}) as resp:
            assert resp.status == 200
        await asyncio.to_thread(engine.continue_generation)
        answer = await asyncio.wait_for(request, 30)
    meta = answer["meta_info"]
    if mode is PushMode.ABORT:
        assert meta["finish_reason"]["type"] == "abort"
        return
    assert meta["finish_reason"]["type"] != "abort"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == len(meta["output_token_logprobs"])


def test_the_launch_script_accepts_exactly_the_modes():
    """scripts/run_slime_grpo.sh checks ROLLOUT_PUSH_MODE in bash (no Python start in --check)."""
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "scripts" / "run_slime_grpo.sh").read_text()
    (line,) = [x.strip() for x in script.splitlines() if x.strip().startswith("abort|")]
    assert line.removesuffix(") ;;").split("|") == [m.value for m in PushMode]
