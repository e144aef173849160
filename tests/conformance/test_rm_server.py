"""`rollout rm-server` (workers/rm_server.py) under slime's own remote reward model client:
the snapshot's `remote_rm` and `batched_async_rm` (slime/rollout/rm_hub) post to it as
`--rm-url` and take its answer as the reward; real NeMo Gym resources servers behind it
(math_with_judge without a judge, and with a judge that is down). An environment that cannot
score is an HTTP error slime's retry sees, never a 0."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pipeline.config import parse_config
from pipeline.store.local_redis import free_port
from tests.support.conformance_support import require_slime
from tests.support.nemo_gym_support import nemo_gym  # noqa: F401 - a fixture
from workers.rm_server import Scorer, serve

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
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
async def rm_server(environments: dict, scorer: Scorer | None = None, token: str | None = None) -> AsyncIterator[str]:
    config = scorer.config if scorer is not None else parse_config({"environments": environments})
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.ensure_future(serve(config, "127.0.0.1", port, ready, token=token, scorer=scorer))
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
    from tests.support.env_helpers import serve_openreward
    from tests.workers.test_env_openreward import Arith

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


# ------------------------------------------------------------------ the secret, and a caller's mistakes

TOKEN = "rm-4b9d2e7f1a6c3058be"


def _rollout_rm_server(config: Path, *argv: str, token: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env["PYTHONUNBUFFERED"] = "1"
    if token is not None:
        env["ROLLOUT_RM_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-m", "scripts.cli", "rm-server", "--config", str(config), *argv],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_rm_server_on_a_public_address_needs_its_token_which_no_line_shows(rm_hub, tmp_path):
    """`--host 0.0.0.0` without a token refuses to start; with `$ROLLOUT_RM_TOKEN` every path
    must begin with it (slime's `--rm-url http://host:port/<token>/<env>`), and neither the
    start line nor a failure's log line nor any answer shows it."""
    config = tmp_path / "pipeline.yaml"
    dead = f"http://127.0.0.1:{free_port()}"  # an environment server that is down: a logged 503
    gym = {"kind": "nemo_gym", "options": {"url": dead}, "timeouts": {"start": {"timeout_s": 2, "retries": 0, "backoff_s": 0.01}}}
    config.write_text(json.dumps({"environments": {"math": {"kind": "math", "options": {"check_in": "inline"}}, "gym": gym}}))

    refused = _rollout_rm_server(config, "--host", "0.0.0.0", "--port", str(free_port()), token=None)
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2 and "ROLLOUT_RM_TOKEN" in out and "reachable from other machines" in out, out
    short = _rollout_rm_server(config, "--host", "0.0.0.0", "--token", "s3cr3t-short", token=None)
    out, _ = short.communicate(timeout=60)
    assert short.returncode == 2 and "at least 16 characters" in out and "s3cr3t-short" not in out, out
    # 64 MiB bodies x 64 in flight (the limits before issue 47) outgrow the default 1 GiB budget: said at start
    greedy = _rollout_rm_server(config, "--max-body-mib", "64", "--port", str(free_port()), token=None)
    out, _ = greedy.communicate(timeout=60)
    assert greedy.returncode == 2 and ("request bodies can hold 4096 MiB at once (--max-body-mib 64 x --max-pending "
                                       "64), over the memory budget --memory-budget-mib 1024") in out, out

    port = free_port()
    process = _rollout_rm_server(config, "--host", "0.0.0.0", "--port", str(port), token=TOKEN)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"http://0.0.0.0:{port}/<token>/math" in line, line
        base = f"http://127.0.0.1:{port}"

        async def scenario():
            right = await rm_hub.remote_rm(_args(f"{base}/{TOKEN}/math"), _sample(rm_hub, "So \\boxed{2}.", "2"))
            statuses, bodies = [], []
            async with aiohttp.ClientSession() as http:
                for path in ("/math", f"/{TOKEN[:-1]}x/math", f"/{TOKEN}x/math", "/", f"/{TOKEN}/gym"):
                    async with http.post(base + path, json={"prompt": QUESTION, "response": "\\boxed{2}", "label": "2"}) as resp:
                        statuses.append(resp.status)
                        bodies.append(await resp.text())
                for path in ("/metrics", f"/{TOKEN[:-1]}x/metrics", f"/{TOKEN}/metrics"):  # the operator's view too
                    async with http.get(base + path) as resp:
                        statuses.append(resp.status)
                        bodies.append(await resp.text())
            await rm_hub._shared_session.close()
            return right, statuses, bodies

        right, statuses, bodies = asyncio.run(scenario())
        assert right == 1.0
        assert statuses == [401, 401, 401, 401, 503, 401, 401, 200], (statuses, bodies)
        assert 'rollout_rm_answered_total{status="401"} 4.0' in bodies[-1] and "rollout_rm_busy_total" in bodies[-1]
        assert "must begin with this rm-server's token" in bodies[0]
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    assert "gym environment failed: 503" in out, out  # a failure was logged ...
    assert TOKEN not in line + out and all(TOKEN not in body for body in bodies)  # ... and no line holds the token
    assert process.returncode == 0


async def test_a_callers_mistake_is_400_naming_the_field_and_slime_meets_it_as_such(rm_hub):
    """slime's own `remote_rm` on bodies that are the caller's fault: each answered 400 (404 for an
    unknown environment) at once, with the field named, no environment built. slime retries every
    error status alike (its `except Exception`): the server receives exactly one request per try
    of slime's and adds none; 503 stays for outages. A label that is no gold (an object, NaN, text
    math-verify reads nothing from) is the caller's 400, never a 0 (issue 39 item 12); a body nested
    too deeply is a counted 400, not a 500 RecursionError (item 11); an answer math-verify gives up
    on is a 0 counted as undecided (item 13)."""
    environments = {
        "math": {"kind": "math", "options": {"check_in": "inline", "parse_timeout_s": 1}},
        "code": {"kind": "code", "options": {"require_isolation": False}},
    }
    scorer = Scorer(parse_config({"environments": environments}))
    async with rm_server(environments, scorer=scorer) as base:
        async def slime_status(url: str, sample, tries: int = 1) -> int:
            with pytest.raises(aiohttp.ClientResponseError) as caught:
                await rm_hub.remote_rm(_args(url), sample, max_retries=tries)
            return caught.value.status

        started = time.monotonic()
        no_label = await slime_status(f"{base}/math", _sample(rm_hub, "\\boxed{2}", None), tries=3)
        retried_s = time.monotonic() - started
        assert (no_label, scorer.stats.answered[400]) == (400, 3)  # slime's three tries, three requests: no more
        assert retried_s >= 1.0  # slime's own backoff between them (1 s, then 2 s, plus jitter)
        assert await slime_status(f"{base}/math", _sample(rm_hub, "\\boxed{2}", "2", prompt=5)) == 400
        assert await slime_status(f"{base}/code", _sample(rm_hub, "```python\nprint(1)\n```", "1")) == 400
        assert await slime_status(f"{base}/maths", _sample(rm_hub, "\\boxed{2}", "2")) == 404
        assert scorer.environments == {}  # none was built for a caller's mistake
        undecided = await rm_hub.remote_rm(_args(f"{base}/math"), _sample(rm_hub, "\\boxed{10^{10^{10}}}", "5"))
        right = await rm_hub.remote_rm(_args(f"{base}/math"), _sample(rm_hub, "\\boxed{2}", "2"))
        deep = b"[" * 100_000
        raw = {"deep body": deep, "deep label": b'{"prompt": "q", "response": "r", "label": ' + deep + b"]" * 100_000 + b"}"}
        errors = {}
        async with aiohttp.ClientSession() as http:
            for case, body in {
                "label": {"prompt": QUESTION, "response": "\\boxed{2}", "label": None},
                "prompt": {"prompt": 5, "response": "\\boxed{2}", "label": "2"},
                "no prompt": {"response": "\\boxed{2}", "label": "2"},
                "response": {"prompt": QUESTION, "response": None, "label": "2"},
                "tests": {"prompt": "Print 1.", "response": "```python\nprint(1)\n```", "label": {"tests": []}},
                "object label": {"prompt": QUESTION, "response": "\\boxed{2}", "label": {"expected_answer": "2"}},
                "nan label": {"prompt": QUESTION, "response": "\\boxed{2}", "label": float("nan")},
                "no gold": {"prompt": QUESTION, "response": "\\boxed{2}", "label": "[[["},
            }.items():
                async with http.post(f"{base}/{'code' if case == 'tests' else 'math'}", json=body) as resp:
                    errors[case] = (resp.status, (await resp.json())["error"])
            for case, data in raw.items():
                async with http.post(f"{base}/math", data=data) as resp:
                    errors[case] = (resp.status, (await resp.json())["error"])
        await rm_hub._shared_session.close()
    assert undecided == 0.0 and scorer.stats.undecided == {"math": 1} and right == 1.0
    assert all(status == 400 for status, _ in errors.values()), errors
    assert "'label' is an object: the math environment's label is the gold answer" in errors["object label"][1]
    assert "'label' is NaN" in errors["nan label"][1]
    assert "the label is no gold answer the verifier can read" in errors["no gold"][1]
    assert errors["deep body"][1] == errors["deep label"][1] == "bad request: the body is nested too deeply (JSON's recursion limit)"
    assert "no label" in errors["label"][1]
    assert "'prompt' is a number: it must be a string or a list of chat messages" in errors["prompt"][1]
    assert "has no 'prompt'" in errors["no prompt"][1] and "'response' is null, not a string" in errors["response"][1]
    assert "no usable tests: metadata.tests must be a non-empty list" in errors["tests"][1]
    assert scorer.stats.answered == {400: 3 + 2 + 5 + 3 + 2, 404: 1, 200: 2}


# ------------------------------------------------------------------ a hostile client (issue 39 items 10, 14, 15)

async def _raw(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """`data` sent as is on a fresh connection; what came back before the server closed it (or `wait_s`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        chunks = []
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), wait_s):
                chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


async def test_malformed_requests_put_the_token_in_no_log_line(caplog, capsys):
    """aiohttp's own error logger writes a malformed request's raw request line (its parser's
    exception text): a control byte in the path, a bad HTTP version, a path that is not ASCII, a
    garbled method. Each is answered 400 and logged by the rm-server in one line without it."""
    import logging

    caplog.set_level(logging.DEBUG)
    config = parse_config({"environments": {"math": {"kind": "math", "options": {"check_in": "inline"}}}})
    port = free_port()
    ready = asyncio.Event()
    server = asyncio.ensure_future(serve(config, "127.0.0.1", port, ready, token=TOKEN))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        answers = [await _raw(port, line + b"\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}") for line in (
            f"POST /{TOKEN}/math\x01 HTTP/1.1".encode(),
            f"POST /{TOKEN}/math HTTP/9.x".encode(),
            f"POST /{TOKEN}/m\u00e4th HTTP/1.1".encode(),
            f"POST /{TOKEN}/\xff HTTP/1.1".encode("latin-1"),
            f"P\x01ST /{TOKEN}/math HTTP/1.1".encode(),
        )]
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
    assert all(answer.split(b" ", 2)[1] == b"400" for answer in answers), answers  # (echoed to its sender alone)
    printed = capsys.readouterr()
    logged = caplog.text + "".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert TOKEN not in logged + printed.out + printed.err
    ours = [r.getMessage() for r in caplog.records if r.name == "workers.rm_server"]
    assert len(ours) >= 4 and all("the request is not shown" in line for line in ours), ours


async def test_past_max_pending_a_request_is_503_with_retry_after_and_slow_heads_and_bodies_time_out():
    """One request in flight at most (from its body's read to its answer): a second is refused at
    once with Retry-After (not queued without bound) while the first's body trickles in; that body
    never completes and is answered 408 after the body timeout, which frees the place; a request
    head that never ends closes the connection. Each refusal is counted."""
    from workers.rm_server import ServerLimits

    environments = {"math": {"kind": "math", "options": {"check_in": "inline"}}}
    limits = ServerLimits(max_pending=1, header_timeout_s=0.5, body_timeout_s=1.0)
    scorer = Scorer(parse_config({"environments": environments}), limits)
    body = {"prompt": QUESTION, "response": "\\boxed{2}", "label": "2"}
    async with rm_server(environments, scorer=scorer) as base:
        port = int(base.rsplit(":", 1)[1])
        started = time.monotonic()
        trickle = asyncio.ensure_future(_raw(port, b"POST /math HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\""))
        while scorer.in_flight == 0:
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/math", json=body) as resp:
                busy = (resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"])
            late = await trickle
            late_s = time.monotonic() - started
            async with http.post(f"{base}/math", json=body) as resp:
                after = (resp.status, await resp.json())
        started = time.monotonic()
        head = await _raw(port, b"POST /math HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        head_s = time.monotonic() - started
    assert busy == (503, "1", "busy: 1 verifications in flight (--max-pending 1); retry after 1s"), busy
    assert late.startswith(b"HTTP/1.1 408") and b"did not arrive within 1s" in late and late_s < 4.0, (late, late_s)
    assert after == (200, 1.0)  # the place is free again
    assert head == b"" and head_s < 3.0, (head, head_s)  # closed after the header timeout, nothing answered
    assert scorer.stats.busy == {("math", "max_pending"): 1} and scorer.stats.answered == {503: 1, 408: 1, 200: 1}


async def test_slimes_custom_rm_path_through_the_rm_server_removes_a_failed_measurement(rm_hub, monkeypatch):
    """slime's own `async_rm` / `batched_async_rm` with `--custom-rm-path workers.rm_client.reward`
    and `--rm-url` at the rm-server: a failed measurement (422: `on_undecided: remove`), a label
    the verifier cannot read and an outage past the tries are removed samples (`remove_sample`,
    status failed, the reason kept), not the end of the run; a decided answer is its reward; a
    wrong token is raised at once (the run's configuration)."""
    from workers import rm_client

    monkeypatch.setattr(rm_client, "MAX_TRIES", 2)
    environments = {"math": {"kind": "math", "on_undecided": "remove", "options": {"check_in": "inline", "parse_timeout_s": 1}}}

    def args(url: str) -> argparse.Namespace:
        return argparse.Namespace(rm_url=url, rm_type=None, custom_rm_path="workers.rm_client.reward")

    async with rm_server(environments, token=TOKEN) as base:
        url = f"{base}/{TOKEN}/math"
        right = _sample(rm_hub, "\\boxed{2}", "2")
        failed = _sample(rm_hub, "\\boxed{10^{10^{10}}}", "5")
        rewards = await rm_hub.batched_async_rm(args(url), [right, failed])
        no_gold = _sample(rm_hub, "\\boxed{2}", "[[[")
        assert await rm_hub.async_rm(args(url), no_gold) == 0.0
        with pytest.raises(rm_client.RewardServerError, match="rm-server answered 401"):
            await rm_hub.async_rm(args(f"{base}/not-the-token/math"), _sample(rm_hub, "\\boxed{2}", "2"))
        outage = _sample(rm_hub, "\\boxed{2}", "2")
        assert await rm_hub.async_rm(args(f"http://127.0.0.1:{free_port()}/math"), outage) == 0.0  # nothing listens
        await rm_client.close()
    assert rewards == [1.0, 0.0] and not right.remove_sample and right.status != right.Status.FAILED
    assert failed.remove_sample and failed.status == failed.Status.FAILED
    assert "rm-server 422: math: failed measurement: math-verify gave up: timed out after 1s" in failed.metadata["error"]
    assert no_gold.remove_sample and "reads no expression from the gold answer" in no_gold.metadata["error"]
    assert outage.remove_sample and "rm-server unavailable after 2 tries" in outage.metadata["error"]


# ------------------------------------------------------------------ an operator's view, a latency bound (issue 47 items 8, 9)

SLOW = "\\boxed{10^{10^{10}}}"  # math-verify exhausts its parse timeout on it: undecided, a 0


def _scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text as {(sample name, sorted labels): value}, read by prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _post_timed(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, float, str | None, object]:
    started = time.monotonic()
    async with http.post(url, json=body) as resp:
        answer = await resp.json()
        return resp.status, time.monotonic() - started, resp.headers.get("Retry-After"), answer


def test_a_burst_of_slow_answers_is_admitted_within_the_latency_budget_and_the_rest_is_503_at_once(rm_hub, tmp_path):
    """`rollout rm-server` as a process on loopback, its math pool 2 checker processes, each
    slow answer about 1 s (math-verify's parse timeout), `--latency-budget-s 5`: of a burst of
    24 slow requests, those admitted are answered within the budget, the rest at once with 503
    and Retry-After; slime's own remote_rm meets a 503, backs off and gets the reward on a
    later try (a 503 is never a reward); /metrics counts each refusal and answer."""
    budget_s = 5.0
    config = tmp_path / "pipeline.yaml"
    math_env = {"kind": "math", "options": {"processes": 2, "parse_timeout_s": 1}}
    config.write_text(json.dumps({"environments": {"math": math_env}}))
    port = free_port()
    process = _rollout_rm_server(config, "--port", str(port), "--latency-budget-s", str(budget_s),
                                 "--service-prior-s", "1.5", token=None)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": QUESTION, "response": SLOW, "label": "5"}
    try:
        assert process.stdout is not None
        assert "listening on" in process.stdout.readline()

        async def scenario():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                warm = []  # the checker processes started, the service time observed (their start included)
                for _ in range(4):
                    warm += await asyncio.gather(*(_post_timed(http, f"{base}/math", body) for _ in range(2)))
                burst = await asyncio.gather(*(_post_timed(http, f"{base}/math", body) for _ in range(24)),
                                             _slime_after_a_503(http))
                async with http.get(f"{base}/metrics") as resp:
                    return warm, burst[:-1], burst[-1], await resp.text()

        async def _slime_after_a_503(http: aiohttp.ClientSession):
            await asyncio.sleep(0.3)  # the burst is in: the pool is full
            status, _, _, _ = await _post_timed(http, f"{base}/math", body)
            started = time.monotonic()
            reward = await rm_hub.remote_rm(_args(f"{base}/math"), _sample(rm_hub, SLOW, "5"), max_retries=8)
            await rm_hub._shared_session.close()
            return status, reward, time.monotonic() - started

        warm, burst, (probe, slime_reward, slime_s), text = asyncio.run(scenario())
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    assert [status for status, *_ in warm] == [200] * 8, warm
    admitted = [seconds for status, seconds, _, _ in burst if status == 200]
    refused = [(seconds, retry, answer) for status, seconds, retry, answer in burst if status == 503]
    print(f"burst of {len(burst)}: {len(admitted)} admitted, max {max(admitted, default=0):.2f}s; {len(refused)} "
          f"refused, max {max((s for s, _, _ in refused), default=0):.3f}s; slime's remote_rm: {slime_reward} after "
          f"{slime_s:.1f}s")
    assert len(admitted) + len(refused) == len(burst) and len(admitted) >= 2 and len(refused) >= 8, burst
    assert max(admitted) <= budget_s, sorted(admitted)  # every admitted answer within the budget ...
    assert all(seconds < 0.5 and retry is not None and int(retry) >= 1 for seconds, retry, _ in refused), refused
    assert "over --latency-budget-s 5" in refused[0][2]["error"]  # ... the rest refused at once, saying why
    assert probe == 503 and slime_reward == 0.0  # slime retried its 503s and took the verification's 0 (undecided)
    metrics = _scrape(text)
    busy = metrics[("rollout_rm_busy_total", (("env", "math"), ("reason", "latency_budget")))]
    slime_503s = busy - len(refused) - 1  # the probe's
    assert slime_503s >= 0
    assert metrics[("rollout_rm_answered_total", (("status", "503"),))] == busy
    assert metrics[("rollout_rm_answered_total", (("status", "200"),))] == 8 + len(admitted) + 1
    assert metrics[("rollout_rm_undecided_total", (("env", "math"),))] == 8 + len(admitted) + 1
    assert metrics[("rollout_rm_latency_seconds_count", (("env", "math"),))] == 8 + len(burst) + 2 + slime_503s
    assert metrics[("rollout_rm_verifier_workers", (("env", "math"),))] == 2
    assert metrics[("rollout_rm_latency_budget_seconds", (("env", "math"),))] == budget_s


async def test_every_answer_is_counted_on_the_tokened_metrics_endpoint_and_in_a_periodic_log_line(caplog, capsys):
    """`GET /<token>/metrics` (401 without the token) counts each kind of answer: scored, undecided
    (a 0), a failed measurement (422), a caller's mistake and a gold that is the text "NaN" (400,
    the latter a task error as any gold math-verify cannot read), a body over --max-body-mib (413),
    busy (503 past --max-pending), a body that never came (408); latency per environment. A log line every `stats_interval_s` sums
    up the same, without the token."""
    import logging

    from workers.rm_server import ServerLimits

    caplog.set_level(logging.INFO, logger="workers.rm_server")
    environments = {
        "math": {"kind": "math", "options": {"check_in": "inline", "parse_timeout_s": 1}},
        "strict": {"kind": "math", "on_undecided": "remove", "options": {"check_in": "inline", "parse_timeout_s": 1}},
    }
    limits = ServerLimits(max_pending=1, body_timeout_s=1.0, stats_interval_s=0.3, max_body_mib=1)
    scorer = Scorer(parse_config({"environments": environments}), limits)
    nan_golds = ["NaN", "nan", " -NAN ", "Natalia sold none.\n#### NaN"]
    async with rm_server(environments, scorer=scorer, token=TOKEN) as base:
        port = int(base.rsplit(":", 1)[1])
        url = f"{base}/{TOKEN}"
        answers = {}
        async with aiohttp.ClientSession() as http:
            for case, env, response, label in [("right", "math", "\\boxed{2}", "2"), ("undecided", "math", SLOW, "5"),
                                               ("failed", "strict", SLOW, "5"), ("no response", "math", None, "2"),
                                               *((f"nan {gold!r}", "math", "\\boxed{nan}", gold) for gold in nan_golds)]:
                async with http.post(f"{url}/{env}", json={"prompt": QUESTION, "response": response, "label": label}) as resp:
                    answers[case] = (resp.status, await resp.json())
            async with http.post(f"{url}/math", data=b" " * (1024 * 1024 + 1)) as resp:  # over --max-body-mib 1
                answers["large"] = (resp.status, await resp.json())
            trickle = asyncio.ensure_future(_raw(port, f"POST /{TOKEN}/math HTTP/1.1\r\nHost: x\r\n"
                                                       "Content-Length: 100\r\n\r\n{".encode()))
            while scorer.in_flight == 0:
                await asyncio.sleep(0.01)
            async with http.post(f"{url}/math", json={"prompt": QUESTION, "response": "\\boxed{2}", "label": "2"}) as resp:
                answers["busy"] = (resp.status, await resp.json())
            assert (await trickle).startswith(b"HTTP/1.1 408")
            async with http.get(f"{base}/metrics") as resp:
                untokened = resp.status
            async with http.get(f"{url}/metrics") as resp:
                content_type, text = resp.headers["Content-Type"], await resp.text()
            await asyncio.sleep(0.6)  # a stats line
    print(text)
    assert [answers[c][0] for c in ("right", "undecided", "failed", "no response", "large", "busy")] == [
        200, 200, 422, 400, 413, 503], answers
    assert answers["large"][1]["error"] == "bad request: the body is over --max-body-mib 1 MiB"
    nans = [answers[f"nan {gold!r}"] for gold in nan_golds]
    assert all(status == 400 and body["task_error"] and f"the gold answer is {gold.strip()!r}" in body["error"]
               for (status, body), gold in zip(nans, nan_golds)), nans
    assert untokened == 401 and content_type.startswith("text/plain")
    metrics = _scrape(text)
    assert {labels[0][1]: v for (name, labels), v in metrics.items() if name == "rollout_rm_answered_total"} == {
        "200": 2, "400": 1 + len(nan_golds), "413": 1, "422": 1, "503": 1, "408": 1}
    math_env, strict = (("env", "math"),), (("env", "strict"),)
    assert metrics[("rollout_rm_bad_requests_total", math_env)] == 1 + len(nan_golds)
    assert metrics[("rollout_rm_undecided_total", math_env)] == 1
    assert metrics[("rollout_rm_measurements_failed_total", strict)] == 1
    assert metrics[("rollout_rm_measurements_failed_total", math_env)] == len(nan_golds)
    assert metrics[("rollout_rm_busy_total", (("env", "math"), ("reason", "max_pending")))] == 1
    assert metrics[("rollout_rm_latency_seconds_count", math_env)] == 2 + 1 + len(nan_golds) + 3
    assert metrics[("rollout_rm_latency_seconds_count", strict)] == 1
    assert 0 < metrics[("rollout_rm_service_seconds", math_env)] < 2.0  # observed: the 10 s prior replaced
    lines = [r.getMessage() for r in caplog.records if "(since the last line)" in r.getMessage()]
    assert lines and all(TOKEN not in line for line in caplog.text.splitlines()), caplog.text
    logged: collections.Counter[int] = collections.Counter()  # the lines' counts, summed
    for line in lines:
        for status, n in re.findall(r"(\d{3}): (\d+)", line.partition(" answered (")[2].partition(")")[0]):
            logged[int(status)] += int(n)
    assert logged == scorer.stats.answered and any("busy 503: max_pending 1; latency mean" in line for line in lines)
