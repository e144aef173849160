"""Chaos: engine faults and environment-server faults during a whole run.

Real parts end to end: redis-server, `rollout workers` processes (arq), the producer
with admission control, the slime data source in a trainer thread that updates the
engine's weights after every step (pause -> new weight version -> continue, which aborts
running requests as SGLang does), an engine of the session's stack (SGLang's own HTTP front
and TokenizerManager over the simulator as scheduler, tests/support/engine_stack.py), and a NeMo
Gym-protocol resources server. Faults are injected on a schedule keyed by task index, so every
failure has a known cause:

- engine (a loopback proxy in front of the engine, where a router stands in a cluster: the faults
  are ones SGLang's front cannot be made to answer on cue): 5xx bursts within and beyond the
  retry budget, garbage 200 bodies once and always, a hang past the request timeout,
  `/abort_request` mid-generation;
- environment: 5xx bursts on /seed_session and /verify within and beyond the budget,
  /evaluate hanging once and always, a `drop_group` environment whose seeding always
  fails (dead-lettered), and a window in which the server does not listen at all.

Asserts: every epoch-0 task trained exactly once or dead-lettered (0 lost, 0 duplicates);
no request tried more than `max_retries + 1` times; the failed episodes are exactly the
injected failures beyond their budgets (plus the refused window's, by their reason); the
`episodes`/`episodes_failed` counters match the pushed groups; aborted turns resumed and
carry the new weight version. Run alone: `python -m pytest tests/chaos/test_chaos_faults.py -s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.request
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis as redis_sync
from aiohttp import ClientSession, ClientTimeout, web

from pipeline.config import parse_config
from pipeline.keys import Counter, Keys
from pipeline.schema import decode_group
from pipeline.store.local_redis import free_port
from tests.support.chaos_helpers import Trainer, trained_key, wait_workers
from tests.support.engine_stack import START_TIMEOUT_S
from tests.support.env_helpers import COOKIE, EVALUATE_TOOL, GymServer

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(START_TIMEOUT_S + 180)]  # + the session stack's start

TASKS, BATCH, N, ETA = 100, 8, 2, 4
MAX_RETRIES = 2  # engine.max_retries: at most 3 requests per rid
REQUEST_TIMEOUT_S, ENGINE_HANG_S = 3.0, 4.0
ENV_BUDGET = {"timeout_s": 1.0, "retries": 2, "backoff_s": 0.05}
ENV_HANG_S = 1.5
REFUSED_WINDOW_S = 1.0
ABORT_AFTER_S = 0.03
MAX_TRIES = 2  # workers.max_tries: a drop_group group failing twice is dead-lettered

# Engine faults, on odd task indices: i % 20 -> (episode index, turn, fault). Only a
# turn's first request (rid suffix ".0") is faulted; a resumed request is not.
ENGINE_PLAN = {
    1: (0, 0, "burst_ok"),  # 503 x max_retries, then served
    3: (1, 1, "burst_dead"),  # 503 every time: the episode fails
    5: (0, 1, "garbage_once"),  # a 200 with a garbage body, then served
    7: (1, 0, "garbage_dead"),  # garbage every time: the episode fails
    9: (0, 0, "hang"),  # no answer within the request timeout: fails, /abort_request sent
    11: (0, 1, "abort"),  # /abort_request mid-generation: the turn resumes
    13: (1, 0, "abort"),
}
ENGINE_FAILS = {"burst_dead", "garbage_dead", "hang"}
# Environment faults, on even task indices: i % 20 -> (environment, fault).
ENV_PLAN = {
    2: ("gym", "seed_burst"),  # /seed_session 503 x retries per task, then served
    4: ("gym", "seed_dead"),  # /seed_session 503 always: both episodes fail
    6: ("gym", "evaluate_hang_once"),  # the first /evaluate of each session hangs past the timeout
    8: ("gym", "evaluate_hang"),  # every /evaluate hangs: sent once, the timeout is the model's observation
    10: ("gym", "verify_burst"),  # /verify 503 x retries per session, then served
    12: ("gym", "verify_dead"),  # /verify 503 always: both episodes fail
    14: ("strict", "seed_dead"),  # drop_group: the group fails every try -> dead letter
    16: ("strict", None),  # drop_group without faults: trained
}
# A tool call is never re-sent (the server may have run it): a hung /evaluate becomes the tool's
# answer the model sees, and the episode goes on, as NeMo Gym's simple_agent does.
ENV_FAILS = {"seed_dead", "verify_dead"}
# What an episode that met the refused window (or its closing connections) fails with.
REFUSED = re.compile(r"Cannot connect|Connect call failed|ServerDisconnected|Connection reset|ClientOSError")


def task_index(text: str) -> int:
    """The task index in a task, job, group or request id (`{ns}-t{i}:...`)."""
    return int(re.search(r"-t(\d+)(?::|$)", text).group(1))  # type: ignore[union-attr]


def engine_fault(rid: str) -> str | None:
    """The planned fault of one request id `{job}/{episode}/{try}:t{turn}.{resume}`."""
    episode_key, _, turn_part = rid.rpartition(":t")
    job, episode, _try = episode_key.rsplit("/", 2)
    plan = ENGINE_PLAN.get(task_index(job) % 20)
    turn, resume = turn_part.split(".")
    if plan is None or resume != "0" or (int(episode), int(turn)) != plan[:2]:
        return None
    return plan[2]


def engine_action(fault: str | None, attempt: int) -> str:
    return {
        "burst_ok": "503" if attempt < MAX_RETRIES else "ok",
        "burst_dead": "503",
        "garbage_once": "garbage" if attempt == 0 else "ok",
        "garbage_dead": "garbage",
        "hang": "hang",
        "abort": "abort" if attempt == 0 else "ok",
    }.get(fault or "", "ok")


# ---------------------------------------------------------------- engine proxy


class FaultProxy:
    """Loopback proxy in front of the engine: `/generate` gets the planned fault, the rest passes."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.ledger: dict[str, list[str]] = defaultdict(list)  # rid -> action per attempt
        self.aborts_received: list[str] = []  # /abort_request rids sent by workers
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: ClientSession | None = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rid = str(msgspec.json.decode(body)["rid"])
        base = rid.split("~", 1)[0]  # a retry is `{rid}~{k}` (workers/engine.py): one ledger per request
        action = engine_action(engine_fault(base), len(self.ledger[base]))
        self.ledger[base].append(action)
        if action == "503":
            return web.json_response({"object": "error", "message": "injected overload", "code": 503}, status=503)
        if action == "garbage":
            return web.Response(body=b'{"text": "trunc\x00ated', content_type="application/json")
        if action == "hang":
            await asyncio.sleep(ENGINE_HANG_S)
            return web.json_response({"message": "too late"}, status=504)
        if action == "abort":
            self._spawn(self._abort_later(rid))
        return await self._forward(request, body)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/abort_request":
            self.aborts_received.append(str(msgspec.json.decode(body).get("rid")))
        return await self._forward(request, body)

    async def _forward(self, request: web.Request, body: bytes) -> web.Response:
        assert self._http is not None
        # Host passes too (the simulator alone answers GET /workers with its own Host); SGLang's
        # front answers it 404, so the workers take this proxy for the engine and abort through it.
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("content-type", "x-smg-routing-key", "host")}
        async with self._http.request(request.method, self.upstream + request.path, data=body, headers=headers) as up:
            return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)

    async def _abort_later(self, rid: str) -> None:
        await asyncio.sleep(ABORT_AFTER_S)
        assert self._http is not None
        async with self._http.post(f"{self.upstream}/abort_request", json={"rid": rid}) as resp:
            await resp.read()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self.generate)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        return app

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        self._http = ClientSession(timeout=ClientTimeout(total=30))
        listener = Listener(self.app)
        await listener.start()
        try:
            yield listener.url
        finally:
            await listener.stop()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._http.close()


