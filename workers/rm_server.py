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
  the verifier cannot read as a gold (`TaskUngradable`: no answer could score against it), or
  the text "NaN" (any case), a data set's missing value that math-verify would read. 404 for an
  unknown environment; 413 for a body over `--max-body-mib`.
- 503 for an outage: the environment could not score (its server down, a judge that failed, a
  masked NeMo Gym verification, a timeout); and, with `Retry-After`, at once, when
  `--max-pending` requests are in flight or the environment's verifier pool could not answer
  this one within `--latency-budget-s` (`ServerLimits`, `workers.rm_stats.Admission`). 408 for a
  body that did not arrive within `--body-timeout-s`; a connection that sent no whole request
  head within `--header-timeout-s` is closed. 422 for a failed measurement (`MeasurementFailed`:
  a checker process that died, an answer the verifier gave up on under `on_undecided: remove`).
  500 for a bug of ours or of an in-process environment. Never a 0 that would be trained. An
  answer the verifier gave up on is a 200 0.0 under the default `on_undecided: zero`, counted as
  undecided per environment. slime's `remote_rm` retries every error status alike (`except
  Exception`, 10 tries, about 2.5 minutes) and then raises, which ends the slime run;
  `workers.rm_client.reward` (`--custom-rm-path`) removes the sample of a 422 or a long outage
  instead.
- `GET /<token>/metrics` (`/metrics` without a token): every answer counted by status, busy 503s
  by reason, 400s, undecided answers, failed measurements, latency per environment, as
  Prometheus text (`workers.rm_stats.ServerStats`); the same summed up in a log line every
  `--stats-interval-s`. At start, `--max-body-mib` x `--max-pending` (the request bodies held
  at once) must fit `--memory-budget-mib` (`check_limits`).

The task: `prompt` (a string or chat messages) and `label`; a label that is a JSON object
(or a string holding one) is the task's data row as well, `metadata` (a NeMo Gym row with
`responses_create_params` and `expected_answer`, an OpenReward `task_spec`). A NeMo Gym
row without `responses_create_params` gets one from the prompt. An optional `metadata`
object in the body is merged in (slime does not send one).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Union

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.schema import SchemaError, Status, Task
from workers.envs.base import Environment, EpisodeRecord, MeasurementFailed, TaskUngradable
from workers.envs.math import gold_answer
from workers.envs.registry import build_environment
from workers.envs.rewards import final_reward
from workers.errors import is_bug
from workers.rm_stats import BUSY_LATENCY, BUSY_PENDING, Admission, ServerStats, verifier_workers
from workers.validate import task_problem

log = logging.getLogger(__name__)

TOKEN_ENV = "ROLLOUT_RM_TOKEN"
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]{16,}")  # one URL path segment, long enough to guess at no rate


NESTED = "the body is nested too deeply (JSON's recursion limit)"


class BadRequest(ValueError):
    """The body is not slime's remote-RM request."""


MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one client (or many) can hold of the server. Past `max_pending` requests in flight
    (from their body's read to their answer) a request is answered 503 with `Retry-After` at
    once instead of queueing without bound; so is one that its environment's verifier pool could
    not answer within `latency_budget_s` (`workers.rm_stats.Admission`: slime gives up on a
    request after 120 s and sends it again, adding to the queue; `service_prior_s` is the
    service time assumed before the first is observed). A connection that has not sent a whole
    request head within `header_timeout_s` (aiohttp's keep-alive timer, armed from the
    connection's start) is closed; a body that has not arrived within `body_timeout_s` is
    answered 408, one over `max_body_mib` 413. `max_body_mib` x `max_pending` bodies can be held
    at once: at most `memory_budget_mib` (`check_limits`)."""

    max_pending: int = 64
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    retry_after_s: int = 1
    latency_budget_s: float = 30.0
    service_prior_s: float = 10.0
    max_body_mib: int = 16
    memory_budget_mib: int = 1024
    stats_interval_s: float = 60.0


def check_limits(limits: ServerLimits) -> None:
    """`ConfigError` for limits out of range, or bodies that could outgrow the memory budget
    (naming both numbers)."""
    if limits.max_pending < 1 or limits.max_body_mib < 1 or limits.memory_budget_mib < 1:
        raise ConfigError("--max-pending, --max-body-mib and --memory-budget-mib must be >= 1")
    if min(limits.header_timeout_s, limits.body_timeout_s, limits.latency_budget_s, limits.service_prior_s,
           limits.stats_interval_s) <= 0:
        raise ConfigError("the timeouts, --latency-budget-s, --service-prior-s and "
                          "--stats-interval-s must be > 0")
    held = limits.max_body_mib * limits.max_pending
    if held > limits.memory_budget_mib:
        raise ConfigError(f"request bodies can hold {held} MiB at once (--max-body-mib "
                          f"{limits.max_body_mib} x --max-pending {limits.max_pending}), over the memory budget "
                          f"--memory-budget-mib {limits.memory_budget_mib}: lower either, or raise the budget")


class Scorer:
    """The configured environments, built on first use, scoring one response at a time."""

    def __init__(self, config: PipelineConfig, limits: Union[ServerLimits, None] = None):
        self.config = config
        self.limits = limits or ServerLimits()
        self.environments: dict[str, Environment] = {}
        self.in_flight = 0  # requests from their body's read to their answer, all environments
        self.stats = ServerStats()
        self._task_checks: dict[str, Any] = {}

    def admission(self, name: str) -> Admission:
        """Environment `name`'s verifier pool as admission sees it (`workers.rm_stats`)."""
        pool = self.stats.admissions.get(name)
        if pool is None:
            workers = verifier_workers(name, self.config.env(name), self.limits.max_pending)
            pool = Admission(workers, self.limits.latency_budget_s, self.limits.service_prior_s)
            self.stats.admissions[name] = pool
        return pool

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
        async with self.admission(name).worker():  # a caller's mistake above waits for no worker
            session = await env.start(task)
            try:
                response = body["response"]
                messages = [*session.messages, {"role": "assistant", "content": response}]
                record = EpisodeRecord(task=task, messages=messages, response_text=response, status=Status.COMPLETED,
                                       turns=1)
                verification = await session.verify(record)
            finally:
                await asyncio.shield(session.close())
        if verification.components.get("undecided"):
            self.stats.undecided[name] += 1
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
_NAN_GOLDS = ("nan", "+nan", "-nan")  # a data set's missing value, as text


def _gold_label(label: Any, kind: str) -> Any:
    """The label as the gold answer for the kinds that grade against one: a number becomes its
    text; NaN, infinities, true/false, and (for math, arithmetic, calculator) an object or a list
    are a caller's mistake (`BadRequest`), never a gold that no answer could match; the text
    "NaN" (any case, or a GSM8K label ending `#### NaN`) is a task error (`TaskUngradable`), as a
    gold math-verify cannot read is."""
    if kind not in (*_GOLD_LABEL_KINDS, "nemo_skills") or label is None:
        return label
    if isinstance(label, str):
        if gold_answer(label).strip().lower() in _NAN_GOLDS:  # math-verify reads it: \boxed{nan} would score 1
            raise TaskUngradable(f"the gold answer is {label.strip()[-40:]!r}, not a number any answer should "
                                 "match (a missing value in the data set?)")
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
    """The remote-RM app (POST) and its Prometheus metrics (GET `/metrics`); with `token`, every
    path must begin with `/<token>` (`tokened_path`)."""
    stats = scorer.stats

    async def handle(request: web.Request) -> web.Response:
        started = time.monotonic()
        name: Union[str, None] = None
        try:
            found = _environment_named(request)
            if isinstance(found, str):
                name = found
                response = await _admitted(request, name)
            else:
                response = found
        except Exception as exc:  # noqa: BLE001 - a bug of ours: answered and counted like any other
            log.error("rm-server: bug answering a request: %s", scrub(traceback.format_exc(), token))
            response = web.json_response({"error": f"bug: {type(exc).__name__}"}, status=500)
        stats.answer(response.status, name, time.monotonic() - started)
        return response

    def _environment_named(request: web.Request) -> Union[str, web.Response]:
        """The environment the path names, or the 401 / 404 that answers the request."""
        path = tokened_path(request.path, token)
        if path is None:
            return _unauthorized()
        try:
            name = scorer.env_name(path)
            scorer.config.env(name)
        except ConfigError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        return name

    async def _admitted(request: web.Request, name: str) -> web.Response:
        pool = scorer.admission(name)
        refused = _refusal(name, pool)
        if refused is not None:  # before the body: a flood costs no memory
            return refused
        # a request holds its place from its body's read (bounded by body_timeout_s) to its answer
        scorer.in_flight += 1
        pool.in_flight += 1
        try:
            return await _scored(request, name)
        finally:
            scorer.in_flight -= 1
            pool.in_flight -= 1

    def _refusal(name: str, pool: Admission) -> Union[web.Response, None]:
        """503 with Retry-After when `max_pending` requests are in flight, or when the environment's
        verifier pool could not answer this one within the latency budget; None: admitted."""
        limits = scorer.limits
        if scorer.in_flight >= limits.max_pending:
            stats.busy[(name, BUSY_PENDING)] += 1
            return _busy(f"{scorer.in_flight} verifications in flight (--max-pending {limits.max_pending})",
                         limits.retry_after_s)
        over_s = pool.over_budget_s()
        if over_s > 0:
            stats.busy[(name, BUSY_LATENCY)] += 1
            return _busy(f"{name}: {pool.in_flight} requests ahead would answer this one in about "
                         f"{pool.estimate_s():.3g}s ({pool.service_s:.3g}s each, {pool.workers} at a time), over "
                         f"--latency-budget-s {pool.budget_s:g}", max(limits.retry_after_s, math.ceil(over_s)))
        return None

    async def metrics(request: web.Request) -> web.Response:
        path = tokened_path(request.path, token)
        if path is None:
            return _unauthorized()
        if path.rstrip("/") != "/metrics":
            return web.json_response({"error": "GET serves /metrics only (POST /<env> scores)"}, status=404)
        return web.Response(body=stats.prometheus_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _scored(request: web.Request, name: str) -> web.Response:
        try:
            raw = await asyncio.wait_for(request.read(), scorer.limits.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            large = web.json_response({"error": f"bad request: the body is over --max-body-mib "
                                                f"{scorer.limits.max_body_mib} MiB"}, status=413)
            large.force_close()  # its unread rest would be read as the next request
            return large
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
            stats.measurements_failed[name] += 1
            return web.json_response({"error": f"bad request: {name}: the label is no gold answer the verifier "
                                               f"can read: {exc}"[:600], "task_error": True}, status=400)
        except MeasurementFailed as exc:  # the verifier could not decide: no outage, no 0 either
            stats.measurements_failed[name] += 1
            return _failed(name, exc, 422)
        except Exception as exc:  # noqa: BLE001 - an outage is an error slime retries, never a 0
            return _failed(name, exc, 500 if is_bug(exc) else 503)
        return web.json_response(reward)

    def _failed(name: str, exc: BaseException, status: int) -> web.Response:
        what = {500: "bug", 422: "failed measurement"}.get(status, "environment failed")
        log.warning("rm-server: %s %s: %s: %s", name, what, status, scrub(repr(exc), token))
        return web.json_response({"error": f"{name}: {what}: {exc}"[:600]}, status=status)

    app = web.Application(client_max_size=scorer.limits.max_body_mib * MIB)
    app.router.add_post("/{path:.*}", handle)
    app.router.add_get("/{path:.*}", metrics)
    return app


def _unauthorized() -> web.Response:
    """Nothing of the request is echoed or logged: the path may hold a near-miss token."""
    return web.json_response({"error": "unauthorized: the URL path must begin with this rm-server's token "
                                       f"(--rm-url http://host:port/<token>/<env>, the token from --token or ${TOKEN_ENV})"},
                             status=401)


def _busy(why: str, retry_after_s: int) -> web.Response:
    return web.json_response({"error": f"busy: {why}; retry after {retry_after_s}s"}, status=503,
                             headers={"Retry-After": str(retry_after_s)})


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
    check_limits(scorer.limits)
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
    stats_lines = asyncio.ensure_future(scorer.stats.log_every(scorer.limits.stats_interval_s))
    try:
        await asyncio.Event().wait()
    finally:
        stats_lines.cancel()
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
    p.add_argument("--latency-budget-s", type=float, default=defaults.latency_budget_s,
                   help="a request the environment's verifier pool could not answer in this time (from the requests "
                        "in flight and the observed service time) is answered 503 with Retry-After at once "
                        f"(default {defaults.latency_budget_s:g}; slime's remote_rm gives up after 120)")
    p.add_argument("--service-prior-s", type=float, default=defaults.service_prior_s,
                   help="the service time of one verification assumed before the first is observed "
                        f"(default {defaults.service_prior_s:g})")
    p.add_argument("--max-body-mib", type=int, default=defaults.max_body_mib,
                   help=f"a larger body is answered 413 (default {defaults.max_body_mib})")
    p.add_argument("--memory-budget-mib", type=int, default=defaults.memory_budget_mib,
                   help="--max-body-mib x --max-pending must fit in it, or the server does not start "
                        f"(default {defaults.memory_budget_mib})")
    p.add_argument("--stats-interval-s", type=float, default=defaults.stats_interval_s,
                   help=f"seconds between the log lines of counts and latency (default {defaults.stats_interval_s:g})")
    args = p.parse_args(argv)
    limits = ServerLimits(max_pending=args.max_pending, header_timeout_s=args.header_timeout_s,
                          body_timeout_s=args.body_timeout_s, latency_budget_s=args.latency_budget_s,
                          service_prior_s=args.service_prior_s, max_body_mib=args.max_body_mib,
                          memory_budget_mib=args.memory_budget_mib, stats_interval_s=args.stats_interval_s)
    check_limits(limits)
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
