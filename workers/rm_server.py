"""`rollout rm-server`: slime's remote reward model protocol (`--rm-url`), scored by the
configured environments.

slime's `remote_rm` (slime/rollout/rm_hub, also reached through `batched_async_rm` with
`--rm-type remote_rm`) POSTs `{"prompt", "response", "label"}` to `args.rm_url`, calls
`raise_for_status()` and takes `await resp.json()` as the reward; any error is retried (10
tries, backoff up to 30 s), then raised. So this server answers:

- `POST /<token>/<env>`: the environment `<env>` of the config; `POST /<token>` when the config
  has exactly one. slime's `remote_rm` sends no headers and its body has no field for either,
  so both live in the URL: `--rm-url http://host:port/<token>/<env>`. The token (`--token` or
  `$ROLLOUT_RM_TOKEN`) is compared in constant time and is in no log line (aiohttp's own error
  lines for a malformed request, which carry the raw request line, are replaced: `RequestLog`;
  aiohttp's 400 echoes that line to its sender alone) or answer of ours; whoever
  reaches the port without it drives no sandbox, judge or billed session (401). Without a token
  the paths are `/<env>` and `/`, and the server listens on a loopback address only.
- 200 and a JSON number: the environment's verification of the response as the one assistant
  turn after the environment's own prompt, with the episode's reward shaping
  (`final_reward`: nonterminal reward, clamps), as a worker would score it.
- 400 `{"error": ...}` naming the field for a body that is not slime's or does not make a task
  of the environment (no `response`, a `prompt` that is neither text nor chat messages, no
  `label` where the environment grades against one; for `math`, `arithmetic`, `calculator` a
  label that is an object, a list, true/false or NaN: the label is the gold answer); a body that
  is not JSON or is nested too deeply (`'[' * 100000`); and, with `"task_error": true`, a label
  the verifier cannot read as a gold (`TaskUngradable`: no answer could score against it). 404
  for an unknown environment. Each is counted (`Scorer.answered`).
- 503 for an outage: the environment could not score (its server down, a judge that failed, a
  masked NeMo Gym verification, a timeout); and, with `Retry-After`, when `--max-pending`
  verifications are in flight (`ServerLimits`). 408 for a body that did not arrive within
  `--body-timeout-s`; a connection that sent no whole request head within `--header-timeout-s`
  is closed. 422 for a failed measurement (`MeasurementFailed`: a checker process that died,
  an answer the verifier gave up on under `on_undecided: remove`). 500 for a bug of ours or of
  an in-process environment. Never a 0 that would be trained. An answer the verifier gave up on
  is a 200 0.0 under the default `on_undecided: zero`, counted in `Scorer.undecided` per
  environment. slime's `remote_rm` retries every error status alike (`except Exception`, 10
  tries, about 2.5 minutes) and then raises, which ends the slime run; `workers.rm_client.reward`
  (`--custom-rm-path`) removes the sample of a 422 or a long outage instead.

The task: `prompt` (a string or chat messages) and `label`; a label that is a JSON object
(or a string holding one) is the task's data row as well, `metadata` (a NeMo Gym row with
`responses_create_params` and `expected_answer`, an OpenReward `task_spec`). A NeMo Gym
row without `responses_create_params` gets one from the prompt. An optional `metadata`
object in the body is merged in (slime does not send one).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Union

from aiohttp import web

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.schema import SchemaError, Status, Task
from workers.envs.base import Environment, EpisodeRecord, MeasurementFailed, TaskUngradable
from workers.envs.registry import build_environment
from workers.envs.rewards import final_reward
from workers.errors import is_bug
from workers.validate import task_problem

log = logging.getLogger(__name__)

TOKEN_ENV = "ROLLOUT_RM_TOKEN"
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]{16,}")  # one URL path segment, long enough to guess at no rate


NESTED = "the body is nested too deeply (JSON's recursion limit)"


class BadRequest(ValueError):
    """The body is not slime's remote-RM request."""