class Listener:
    """Serves `make_app()` on a fixed loopback port; `refuse_for(s)` stops listening (and drops
    open connections) for s seconds, then serves a fresh app on the same port."""

    def __init__(self, make_app: Callable[[], web.Application]):
        self.make_app, self.port = make_app, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None
        self.refused_s = 0.0

    async def start(self) -> None:
        self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def refuse_for(self, seconds: float) -> None:
        started = time.monotonic()
        await self.stop()
        await asyncio.sleep(seconds)
        await self.start()
        self.refused_s = time.monotonic() - started


# ---------------------------------------------------------------- environment server


class PlannedGym(GymServer):
    """The NeMo Gym-protocol server of tests/support/env_helpers.py with faults planned per task and session."""

    def __init__(self) -> None:
        super().__init__()
        self.session_task: dict[str, int] = {}  # cookie -> task index
        self.calls: Tally[tuple[Any, str]] = Tally()  # (task or cookie, path) -> requests seen
        self.injected: Tally[str] = Tally()  # "path action" -> count

    def _action(self, request: web.Request, task: int) -> str | None:
        fault = ENV_PLAN.get(task % 20, ("", None))[1]
        retries = ENV_BUDGET["retries"]
        if request.path == "/seed_session":
            seen = self.calls[(task, request.path)]
            return "500" if fault == "seed_dead" or (fault == "seed_burst" and seen < retries) else None
        seen = self.calls[(request.cookies.get(COOKIE), request.path)]
        if request.path == "/evaluate" and (fault == "evaluate_hang" or (fault == "evaluate_hang_once" and seen == 0)):
            return "hang"
        if request.path == "/verify" and (fault == "verify_dead" or (fault == "verify_burst" and seen < retries)):
            return "500"
        return None

    @web.middleware
    async def _inject_faults(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/seed_session":
            task = int((await request.json())["chaos_task"])
            key: Any = task
        else:
            key = request.cookies.get(COOKIE, "")
            task = self.session_task.get(key, -1)
        action = self._action(request, task)
        self.calls[(key, request.path)] += 1
        if action is not None:
            self.injected[f"{request.path} {action}"] += 1
        if action == "500":
            return web.json_response({"detail": "injected"}, status=500)
        if action == "hang":
            await request.read()  # the handler reads it after the client has given up
            await asyncio.sleep(ENV_HANG_S)
        response = await handler(request)
        if request.path == "/seed_session" and COOKIE in response.cookies:
            self.session_task[response.cookies[COOKIE].value] = task
        return response


# ---------------------------------------------------------------- the run


def _gym_row(i: int, question: str) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}], "tools": [EVALUATE_TOOL]},
        "question": question, "expected_answer": str(2 * i), "chaos_task": i,
    }


