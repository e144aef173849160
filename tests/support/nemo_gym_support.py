"""Real NeMo Gym resources servers for the conformance tests, started with NeMo Gym's own CLI.

NeMo Gym (`nemo-gym` on PyPI, 0.7.0) declares Python >= 3.13.14 and pulls in Ray, MLflow
and more, so it lives in a venv of its own, never in the project's: by default
`~/.cache/rollout-conformance/nemo-gym-venv` (`$ROLLOUT_NEMO_GYM_VENV` to move it). Build it
with (about 3 minutes on 2 cores; `--ignore-requires-python` because the pyenv 3.13 here is
3.13.0):

    python3.13 -m venv ~/.cache/rollout-conformance/nemo-gym-venv
    ~/.cache/rollout-conformance/nemo-gym-venv/bin/pip install --ignore-requires-python \\
        nemo-gym==0.7.0 math-verify==0.8.0 numpy==2.2.6

(math-verify and numpy are what the math_with_judge and code_gen servers' requirements.txt
add.) Without the venv the conformance tests skip, saying so; with
`ROLLOUT_REQUIRE_CONFORMANCE=1` they fail instead.

`gym env start --config fleet.yaml` (NeMo Gym's CLI: a head server, Ray, and each server's
`app.py` under its venv's interpreter) starts, on loopback ports:

- `example_single_tool_call` (tool `get_weather`; reward 1 when the output calls it),
- `example_session_state_mgmt` (a counter kept per session cookie),
- `math_with_judge` three times: `math_plain` (no judge: `should_use_judge: false`),
  `math_judge` (judge = NeMo Gym's `openai_model` server in front of a fake OpenAI endpoint
  of this process that answers `[[A=B]]`), `math_judge_down` (the same model server in
  front of an endpoint that answers 503: NeMo Gym's `judge_failsafe` turns that into HTTP
  200 `{reward: 0.0, mask_sample: true, failure_kind: judge_failed}`),
- `code_gen` (LiveCodeBench-style unit tests, run through Ray).

`uv_venv_dir` holds a link to the one venv per server directory and `skip_venv_if_present`
keeps the CLI from building per-server venvs with uv (what it does by default).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.store.local_redis import free_port

VENV = Path(os.environ.get("ROLLOUT_NEMO_GYM_VENV", "~/.cache/rollout-conformance/nemo-gym-venv")).expanduser()
STARTUP_TIMEOUT_S = 420.0
SERVER_DIRS = (
    "resources_servers/example_single_tool_call",
    "resources_servers/example_session_state_mgmt",
    "resources_servers/math_with_judge",
    "resources_servers/code_gen",
    "responses_api_models/openai_model",
)


def require_nemo_gym() -> Path:
    """The `gym` CLI of the NeMo Gym venv; skips (or, with ROLLOUT_REQUIRE_CONFORMANCE=1, fails)
    when it is missing."""
    gym = VENV / "bin" / "gym"
    if gym.exists():
        return gym
    reason = (
        f"NeMo Gym is not installed at {VENV} (set ROLLOUT_NEMO_GYM_VENV, or build it as "
        "tests/support/nemo_gym_support.py says)"
    )
    if os.environ.get("ROLLOUT_REQUIRE_CONFORMANCE") == "1":
        pytest.fail(f"ROLLOUT_REQUIRE_CONFORMANCE=1: {reason}", pytrace=False)
    pytest.skip(reason)


# ------------------------------------------------------------------ fake OpenAI upstream for the judge


class _Upstream(BaseHTTPRequestHandler):
    """`/up/v1/responses`: a judge that finds the answers equal; `/down/...`: 503."""

    requests: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).requests.append(self.path)
        if self.path.startswith("/down/"):
            self._send(503, {"error": {"message": "judge overloaded"}})
            return
        text = "Both answers say the same. [[A=B]]"
        self._send(200, {
            "id": "resp_judge", "object": "response", "created_at": int(time.time()), "model": "judge",
            "status": "completed", "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "output": [{
                "type": "message", "id": "msg_judge", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }],
        })

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def fake_upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ the fleet


@dataclass
class Fleet:
    urls: dict[str, str]  # server name -> base URL
    log: Path
    upstream_requests: list[str]


def _fleet_config(tmp: Path, upstream: str, ports: dict[str, int]) -> str:
    def resources(name: str, impl: str, **extra: object) -> dict:
        return {name: {"resources_servers": {impl: {"entrypoint": "app.py", "host": "127.0.0.1", "port": ports[name], "domain": "other", **extra}}}}

    def judge_model(name: str, path: str) -> dict:
        return {name: {"responses_api_models": {"openai_model": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": ports[name],
            "openai_base_url": f"{upstream}/{path}/v1", "openai_api_key": "unused", "openai_model": "judge",
            "max_http_attempts": 1,
        }}}}

    def math(name: str, judge: str, use: bool) -> dict:
        return resources(
            name, "math_with_judge", domain="math", should_use_judge=use,
            judge_model_server={"type": "responses_api_models", "name": judge},
            judge_responses_create_params={"input": []},
        )

    config: dict = {
        "head_server": {"host": "127.0.0.1", "port": ports["head"]},
        "skip_venv_if_present": True,
        "uv_venv_dir": str(tmp / "venvs"),
        "model_endpoint_readiness_timeout_seconds": 0,
        "results_dir": str(tmp / "results"),
        "cache_dir": str(tmp / "cache"),
        **judge_model("judge_up", "up"),
        **judge_model("judge_down", "down"),
        **resources("single_tool", "example_single_tool_call", domain="agent"),
        **resources("counter", "example_session_state_mgmt"),
        **math("math_plain", "judge_up", False),
        **math("math_judge", "judge_up", True),
        **math("math_judge_down", "judge_down", True),
        **resources("code_gen", "code_gen", domain="coding", num_processes=2, unit_test_timeout_secs=10, debug=False),
    }
    return json.dumps(config, indent=1)  # JSON is YAML


RESOURCES = ("single_tool", "counter", "math_plain", "math_judge", "math_judge_down", "code_gen")
START_ATTEMPTS = 3
PORT_TAKEN = "address already in use"


@contextlib.contextmanager
def nemo_gym_fleet(gym: Path, tmp: Path) -> Iterator[Fleet]:
    for server_dir in SERVER_DIRS:
        link = tmp / "venvs" / server_dir / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(VENV, target_is_directory=True)
    _Upstream.requests = []
    with fake_upstream() as upstream:
        log = tmp / "gym.log"
        for attempt in range(START_ATTEMPTS):
            ports = {name: free_port() for name in ("head", "judge_up", "judge_down", *RESOURCES)}
            (tmp / "fleet.yaml").write_text(_fleet_config(tmp, upstream, ports))
            process = _launch(gym, tmp, log)
            try:
                _wait_ready(process, log)
                break
            except RuntimeError:
                _stop(process)
                # a port found free was taken by another process of this machine before its server
                # bound it (seen once on a busy machine): choose the ports again
                if PORT_TAKEN not in log.read_text(errors="replace") or attempt == START_ATTEMPTS - 1:
                    raise
        try:
            urls = {name: f"http://127.0.0.1:{ports[name]}" for name in RESOURCES}
            yield Fleet(urls=urls, log=log, upstream_requests=_Upstream.requests)
        finally:
            _stop(process)


def _launch(gym: Path, tmp: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
    env.pop("VIRTUAL_ENV", None)
    with open(log, "wb") as out:
        return subprocess.Popen(
            [str(gym), "env", "start", "--config", str(tmp / "fleet.yaml")],
            cwd=tmp, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )


def _wait_ready(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "servers ready!" in text:
            return
        if process.poll() is not None:
            raise RuntimeError(f"`gym env start` exited with {process.returncode}:\n{text[-4000:]}")
        time.sleep(1.0)
    raise RuntimeError(f"NeMo Gym servers not ready after {STARTUP_TIMEOUT_S:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM lets the CLI stop its servers and Ray, which finish a few seconds after it.
    What is still running 15 s later in the process group this fixture started
    (start_new_session; Ray's dashboard and runtime-env agents outlive their raylet)
    gets SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=90)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)  # anyone left in the group?
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.5)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


_SHARED: dict[str, Fleet] = {}


@pytest.fixture(scope="session")
def nemo_gym(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """One fleet per test session, also when several modules import this fixture (pytest makes
    a session fixture of each import); stopped when the session ends."""
    if "fleet" not in _SHARED:
        gym = require_nemo_gym()
        stack = contextlib.ExitStack()
        _SHARED["fleet"] = stack.enter_context(nemo_gym_fleet(gym, tmp_path_factory.mktemp("nemo-gym")))
        request.config.add_cleanup(stack.close)
    yield _SHARED["fleet"]


# ------------------------------------------------------------------ a fault-injecting proxy


@dataclass
class FaultProxy:
    """An HTTP proxy on loopback in front of a real server, for answers that are slow or lost.

    `faults[path]` is a list of actions, one consumed per request to that path:
    `"delay:<s>"` forwards the request and holds the answer back for `<s>` seconds;
    `"lose"` forwards it, waits for the server's whole answer, then closes the connection
    without a byte (the call ran; its answer is lost); `"502"` answers 502 without
    forwarding; a callable forwards the request and answers `action(server's body)` (a server
    whose answer has the wrong shape). Requests are counted per path in `seen` (forwarded ones in `forwarded`).
    Headers (session cookies) pass both ways.
    """

    target: str
    faults: dict
    seen: dict
    forwarded: dict

    @classmethod
    def to(cls, target: str, faults: dict | None = None) -> FaultProxy:
        return cls(target=target.rstrip("/"), faults=dict(faults or {}), seen={}, forwarded={})

    async def handle(self, request):  # aiohttp handler
        import asyncio

        import aiohttp
        from aiohttp import web

        path = request.path
        self.seen[path] = self.seen.get(path, 0) + 1
        actions = self.faults.get(path) or []
        action = actions.pop(0) if actions else ""
        rewrite = action if callable(action) else None
        action = "" if rewrite else action
        if action == "502":
            return web.json_response({"detail": "injected bad gateway"}, status=502)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length", "transfer-encoding")}
        self.forwarded[path] = self.forwarded.get(path, 0) + 1
        async with aiohttp.ClientSession() as client:
            async with client.request(request.method, self.target + request.path_qs, data=body, headers=headers) as upstream:
                payload = await upstream.read()
                status, upstream_headers = upstream.status, upstream.headers.copy()
        if action == "lose":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if action.startswith("delay:"):
            await asyncio.sleep(float(action.split(":", 1)[1]))
        response = web.Response(body=rewrite(payload) if rewrite else payload, status=status)
        for key, value in upstream_headers.items():
            if key.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection", "date", "server"):
                response.headers.add(key, value)
        return response


@contextlib.asynccontextmanager
async def serve_proxy(proxy: FaultProxy):
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