@dataclass(frozen=True)
class ServerLimits:
    """What one client (or many) can hold of the server. Past `max_pending` verifications in
    flight (waiting for a checker included) a request is answered 503 with `Retry-After` at once
    instead of queueing without bound (slime gives up on a request after 120 s and sends it
    again, adding to the queue). A connection that has not sent a whole request head within
    `header_timeout_s` (aiohttp's keep-alive timer, armed from the connection's start) is
    closed; a body that has not arrived within `body_timeout_s` is answered 408."""

    max_pending: int = 64
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    retry_after_s: int = 1


class Scorer:
    """The configured environments, built on first use, scoring one response at a time."""

    def __init__(self, config: PipelineConfig, limits: Union[ServerLimits, None] = None):
        self.config = config
        self.limits = limits or ServerLimits()
        self.environments: dict[str, Environment] = {}
        self.scored = 0
        self.failed = 0
        self.busy = 0  # requests refused with 503 because `limits.max_pending` verifications were in flight
        self.in_flight = 0
        self.answered: collections.Counter[int] = collections.Counter()  # HTTP status -> requests answered
        self.undecided: collections.Counter[str] = collections.Counter()  # env -> answers scored 0 undecided
        self.measurements_failed: collections.Counter[str] = collections.Counter()  # env -> 422s
        self._task_checks: dict[str, Any] = {}

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
        # the body first: a caller's mistake builds no environment and starts no session or sandbox
        try:
            task = task_of(body, name, self.config.env(name).kind)
        except RecursionError:  # a label nested too deeply to encode or decode
            raise BadRequest(NESTED) from None
        problem = task_problem(task, self.config, self._task_checks, gold=False)  # the gold: TaskUngradable
        if problem:  # what the environment's `start` needs of the task (a math task's label)
            raise BadRequest(f"{problem} (the body's 'label' is the task's label; a JSON object there is its data row)")
        env = self.environment(name)
        session = await env.start(task)
        try:
            response = body["response"]
            messages = [*session.messages, {"role": "assistant", "content": response}]
            record = EpisodeRecord(task=task, messages=messages, response_text=response, status=Status.COMPLETED, turns=1)
            verification = await session.verify(record)
        finally:
            await asyncio.shield(session.close())
        if verification.components.get("undecided"):
            self.undecided[name] += 1
        return final_reward(env.config, verification, finished=False)

    async def aclose(self) -> None:
        for env in self.environments.values():
            try:
                await env.aclose()
            except Exception as exc:  # noqa: BLE001 - shutting down: say so, close the others
                log.warning("rm-server: closing environment %s failed: %r", env.name, exc)


def task_of(body: dict[str, Any], env: str, kind: str) -> Task:
    """slime's `{prompt, response, label}` as the task the environment scores; `BadRequest`
    naming the field when the body is not slime's."""
    if not isinstance(body.get("response"), str):
        what = "has no 'response'" if "response" not in body else f"'response' is {_kind(body['response'])}, not a string"
        raise BadRequest(f"the body {what} (slime's remote_rm sends prompt, response, label)")
    prompt = _prompt(body)
    label = _gold_label(body.get("label"), kind)
    row = _row(label)
    extra = body.get("metadata")
    if extra is not None and not isinstance(extra, dict):
        raise BadRequest("'metadata' must be a JSON object")
    metadata = {**row, **(extra or {})}
    if kind == "nemo_gym" and "responses_create_params" not in metadata:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        metadata["responses_create_params"] = {"input": messages}
    if kind == "nemo_skills" and row:
        label = None  # the row's expected_answer is the gold (NeMo-Skills' own field)
    if label is not None and not isinstance(label, str):
        label = json.dumps(label)
    task_id = str(metadata.get("task_id") or metadata.get("id") or "rm-server")
    try:
        return Task(id=task_id, env=env, prompt=prompt, label=label, metadata=metadata)
    except SchemaError as exc:
        raise BadRequest(str(exc)) from exc