def _write_tasks(path: Path, ns: str) -> dict[str, int]:
    """tasks.jsonl; returns task id -> index."""
    ids = {f"{ns}-t{i}": i for i in range(TASKS)}
    lines = []
    for tid, i in ids.items():
        question = f"What is {i} + {i}?"
        env = ENV_PLAN.get(i % 20, ("gym",))[0]
        lines.append(json.dumps({"id": tid, "env": env, "prompt": question, "label": str(2 * i),
                                 "metadata": _gym_row(i, question)}))
    path.write_text("\n".join(lines) + "\n")
    return ids


def _config(redis_url: str, ns: str, engine_url: str, gym_url: str, tokenizer: str) -> dict:
    timeouts = {"start": ENV_BUDGET, "step": ENV_BUDGET, "verify": ENV_BUDGET, "verify_deadline_s": 30.0}
    gym = {"kind": "nemo_gym", "options": {"url": gym_url}, "timeouts": timeouts}
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine_url, "tokenizer": tokenizer, "max_retries": MAX_RETRIES, "retry_backoff_s": 0.05,
                   "request_timeout_s": REQUEST_TIMEOUT_S},
        "rollout": {"n_samples_per_prompt": N, "rollout_batch_size": BATCH, "eta": ETA, "max_response_tokens": 512},
        "environments": {"gym": gym, "strict": {**gym, "on_failure": "drop_group", "weight": 0.1}},
        "workers": {"concurrency": 8, "heartbeat_s": 0.5, "dead_after_s": 2.0, "poll_delay_s": 0.02,
                    "max_tries": MAX_TRIES, "drain_grace_s": 5.0},
    }


