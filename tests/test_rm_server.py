"""`rollout rm-server` (workers/rm_server.py) under slime's own remote reward model client:
the snapshot's `remote_rm` and `batched_async_rm` (slime/rollout/rm_hub) post to it as
`--rm-url` and take its answer as the reward; real NeMo Gym resources servers behind it
(math_with_judge without a judge, and with a judge that is down). An environment that cannot
score is an HTTP error slime's retry sees, never a 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pipeline.config import parse_config
from pipeline.local_redis import free_port
from tests.conformance_support import require_slime
from tests.nemo_gym_support import nemo_gym  # noqa: F401 - a fixture
from workers.rm_server import serve

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
FAST = {"start": {"timeout_s": 20, "retries": 1, "backoff_s": 0.05}, "verify": {"timeout_s": 60, "retries": 1, "backoff_s": 0.05}}
QUESTION = "What is 1 + 1? Put the answer in \\boxed{}."


@pytest.fixture
def rm_hub():
    """slime's rm_hub, with its process-wide client session reset per test (it is bound to
    the event loop of its first use, and each test has its own loop)."""
    hub = require_slime("slime.rollout.rm_hub").modules["slime.rollout.rm_hub"]
    hub._shared_session = None
    yield hub
    hub._shared_session = None  # each test closes the one it made, on its own loop


@contextlib.asynccontextmanager
async def rm_server(environments: dict) -> AsyncIterator[str]:
    config = parse_config({"environments": environments})
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.ensure_future(serve(config, "127.0.0.1", port, ready))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _args(url: str) -> argparse.Namespace:
    return argparse.Namespace(rm_url=url, rm_type="remote_rm", custom_rm_path=None)


def _sample(hub, response: str, label, prompt=QUESTION):
    return hub.Sample(prompt=prompt, response=response, label=label)


def test_rollout_rm_server_command_scores_for_slimes_remote_rm(rm_hub, tmp_path):
    """The CLI (`rollout rm-server --config`), two environments picked by the URL path; slime's
    `remote_rm` and `batched_async_rm` as the trainer calls them."""
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps({"environments": {"math": {"kind": "math"}, "arith": {"kind": "arithmetic"}}}))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "scripts.cli", "rm-server", "--config", str(config), "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"listening on http://127.0.0.1:{port}" in line and f"http://127.0.0.1:{port}/math" in line, line
        base = f"http://127.0.0.1:{port}"

        async def scenario():
            args = _args(f"{base}/math")
            right = await rm_hub.remote_rm(args, _sample(rm_hub, "So \\boxed{2}.", "2"))
            wrong = await rm_hub.remote_rm(args, _sample(rm_hub, "So \\boxed{3}.", "2"))
            batch = [_sample(rm_hub, f"\\boxed{{{n}}}", "2") for n in (2, 5, 2, 7)]
            rewards = await rm_hub.batched_async_rm(args, batch)
            async with aiohttp.ClientSession() as http:  # no environment named, and two configured
                async with http.post(base, json={"prompt": "x", "response": "y", "label": "z"}) as resp:
                    unnamed = (resp.status, await resp.json())
                async with http.post(f"{base}/nope", json={"prompt": "x", "response": "y"}) as resp:
                    unknown = resp.status
                async with http.post(f"{base}/math", data=b"not json") as resp:
                    garbled = resp.status
            await rm_hub._shared_session.close()
            return right, wrong, rewards, unnamed, unknown, garbled

        right, wrong, rewards, unnamed, unknown, garbled = asyncio.run(scenario())
        assert right == 1.0 and wrong == 0.0 and isinstance(right, float)
        assert rewards == [1.0, 0.0, 1.0, 0.0]
        assert unnamed[0] == 404 and "math" in unnamed[1]["error"] and "arith" in unnamed[1]["error"]
        assert unknown == 404 and garbled == 400
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0


async def test_slimes_remote_rm_through_the_rm_server_to_a_real_nemo_gym_server(nemo_gym, rm_hub):  # noqa: F811
    """A data row as slime's label (NeMo Gym's `expected_answer`), the prompt as the row's
    input: NeMo Gym's own math verifier scores the response, thinking cut off."""
    envs = {"gym_math": {"kind": "nemo_gym", "options": {"url": nemo_gym.urls["math_plain"]}, "timeouts": FAST}}
    async with rm_server(envs) as base:
        args = _args(f"{base}/gym_math")
        row = {"question": "What is 1 + 1?", "expected_answer": "2"}
        right = await rm_hub.remote_rm(args, _sample(rm_hub, "<think>Is it \\boxed{3}? No.</think>So \\boxed{2}.", row))
        wrong = await rm_hub.remote_rm(args, _sample(rm_hub, "\\boxed{3}", json.dumps(row)))
        chat = [{"role": "user", "content": QUESTION}]  # a chat prompt, as slime keeps it with --apply-chat-template off
        batch = [_sample(rm_hub, f"\\boxed{{{n}}}", row, prompt=chat) for n in (2, 4)]
        rewards = await rm_hub.batched_async_rm(args, batch)
        await rm_hub._shared_session.close()
    assert (right, wrong) == (1.0, 0.0) and rewards == [1.0, 0.0]