def _prompt(body: dict[str, Any]) -> Union[str, list[dict[str, Any]]]:
    """The body's `prompt`: text, or chat messages (slime keeps them with --apply-chat-template off)."""
    if "prompt" not in body:
        raise BadRequest("the body has no 'prompt' (slime's remote_rm sends prompt, response, label)")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
        return prompt
    raise BadRequest(f"'prompt' is {_kind(prompt)}: it must be a string or a list of chat messages "
                     "({\"role\": ..., \"content\": ...})")


_JSON_KINDS = ((bool, "true/false"), (int, "a number"), (float, "a number"), (str, "a string"), (list, "a list"),
               (dict, "an object"))


def _kind(value: Any) -> str:
    """A JSON value's kind, for an error naming what came instead of what was expected."""
    if value is None:
        return "null"
    return next((name for t, name in _JSON_KINDS if isinstance(value, t)), type(value).__name__)


# kinds whose label is the gold answer itself: a JSON object there is the caller's mistake, not a gold
_GOLD_LABEL_KINDS = ("math", "arithmetic", "calculator")


def _gold_label(label: Any, kind: str) -> Any:
    """The label as the gold answer for the kinds that grade against one: a number becomes its
    text; NaN, infinities, true/false, and (for math, arithmetic, calculator) an object or a list
    are a caller's mistake (`BadRequest`), never a gold that no answer could match."""
    if kind not in (*_GOLD_LABEL_KINDS, "nemo_skills") or label is None or isinstance(label, str):
        return label
    if isinstance(label, bool) or (isinstance(label, float) and not math.isfinite(label)):
        raise BadRequest(f"'label' is {json.dumps(label)}: the {kind} environment's label is the gold answer "
                         "(a string, or a finite number)")
    if isinstance(label, (int, float)):
        return str(label)
    if kind == "nemo_skills" and isinstance(label, dict):
        return label  # the data row (its expected_answer is the gold)
    raise BadRequest(f"'label' is {_kind(label)}: the {kind} environment's label is the gold answer "
                     "(a string, or a finite number), not a data row")


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


def app_for(scorer: Scorer, token: Union[str, None] = None) -> web.Application:
    """The remote-RM app; with `token`, every path must begin with `/<token>` (`tokened_path`)."""

    async def handle(request: web.Request) -> web.Response:
        try:
            response = await _answer(request)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: answered and counted like any other
            log.error("rm-server: bug answering a request: %s", scrub(traceback.format_exc(), token))
            response = web.json_response({"error": f"bug: {type(exc).__name__}"}, status=500)
        scorer.answered[response.status] += 1
        return response

    async def _answer(request: web.Request) -> web.Response:
        path = tokened_path(request.path, token)
        if path is None:  # nothing of the request is echoed or logged: the path may hold a near-miss token
            return web.json_response({"error": "unauthorized: the URL path must begin with this rm-server's token "
                                               f"(--rm-url http://host:port/<token>/<env>, the token from --token or ${TOKEN_ENV})"},
                                     status=401)
        try:
            name = scorer.env_name(path)
            scorer.config.env(name)
        except ConfigError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        limits = scorer.limits
        # a request holds its place from its body's read (bounded by body_timeout_s) to its answer
        if scorer.in_flight >= limits.max_pending:  # before the body: a flood costs no memory
            scorer.busy += 1
            return web.json_response({"error": f"busy: {scorer.in_flight} verifications in flight (--max-pending "
                                               f"{limits.max_pending}); retry after {limits.retry_after_s}s"},
                                     status=503, headers={"Retry-After": str(limits.retry_after_s)})
        scorer.in_flight += 1
        try:
            return await _scored(request, name)
        finally:
            scorer.in_flight -= 1

    async def _scored(request: web.Request, name: str) -> web.Response:
        try:
            raw = await asyncio.wait_for(request.read(), scorer.limits.body_timeout_s)
        except asyncio.TimeoutError:
            late = web.json_response({"error": f"the body did not arrive within {scorer.limits.body_timeout_s:g}s"},
                                     status=408)
            late.force_close()  # the rest of that body would be read as the next request
            return late
        try:
            body = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError included
            return web.json_response({"error": f"bad request: the body is not JSON: {exc}"[:600]}, status=400)
        except RecursionError:  # '[' * 100000: json gave up on its depth
            return web.json_response({"error": f"bad request: {NESTED}"}, status=400)
        try:
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object {prompt, response, label}")
            reward = await scorer.score(name, body)
        except BadRequest as exc:
            return web.json_response({"error": f"bad request: {exc}"[:600]}, status=400)
        except TaskUngradable as exc:  # the caller's label: no answer could score against it
            scorer.measurements_failed[name] += 1
            return web.json_response({"error": f"bad request: {name}: the label is no gold answer the verifier "
                                               f"can read: {exc}"[:600], "task_error": True}, status=400)
        except MeasurementFailed as exc:  # the verifier could not decide: no outage, no 0 either
            scorer.measurements_failed[name] += 1
            return _failed(name, exc, 422)
        except Exception as exc:  # noqa: BLE001 - an outage is an error slime retries, never a 0
            return _failed(name, exc, 500 if is_bug(exc) else 503)
        scorer.scored += 1
        return web.json_response(reward)

    def _failed(name: str, exc: BaseException, status: int) -> web.Response:
        scorer.failed += 1
        what = {500: "bug", 422: "failed measurement"}.get(status, "environment failed")
        log.warning("rm-server: %s %s: %s: %s", name, what, status, scrub(repr(exc), token))
        return web.json_response({"error": f"{name}: {what}: {exc}"[:600]}, status=status)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/{path:.*}", handle)
    return app