def _weight_updater(engine_url: str) -> Callable[[int], None]:
    """slime's update_weights as the engine sees it: pause (aborts running requests), new version, continue."""

    def post(path: str, body: dict) -> None:
        request = urllib.request.Request(engine_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            resp.read()

    def after_step(rollout_id: int) -> None:
        post("/pause_generation", {})
        post("/update_weight_version", {"new_version": str(rollout_id + 1)})
        post("/continue_generation", {})

    return after_step


def _dead_letters(redis_url: str, keys: Keys) -> list[tuple[str, int, str, bool]]:
    """(task, epoch, reason, final) per dead letter; not final = the task was handed back for re-admission."""
    client = redis_sync.Redis.from_url(redis_url)
    try:
        entries = client.xrange(keys.dead)
    finally:
        client.close()
    out = []
    for _, fields in entries:
        task, epoch = trained_key(fields[b"ref"].decode().removeprefix(f"{keys.ns}:"))  # arq job id or group id
        reason = fields[b"reason"].decode()
        out.append((task, epoch, reason, "handed back for re-admission" not in reason))
    return out


def _given_up(redis_url: str, keys: Keys, epoch: int = 0) -> set[str]:
    return {task for task, e, _reason, final in _dead_letters(redis_url, keys) if final and e == epoch}


async def _stop_all(workers: list, producer: asyncio.Task | None, stop: asyncio.Event) -> None:
    stop.set()
    if producer is not None:
        await asyncio.wait_for(asyncio.gather(producer, return_exceptions=True), 15)
    # SIGTERM drain in threads: the engine and env servers they need live on this loop
    await asyncio.gather(*(asyncio.to_thread(w.stop, 15) for w in workers))


async def _run(redis, redis_url: str, keys: Keys, tmp_path: Path, proxy: FaultProxy, gym: Listener,
               engine_url: str, task_ids: dict[str, int]) -> tuple[Trainer, float]:
    from producers.enqueue import ProducerOptions, run_producer
    from scripts.processes import WorkerProcess, write_config
    from workers.sim.tokenizer import default_tokenizer_path

    async with proxy.serve() as proxy_url:
        data = _config(redis_url, keys.ns, proxy_url, gym.url, default_tokenizer_path())
        config_path = write_config(data, tmp_path / "pipeline.yaml")
        workers = [WorkerProcess(config_path, log_path=str(tmp_path / f"w{i}.log")).start() for i in range(2)]
        stop, producer = asyncio.Event(), None
        try:
            await wait_workers(redis, keys, 2)
            started = time.monotonic()
            producer = asyncio.create_task(run_producer(parse_config(data), tmp_path / "tasks.jsonl", follow=True,
                                                        stop_event=stop, options=ProducerOptions(max_requeues=1)))
            epoch0 = set(task_ids)

            def done(t: Trainer) -> bool:  # every epoch-0 task trained or dead-lettered
                return epoch0 <= t.trained_tasks(0) | _given_up(redis_url, keys)

            trainer = Trainer(redis_url, keys.ns, batch=BATCH, n=N, eta=ETA, max_steps=4 * TASKS // BATCH,
                              done=done, after_step=_weight_updater(engine_url))
            trainer.start()
            while trainer.is_alive() and trainer.steps < 3:
                await asyncio.sleep(0.05)
            await gym.refuse_for(REFUSED_WINDOW_S)
            await asyncio.to_thread(trainer.join_and_check, 150)
            return trainer, time.monotonic() - started
        finally:
            await _stop_all(workers, producer, stop)


async def test_engine_and_env_faults_are_bounded_counted_and_the_run_completes(
    redis, redis_url, keys, namespace, tmp_path
):
    from tests.support.engine_stack import shared_stack

    task_ids = _write_tasks(tmp_path / "tasks.jsonl", namespace)
    stack = await asyncio.to_thread(shared_stack)
    await asyncio.to_thread(stack.configure, 0, tool_use=1.0, token_latency_s=0.01, latency_sigma=0.3, length_mu=3.0,
                            length_sigma=0.5, max_filler_tokens=60, slots=64)
    engine_url = stack.engine_urls[0]  # one SGLang front: its aborts come back through the proxy
    _weight_updater(engine_url)(-1)  # label "0", as slime's first push
    planned = PlannedGym()
    gym = Listener(planned.app)
    await gym.start()
    try:
        proxy = FaultProxy(engine_url)
        trainer, wall_s = await _run(redis, redis_url, keys, tmp_path, proxy, gym, engine_url, task_ids)
    finally:
        await gym.stop()

    pushed = await _pushed_samples(redis, keys, trainer)
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    dead = _dead_letters(redis_url, keys)
    report = {**_report(trainer, pushed, counters, dead, proxy, planned, set(task_ids)),
              "refused_window_s": round(gym.refused_s, 2), "wall_s": round(wall_s, 1)}
    print("\nCHAOS engine/env faults report:", json.dumps(report))

    # the run completed: every epoch-0 task trained once, or dead-lettered as planned with its reason
    assert report["lost"] == 0 and report["duplicates"] == 0, report
    doomed = {t for t, i in task_ids.items() if ENV_PLAN.get(i % 20) == ("strict", "seed_dead")}
    assert _given_up(redis_url, keys) == doomed
    for task, _epoch, reason, final in dead:  # a drop_group group may also die twice in the refused window
        handed_back_for = "POST /seed_session" if task in doomed else REFUSED
        assert (final and task in doomed) or (not final and re.search(handed_back_for, reason)), reason
    # bounded retries: each request id saw exactly its planned attempts, never more than max_retries + 1
    for rid, actions in proxy.ledger.items():
        assert actions == EXPECTED_ATTEMPTS[engine_fault(rid)], (rid, actions)
    hung = {rid for rid, actions in proxy.ledger.items() if actions == ["hang"]}
    assert hung and hung <= set(proxy.aborts_received)  # a timed-out request is aborted on the engine
    # failures counted: the failed episodes are the planned ones past their budgets (+ the refused window's)
    _assert_failures(pushed, proxy)
    assert counters[Counter.EPISODES] == report["episodes"]
    assert counters[Counter.EPISODES_FAILED] == report["episodes_failed"]
    assert set(report["engine_injected"]) == {"503", "garbage", "hang", "abort"}
    assert set(planned.injected) == {"/seed_session 500", "/evaluate hang", "/verify 500"}
    # aborted turns resumed; those across a weight update carry both versions
    _assert_resumed(pushed)
    assert report["resumed_across_weight_update"] > 0 and report["failed_by_cause"].get("refused_window"), report


FAILURE_CAUSES = {  # planned fault -> what the failed episode's error says
    "burst_dead": "gave up after 3 attempts: HTTP 503", "garbage_dead": "gave up after 3 attempts: undecodable",
    "hang": f"within {REQUEST_TIMEOUT_S}s", "seed_dead": "POST /seed_session",
    "verify_dead": "POST /verify",
}


def _assert_failures(pushed: dict[str, list[Episode]], proxy: FaultProxy) -> None:
    engine_failed = _engine_failed(proxy)
    for episode in (e for group in pushed.values() for e in group):
        planned = _expected_failure(episode, engine_failed)
        if REFUSED.search(episode.error):  # the refused window may fail any episode first
            assert episode.status == "failed"
            continue
        assert (episode.status == "failed") == planned, episode
        if planned:
            cause = _planned_cause(episode, engine_failed, proxy)
            assert FAILURE_CAUSES[cause] in episode.error, (cause, episode.error)


def _planned_cause(episode: Episode, engine_failed: set[str], proxy: FaultProxy) -> str:
    env_fault = ENV_PLAN.get(task_index(episode.group_id) % 20, ("", None))[1]
    if env_fault in ENV_FAILS:
        return str(env_fault)
    prefix = f"{episode.group_id}/{episode.index}/"
    return next(str(engine_fault(rid)) for rid in proxy.ledger if rid.startswith(prefix) and engine_fault(rid))


def _cause(episode: Episode, engine_failed: set[str], proxy: FaultProxy) -> str:
    if REFUSED.search(episode.error):
        return "refused_window"
    if _expected_failure(episode, engine_failed):
        return _planned_cause(episode, engine_failed, proxy)
    return "unplanned"


def _assert_resumed(pushed: dict[str, list[Episode]]) -> None:
    for episode in (e for group in pushed.values() for e in group):
        if not any(t.get("aborts") for t in episode.turn_log):
            continue
        for turn in episode.turn_log:
            assert len(turn["weight_versions"]) == turn["aborts"] + 1, turn  # one version per generate call
        assert episode.weight_versions == [v for t in episode.turn_log for v in t["weight_versions"]]


# ---------------------------------------------------------------- accounting


class Episode(msgspec.Struct):
    """One pushed sample, the same whether the trainer took it or it is still in the stream."""

    group_id: str
    index: int
    status: str
    error: str
    turn_log: list[dict[str, Any]]
    weight_versions: list[str]


async def _pushed_samples(redis, keys: Keys, trainer: Trainer) -> dict[str, list[Episode]]:
    """group id -> its episodes, for every group pushed: trained, or still in the stream after the drain."""
    pushed: dict[str, list[Episode]] = {}
    for group in trainer.groups:
        gid = group[0].metadata["pipeline"]["group_id"]
        # the engine's labels: slime's `weight_versions` carries the policy versions (docs/architecture.md)
        pushed[gid] = [_episode(gid, j, s.status.value, s.metadata, s.metadata["engine_weight_versions"])
                       for j, s in enumerate(group)]
    for _stream_id, fields in await redis.xrange(keys.groups):
        g = decode_group(fields[b"g"])
        pushed.setdefault(g.group_id, [_episode(g.group_id, j, s.status.value, s.metadata, s.weight_versions)
                                       for j, s in enumerate(g.samples)])
    return pushed


def _episode(gid: str, j: int, status: str, metadata: dict, versions: list[str]) -> Episode:
    return Episode(gid, j, status, str(metadata.get("error", "")), list(metadata.get("turn_log", [])), list(versions))


def _engine_failed(proxy: FaultProxy) -> set[str]:
    """Episode keys `{job}/{episode}` whose request was faulted past the retry budget, or hung."""
    failed = set()
    for rid, actions in proxy.ledger.items():
        over_budget = len(actions) == MAX_RETRIES + 1 and "ok" not in actions and "abort" not in actions
        if over_budget or actions[-1] == "hang":
            failed.add(rid.rsplit("/", 1)[0])
    return failed


def _expected_failure(episode: Episode, engine_failed: set[str]) -> bool:
    env_fault = ENV_PLAN.get(task_index(episode.group_id) % 20, ("", None))[1]
    return env_fault in ENV_FAILS or f"{episode.group_id}/{episode.index}" in engine_failed


EXPECTED_ATTEMPTS = {
    None: ["ok"], "burst_ok": ["503"] * MAX_RETRIES + ["ok"], "burst_dead": ["503"] * (MAX_RETRIES + 1),
    "garbage_once": ["garbage", "ok"], "garbage_dead": ["garbage"] * (MAX_RETRIES + 1), "hang": ["hang"],
    "abort": ["abort"],
}


def _report(trainer: Trainer, pushed: dict[str, list[Episode]], counters: dict[str, int],
            dead: list[tuple[str, int, str, bool]], proxy: FaultProxy, planned: PlannedGym, task_ids: set[str]) -> dict:
    trained0 = Tally(t for t, e in trainer.trained() if e == 0)
    dead0 = {t for t, e, _reason, final in dead if final and e == 0}
    episodes = [e for group in pushed.values() for e in group]
    failed = [e for e in episodes if e.status == "failed"]
    engine_failed = _engine_failed(proxy)
    resumed = [t for e in episodes for t in e.turn_log if t.get("aborts")]
    return {
        "tasks": TASKS, "steps": trainer.steps, "groups_trained": len(trainer.groups), "groups_pushed": len(pushed),
        "lost": len(task_ids - set(trained0) - dead0),
        "duplicates": sum(1 for c in trained0.values() if c > 1) + len(dead0 & set(trained0)),
        "dead_letters": len(dead), "given_up_epoch0": len(dead0),
        "engine_requests": sum(len(a) for a in proxy.ledger.values()),
        "engine_injected": dict(Tally(a for actions in proxy.ledger.values() for a in actions if a != "ok")),
        "attempts_per_request": dict(sorted(Tally(len(a) for a in proxy.ledger.values()).items())),
        "abort_requests_from_workers": len(proxy.aborts_received),
        "env_injected": dict(planned.injected),
        "episodes": len(episodes), "episodes_failed": len(failed),
        "failed_by_cause": dict(Tally(_cause(e, engine_failed, proxy) for e in failed).most_common()),
        "groups_all_failed": sum(1 for g in pushed.values() if all(e.status == "failed" for e in g)),
        "counter_episodes": counters.get(Counter.EPISODES, 0),
        "counter_episodes_failed": counters.get(Counter.EPISODES_FAILED, 0),
        "counter_jobs_failed": counters.get(Counter.FAILED, 0),
        "turns_resumed": len(resumed),
        "resumed_across_weight_update": sum(1 for t in resumed if len(set(t["weight_versions"])) > 1),
    }