async def test_a_judge_outage_is_an_error_slime_retries_never_a_zero(nemo_gym, rm_hub):  # noqa: F811
    """math_with_judge with its judge down answers `mask_sample: true, failure_kind: judge_failed`:
    the rm-server answers 503 on every try, and slime's remote_rm raises after its retries."""
    envs = {"gym_judge": {"kind": "nemo_gym", "options": {"url": nemo_gym.urls["math_judge_down"]}, "timeouts": FAST}}
    async with rm_server(envs) as base:
        sample = _sample(rm_hub, "\\boxed{3}", {"question": "What is 1 + 1?", "expected_answer": "2"})
        started = time.monotonic()
        with pytest.raises(aiohttp.ClientResponseError) as caught:
            await rm_hub.remote_rm(_args(base), sample, max_retries=2)  # the config's only environment at /
        assert caught.value.status == 503 and time.monotonic() - started >= 1.0  # retried after slime's backoff
        async with aiohttp.ClientSession() as http:
            async with http.post(base, json={"prompt": QUESTION, "response": "\\boxed{3}", "label": sample.label}) as resp:
                status, body = resp.status, await resp.json()
        await rm_hub._shared_session.close()
    assert status == 503 and "judge_failed" in body["error"]


async def test_code_and_openreward_environments_score_for_slimes_remote_rm(rm_hub):
    """The label as the data row: code tests run in the sandbox; an OpenReward task spec, the
    response graded by the environment's `@terminal` tool on the SDK's own server."""
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    from tests.env_helpers import serve_openreward
    from tests.test_env_openreward import Arith

    program = "```python\nprint(2 * int(input()))\n```"
    tests = {"tests": [{"input": "3\n", "output": "6\n"}, {"input": "5\n", "output": "10\n"}]}
    with serve_openreward(Arith) as or_url:
        envs = {
            "code": {"kind": "code", "options": {"require_isolation": False}},
            "arith": {"kind": "openreward", "options": {"environment": "arith", "base_url": or_url}},
        }
        async with rm_server(envs) as base:
            code = await rm_hub.remote_rm(_args(f"{base}/code"), _sample(rm_hub, program, tests, prompt="Double n."))
            half = await rm_hub.remote_rm(_args(f"{base}/code"), _sample(rm_hub, "```python\nprint(6)\n```", tests))
            spec = {"task_spec": {"question": "What is 6 * 7?", "answer": "42"}}
            right = await rm_hub.remote_rm(_args(f"{base}/arith"), _sample(rm_hub, "<think>6*7</think>Answer: 42", spec))
            wrong = await rm_hub.remote_rm(_args(f"{base}/arith"), _sample(rm_hub, "Answer: 41", spec))
            await rm_hub._shared_session.close()
    assert (code, half) == (1.0, 0.5) and (right, wrong) == (1.0, 0.0)


async def test_an_unreachable_environment_server_is_an_error_not_a_zero(rm_hub):
    envs = {"gym": {"kind": "nemo_gym", "options": {"url": f"http://127.0.0.1:{free_port()}"},
                    "timeouts": {"start": {"timeout_s": 2, "retries": 0, "backoff_s": 0.01}}}}
    async with rm_server(envs) as base:
        with pytest.raises(aiohttp.ClientResponseError) as caught:
            await rm_hub.remote_rm(_args(f"{base}/gym"), _sample(rm_hub, "\\boxed{2}", "2"), max_retries=1)
        await rm_hub._shared_session.close()
    assert caught.value.status == 503