def scrub(text: str, token: Union[str, None]) -> str:
    return text.replace(token, "<token>") if token else text


class RequestLog:
    """Stands in for aiohttp's server logger (`aiohttp.server`, `RequestHandler(logger=...)`):
    aiohttp logs a malformed request (a control byte in the request line, a bad HTTP version, a
    path that is not ASCII) with its parser's exception, whose text is the raw request line, and
    that line holds the token. Here: one line saying what happened and from where, at WARNING,
    never the request or the exception's text."""

    def _line(self, level: int, msg: Any, *args: Any, exc_info: Any = None, **_kw: Any) -> None:
        if exc_info is True:
            exc_info = sys.exc_info()[1]
        what = f": {type(exc_info).__name__}" if isinstance(exc_info, BaseException) else ""
        try:
            text = str(msg) % args if args else str(msg)  # aiohttp's arguments: the peer's address
        except (TypeError, ValueError):
            text = str(msg)
        log.log(max(level, logging.WARNING) if what else level, "rm-server: %s%s (the request is not shown: its "
                "path may hold the token)", text, what)

    def debug(self, msg: Any, *args: Any, **kw: Any) -> None:
        self._line(logging.DEBUG, msg, *args, **kw)

    def info(self, msg: Any, *args: Any, **kw: Any) -> None:
        self._line(logging.INFO, msg, *args, **kw)

    def warning(self, msg: Any, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def error(self, msg: Any, *args: Any, **kw: Any) -> None:
        self._line(logging.ERROR, msg, *args, **kw)

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        self._line(logging.ERROR, msg, *args, exc_info=exc_info, **kw)


def tokened_path(path: str, token: Union[str, None]) -> Union[str, None]:
    """The path after `/<token>` (None when it does not begin so), or the path itself without a
    token. The comparison takes the same time wherever the candidate differs (`hmac.compare_digest`)."""
    if token is None:
        return path
    first, _, rest = path.lstrip("/").partition("/")
    if not hmac.compare_digest(first.encode(), token.encode()):
        return None
    return "/" + rest


def check_listen(host: str, token: Union[str, None]) -> None:
    """`ConfigError` for a token that is not one URL path segment of 16+ characters, or for a
    non-loopback `host` without a token. Neither message shows the token."""
    if token is not None and not _TOKEN_CHARS.fullmatch(token):
        raise ConfigError(f"rollout rm-server: the token (--token / ${TOKEN_ENV}) must be at least 16 characters of "
                          "A-Z a-z 0-9 . _ ~ - (it is one segment of the --rm-url path); e.g. "
                          "python -c 'import secrets; print(secrets.token_urlsafe(24))'")
    if token is None and not _loopback(host):
        raise ConfigError(f"rollout rm-server: --host {host} is reachable from other machines and the server has no "
                          f"token: whoever reaches the port would drive its sandboxes, judges and billed sessions; "
                          f"set ${TOKEN_ENV} (or --token) and give slime --rm-url http://host:port/<token>/<env>, "
                          "or listen on 127.0.0.1")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


async def serve(
    config: PipelineConfig,
    host: str,
    port: int,
    ready: Union[asyncio.Event, None] = None,
    *,
    token: Union[str, None] = None,
    scorer: Union[Scorer, None] = None,
    limits: Union[ServerLimits, None] = None,
) -> None:
    """Serve until cancelled (or SIGTERM/SIGINT from `main`). `ConfigError` (`check_listen`) for a
    non-loopback host without a token. No access log and aiohttp's own error lines replaced
    (`RequestLog`): the path holds the token. `limits` (or the scorer's): `ServerLimits`."""
    check_listen(host, token)
    scorer = scorer or Scorer(config, limits)
    # lingering_time: how long aiohttp reads the unread rest of a refused body before closing (10 s by default)
    runner = web.AppRunner(app_for(scorer, token), access_log=None, logger=RequestLog(),
                           keepalive_timeout=scorer.limits.header_timeout_s, lingering_time=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:  # the port is taken or the address is not this host's: the user's setting
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    prefix = f"http://{host}:{port}" + ("/<token>" if token else "")
    names = ", ".join(f"{prefix}/{n}" for n in config.environments) or "none configured"
    whose = f" (<token>: --token or ${TOKEN_ENV})" if token else ""
    print(f"rollout rm-server: listening on http://{host}:{port}; --rm-url {names}{whose}", flush=True)
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
        description="Serve slime's remote reward model protocol (--rm-url http://host:port/<token>/<env>) with the "
                    "configured environments.",
    )
    p.add_argument("--config", required=True, help="pipeline YAML whose environments score")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); any other than loopback needs a token")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--token", default=None,
                   help=f"the secret first segment of every path (default ${TOKEN_ENV}; prefer the variable: "
                        "a flag is visible in the process list); at least 16 URL-safe characters")
    defaults = ServerLimits()
    p.add_argument("--max-pending", type=int, default=defaults.max_pending,
                   help=f"verifications in flight at most; past it a request is answered 503 with Retry-After "
                        f"(default {defaults.max_pending})")
    p.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                   help=f"a connection that sent no whole request head in this time is closed; also the idle "
                        f"keep-alive time (default {defaults.header_timeout_s:g})")
    p.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s,
                   help=f"a body not received in this time is answered 408 (default {defaults.body_timeout_s:g})")
    args = p.parse_args(argv)
    if args.max_pending < 1 or args.header_timeout_s <= 0 or args.body_timeout_s <= 0:
        raise ConfigError("rollout rm-server: --max-pending must be >= 1 and the timeouts > 0")
    limits = ServerLimits(max_pending=args.max_pending, header_timeout_s=args.header_timeout_s,
                          body_timeout_s=args.body_timeout_s)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    check_listen(args.host, token)
    config = load_config(args.config)
    if not config.environments:
        raise ConfigError(f"config {args.config}: no environments to score with")
    from workers.validate import check_environments

    check_environments(config)  # kinds and options: a typo fails here, not in every request
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve_until_signal(config, args.host, args.port, token, limits))
    return 0


async def _serve_until_signal(config: PipelineConfig, host: str, port: int, token: Union[str, None],
                              limits: ServerLimits) -> None:
    task = asyncio.ensure_future(serve(config, host, port, token=token, limits=limits))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass
