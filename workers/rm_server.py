"""`rollout rm-server`: slime's remote reward model protocol (`--rm-url`), scored by the
configured environments.

slime's `remote_rm` (slime/rollout/rm_hub, also reached through `batched_async_rm` with
`--rm-type remote_rm`) POSTs `{"prompt", "response", "label"}` to `args.rm_url`, calls
`raise_for_status()` and takes `await resp.json()` as the reward; any error is retried (10
tries, backoff up to 30 s), then raised. So this server answers:

- `POST /<env>`: the environment `<env>` of the config; `POST /` when the config has exactly
  one. (slime's body has no field for it: `--rm-url http://host:port/<env>`.)
- 200 and a JSON number: the environment's verification of the response as the one assistant
  turn after the environment's own prompt, with the episode's reward shaping
  (`final_reward`: nonterminal reward, clamps), as a worker would score it.
- 503 `{"error": ...}` when the environment could not score (its server down, a judge that
  failed, a masked NeMo Gym verification, a timeout): an error slime's retry sees, never a
  0 that would be trained. 500 for a bug of ours or of an in-process environment; 400 for a
  body that is not slime's; 404 for an unknown environment.

The task: `prompt` (a string or chat messages) and `label`; a label that is a JSON object
(or a string holding one) is the task's data row as well, `metadata` (a NeMo Gym row with
`responses_create_params` and `expected_answer`, an OpenReward `task_spec`). A NeMo Gym
row without `responses_create_params` gets one from the prompt. An optional `metadata`
object in the body is merged in (slime does not send one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from typing import Any, Union

from aiohttp import web

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.schema import SchemaError, Status, Task
from workers.envs.base import Environment, EpisodeRecord
from workers.envs.registry import build_environment
from workers.envs.rewards import final_reward
from workers.errors import is_bug

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """The body is not slime's remote-RM request."""


class Scorer:
    """The configured environments, built on first use, scoring one response at a time."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.environments: dict[str, Environment] = {}
        self.scored = 0
        self.failed = 0

    def env_name(self, path: str) -> str:
        name = path.strip("/")
        if name:
            return name
        if len(self.config.environments) == 1:
            return next(iter(self.config.environments))
        known = ", ".join(sorted(self.config.environments)) or "none"
        raise ConfigError(f"POST /<env> names the environment: configured: {known}")

    def environment(self, name: str) -> Environment:
        env = self.environments.get(name)
        if env is None:
            env = build_environment(name, self.config.env(name))  # ConfigError naming the configured ones
            self.environments[name] = env
        return env

    async def score(self, name: str, body: dict[str, Any]) -> float:
        env = self.environment(name)
        task = task_of(body, name, env.config.kind)
        session = await env.start(task)
        try:
            messages = [*session.messages, {"role": "assistant", "content": str(body.get("response") or "")}]
            record = EpisodeRecord(task=task, messages=messages, response_text=str(body.get("response") or ""),
                                   status=Status.COMPLETED, turns=1)
            verification = await session.verify(record)
        finally:
            await asyncio.shield(session.close())
        return final_reward(env.config, verification, finished=False)

    async def aclose(self) -> None:
        for env in self.environments.values():
            try:
                await env.aclose()
            except Exception as exc:  # noqa: BLE001 - shutting down: say so, close the others
                log.warning("rm-server: closing environment %s failed: %r", env.name, exc)


def task_of(body: dict[str, Any], env: str, kind: str) -> Task:
    """slime's `{prompt, response, label}` as the task the environment scores."""
    if "response" not in body:
        raise BadRequest("the body has no 'response' (slime's remote_rm sends prompt, response, label)")
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    label = body.get("label")
    row = _row(label)
    extra = body.get("metadata")
    if extra is not None and not isinstance(extra, dict):
        raise BadRequest("'metadata' must be a JSON object")
    metadata = {**row, **(extra or {})}
    if kind == "nemo_gym" and "responses_create_params" not in metadata:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        metadata["responses_create_params"] = {"input": messages}
    if label is not None and not isinstance(label, str):
        label = json.dumps(label)
    task_id = str(metadata.get("task_id") or metadata.get("id") or "rm-server")
    try:
        return Task(id=task_id, env=env, prompt=prompt, label=label, metadata=metadata)
    except SchemaError as exc:
        raise BadRequest(str(exc)) from exc


def _row(label: Any) -> dict[str, Any]:
    if isinstance(label, dict):
        return dict(label)
    if isinstance(label, str) and label.lstrip().startswith("{"):
        try:
            value = json.loads(label)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def app_for(scorer: Scorer) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        try:
            name = scorer.env_name(request.path)
            scorer.config.env(name)
        except ConfigError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"bad request: the body is not JSON: {exc}"[:600]}, status=400)
        try:
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object {prompt, response, label}")
            reward = await scorer.score(name, body)
        except BadRequest as exc:
            return web.json_response({"error": f"bad request: {exc}"[:600]}, status=400)
        except Exception as exc:  # noqa: BLE001 - an outage is an error slime retries, never a 0
            return _failed(name, exc, 500 if is_bug(exc) else 503)
        scorer.scored += 1
        return web.json_response(reward)

    def _failed(name: str, exc: BaseException, status: int) -> web.Response:
        scorer.failed += 1
        what = "bug" if status == 500 else "environment failed"
        log.warning("rm-server: %s %s: %s: %r", name, what, status, exc)
        return web.json_response({"error": f"{name}: {what}: {exc}"[:600]}, status=status)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/", handle)
    app.router.add_post("/{env}", handle)
    return app


async def serve(config: PipelineConfig, host: str, port: int, ready: Union[asyncio.Event, None] = None) -> None:
    """Serve until cancelled (or SIGTERM/SIGINT from `main`)."""
    scorer = Scorer(config)
    runner = web.AppRunner(app_for(scorer), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:  # the port is taken or the address is not this host's: the user's setting
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    names = ", ".join(f"http://{host}:{port}/{n}" for n in config.environments) or "none configured"
    print(f"rollout rm-server: listening on http://{host}:{port}; --rm-url {names}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await scorer.aclose()


def main(argv: Union[list[str], None] = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollout rm-server",
        description="Serve slime's remote reward model protocol (--rm-url http://host:port/<env>) with the configured environments.",
    )
    p.add_argument("--config", required=True, help="pipeline YAML whose environments score")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    args = p.parse_args(argv)
    config = load_config(args.config)
    if not config.environments:
        raise ConfigError(f"config {args.config}: no environments to score with")
    from workers.validate import check_environments

    check_environments(config)  # kinds and options: a typo fails here, not in every request
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve_until_signal(config, args.host, args.port))
    return 0


async def _serve_until_signal(config: PipelineConfig, host: str, port: int) -> None:
    task = asyncio.ensure_future(serve(config, host, port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass
