"""A SIMULATED SGLang engine: a real aiohttp server with SGLang's native endpoints and a
scripted policy instead of a model. It is the engine of the demo, the tests and the
benchmarks; it is never a stand-in for measuring model quality.

Endpoints (PROTOCOLS.md): POST /generate, GET /health, GET /model_info,
POST /abort_request, POST /pause_generation, POST /continue_generation,
POST /update_weight_version. Simulator-only, under /sim/: POST /sim/fail_next
{"status", "count", "message"} (inject HTTP errors) and GET /sim/stats.

The policy works on the real test tokenizer (workers.sim.tokenizer). For each turn
it decodes the input ids, finds the last user question and:
- if tools are offered (`<tools>` in the system prompt) and no tool answered yet,
  calls one (probability `tool_use`) in Hermes format: `<tool_call>{json}</tool_call>`;
- otherwise answers `... Answer: X`. X is right with probability `accuracy`. The
  simulator knows the right answer only by evaluating an arithmetic question
  ("What is 12 * 7?") itself or by looking the question up in tasks given with
  `--tasks FILE` (tasks.jsonl with labels): it is told the answers, it does not
  reason.
Response length: a lognormal number of filler tokens (long tail). Latency: per token,
lognormal around `token_latency_s` (0 = answer at once, for benchmarks). At most
`slots` generations run at once; the rest queue, as in SGLang's scheduler.
A turn's plan is seeded by (seed, routing key, context length), so a request resumed
after an abort continues the same plan, and the n episodes of a group differ.

`rollout engine --port P [...]` serves it; `serve_sim_engine(SimConfig())` is an async
context manager that serves it in the caller's event loop and yields the URL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec
import numpy as np
from aiohttp import web

from pipeline.schema import SamplingParams, Task

log = logging.getLogger(__name__)

_QUESTION = re.compile(r"(?:what is|compute|calculate|evaluate)\s+([-+*/%().\d\s]+?)\s*[?.=]?\s*$", re.IGNORECASE)
_FILLER_WORDS = (
    "the answer is that let me think about this step by step first we have then we get so result check "
    "again compute and multiply add numbers total is value of it for with hmm wait right ok"
).split()
_json = msgspec.json.Encoder()
_sampling_decoder = msgspec.json.Decoder(SamplingParams)


@dataclass
class SimConfig:
    accuracy: float = 0.7  # probability that a final answer is right
    tool_use: float = 0.9  # probability to call a tool first when tools are offered
    malformed_rate: float = 0.0  # probability that a tool call is broken JSON
    length_mu: float = 3.5  # lognormal filler length: exp(mu) ~ 33 tokens median
    length_sigma: float = 0.8
    max_filler_tokens: int = 2048
    token_latency_s: float = 0.0  # mean per output token; 0 = no sleeping at all
    latency_sigma: float = 0.5
    slots: int = 256  # concurrent generations; the rest wait (0 = unlimited)
    context_length: int = 32768
    weight_version: str = "default"
    seed: int = 0
    tokenizer_path: str = ""  # "" = the shared test tokenizer
    answers: dict[str, str] = field(default_factory=dict)  # question text -> label (from --tasks)


@dataclass
class _Running:
    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    message: str = ""


class SimEngine:
    def __init__(self, config: SimConfig):
        from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

        self.config = config
        self.tokenizer_path = config.tokenizer_path or default_tokenizer_path()
        self.tokenizer = load_test_tokenizer(self.tokenizer_path)
        self.eos_id: int = self.tokenizer.eos_token_id
        self.weight_version = config.weight_version
        self._filler_ids = self._single_token_words()
        self._assistant_header = self.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self._slots = asyncio.Semaphore(config.slots) if config.slots > 0 else None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running: dict[str, _Running] = {}
        self._faults: list[tuple[int, str]] = []
        self.stats: dict[str, Any] = {"requests": 0, "aborted": 0, "max_running": 0, "routing_keys": {}, "errors": 0}

    def _single_token_words(self) -> list[int]:
        ids = [self.tokenizer.encode(" " + w, add_special_tokens=False) for w in _FILLER_WORDS]
        return [i[0] for i in ids if len(i) == 1] or [i[0] for i in ids]

    # ------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.get("/health", self.health),
                web.get("/model_info", self.model_info),
                web.get("/get_model_info", self.model_info),
                web.post("/abort_request", self.abort_request),
                web.post("/pause_generation", self.pause),
                web.post("/continue_generation", self.resume),
                web.post("/update_weight_version", self.update_weight_version),
                web.post("/sim/fail_next", self.fail_next),
                web.get("/sim/stats", self.get_stats),
            ]
        )
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "simulated-engine",
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "weight_version": self.weight_version,
                "context_length": self.config.context_length,
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        targets = list(self._running.values()) if body.get("abort_all") else [self._running.get(body.get("rid", ""))]
        for running in targets:
            if running is not None:
                running.message = "Abort request"
                running.aborted.set()
        return web.json_response({})

    async def pause(self, _request: web.Request) -> web.Response:
        """SGLang's default pause mode: abort running requests, hold new ones until continue."""
        self._resumed.clear()
        for running in self._running.values():
            running.message = "Abort for pause generation"
            running.aborted.set()
        return web.json_response({})

    async def resume(self, _request: web.Request) -> web.Response:
        self._resumed.set()
        return web.json_response({})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"weight version {self.weight_version}"})

    async def fail_next(self, request: web.Request) -> web.Response:
        body = await request.json()
        fault = (int(body.get("status", 503)), str(body.get("message", "simulated failure")))
        self._faults += [fault] * int(body.get("count", 1))
        return web.json_response({"queued": len(self._faults)})

    async def get_stats(self, _request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "weight_version": self.weight_version, "running": len(self._running)})

    # ------------------------------------------------------------ generate

    async def generate(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        self.stats["requests"] += 1
        if self._faults:
            status, message = self._faults.pop(0)
            return _error(status, message)
        body = msgspec.json.decode(await request.read())
        input_ids, rid = body.get("input_ids"), str(body.get("rid") or f"sim-{self.stats['requests']}")
        try:
            sampling = _sampling_decoder.decode(_json.encode(body.get("sampling_params") or {}))
        except msgspec.ValidationError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if not isinstance(input_ids, list) or not input_ids:
            return _error(400, "input_ids must be a non-empty list of token ids")
        if len(input_ids) >= self.config.context_length:
            return web.json_response(
                {
                    "error": {
                        "message": f"The input ({len(input_ids)} tokens) is longer than the model's context "
                        f"length ({self.config.context_length} tokens)."
                    }
                },
                status=400,
            )
        routing_key = request.headers.get("X-SMG-Routing-Key") or body.get("routing_key") or rid
        keys = self.stats["routing_keys"]
        keys[routing_key] = keys.get(routing_key, 0) + 1
        await self._resumed.wait()
        async with self._slot():
            ids, log_probs, finish = await self._run(rid, input_ids, routing_key, sampling)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(log_probs, ids)],
            "e2e_latency": time.monotonic() - started,
        }
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return web.Response(body=_json.encode({"text": text, "output_ids": ids, "meta_info": meta}),
                            content_type="application/json")

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            yield
            return
        async with self._slots:
            yield

    async def _run(
        self, rid: str, input_ids: list[int], routing_key: str, sampling: SamplingParams
    ) -> tuple[list[int], list[float], dict[str, Any]]:
        plan_ids, plan_lps, done = self._plan(input_ids, routing_key)
        budget = sampling.max_new_tokens if sampling.max_new_tokens is not None else 128
        budget = min(budget, self.config.context_length - len(input_ids))
        ids, lps = plan_ids[done : done + budget], plan_lps[done : done + budget]
        running = _Running(rid)
        self._running[rid] = running
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        try:
            produced = await self._emit(running, len(ids))
        finally:
            self._running.pop(rid, None)
        if produced < len(ids):
            self.stats["aborted"] += 1
            finish: dict[str, Any] = {"type": "abort", "message": running.message}
        elif ids and ids[-1] == self.eos_id:
            finish = {"type": "stop", "matched": self.eos_id}
        else:
            finish = {"type": "length", "length": len(ids)}
        return ids[:produced], lps[:produced], finish

    async def _emit(self, running: _Running, n_tokens: int) -> int:
        """Spend the simulated decode time; returns how many tokens were produced before an abort."""
        if self.config.token_latency_s <= 0 or n_tokens == 0:
            return 0 if running.aborted.is_set() else n_tokens
        rng = np.random.default_rng()
        per_token = self.config.token_latency_s * rng.lognormal(0.0, self.config.latency_sigma)
        produced, step = 0, max(1, int(0.02 / per_token))  # wake up ~every 20 ms
        while produced < n_tokens:
            chunk = min(step, n_tokens - produced)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(running.aborted.wait(), chunk * per_token)
            if running.aborted.is_set():
                return produced
            produced += chunk
        return produced

    # ------------------------------------------------------------ policy

    def _plan(self, input_ids: list[int], routing_key: str) -> tuple[list[int], list[float], int]:
        """This turn's full response (ids, log-probs) and how much of it the input already holds."""
        turn_start = _rfind(input_ids, self._assistant_header)
        context_end = turn_start if turn_start >= 0 else len(input_ids)
        done = len(input_ids) - (turn_start + len(self._assistant_header)) if turn_start >= 0 else 0
        context = self.tokenizer.decode(input_ids[:context_end], skip_special_tokens=False)
        seed = int.from_bytes(
            hashlib.blake2b(f"{self.config.seed}|{routing_key}|{context_end}".encode(), digest_size=8).digest(), "little"
        )
        rng = np.random.default_rng(seed)
        body_ids = self._respond(context, rng)
        ids = body_ids + [self.eos_id]
        log_probs = (-np.abs(rng.normal(0.0, 0.4, size=len(ids)))).astype(np.float32).tolist()
        return ids, log_probs, min(done, len(ids))

    def _respond(self, context: str, rng: np.random.Generator) -> list[int]:
        question, after_question = _last_question(context)
        tools = _offered_tools(context)
        filler = self._filler(rng)
        if tools and "<tool_response>" not in after_question and rng.random() < self.config.tool_use:
            return filler + self._encode("\n" + self._tool_call(tools, question, rng))
        answer = self._answer(question, rng)
        return filler + self._encode(f" Answer: {answer}")

    def _filler(self, rng: np.random.Generator) -> list[int]:
        n = int(min(self.config.max_filler_tokens, max(1, rng.lognormal(self.config.length_mu, self.config.length_sigma))))
        return [int(i) for i in rng.choice(self._filler_ids, size=n)]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _tool_call(self, tools: list[dict[str, Any]], question: str, rng: np.random.Generator) -> str:
        if rng.random() < self.config.malformed_rate:
            return '<tool_call>\n{"name": "calculator", "arguments": {expression}\n</tool_call>'
        tool = tools[0].get("function", tools[0])
        params = tool.get("parameters", {}).get("properties", {})
        match = _QUESTION.search(question)
        expression = match.group(1).strip() if match else question[-100:]
        arguments = {name: expression for name in params} if params else {}
        return "<tool_call>\n" + json.dumps({"name": tool.get("name", "tool"), "arguments": arguments}) + "\n</tool_call>"

    def _answer(self, question: str, rng: np.random.Generator) -> str:
        truth = self._truth(question)
        if truth is not None and rng.random() < self.config.accuracy:
            return truth
        base = float(truth) if truth is not None and _is_number(truth) else 0.0
        wrong = base + float(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
        return str(int(wrong)) if wrong.is_integer() else str(wrong)

    def _truth(self, question: str) -> str | None:
        from workers.envs.local import evaluate_arithmetic

        if question.strip() in self.config.answers:
            return self.config.answers[question.strip()]
        match = _QUESTION.search(question)
        if not match:
            return None
        try:
            value = evaluate_arithmetic(match.group(1))
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
            return None
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _rfind(haystack: list[int], needle: list[int]) -> int:
    """Index of the last occurrence of `needle` in `haystack`, or -1."""
    n = len(needle)
    first = needle[0]
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i] == first and haystack[i : i + n] == needle:
            return i
    return -1


def _last_question(context: str) -> tuple[str, str]:
    """(content of the last user turn that is not a tool response, the text after it)."""
    pos = len(context)
    while True:
        start = context.rfind("<|im_start|>user\n", 0, pos)
        if start < 0:
            return "", context
        body_start = start + len("<|im_start|>user\n")
        end = context.find("<|im_end|>", body_start)
        content = context[body_start : end if end >= 0 else len(context)]
        if not content.startswith("<tool_response>"):
            return content, context[body_start:]
        pos = start


def _offered_tools(context: str) -> list[dict[str, Any]]:
    start, end = context.find("<tools>\n"), context.find("\n</tools>")
    if start < 0 or end < start:
        return []
    tools = []
    for line in context[start + 8 : end].splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            tools.append(json.loads(line))
    return tools


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


# ---------------------------------------------------------------- serving


@contextlib.asynccontextmanager
async def serve_sim_engine(config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator["RunningSim"]:
    """Serve the simulator in the current event loop; yields a handle with `.url` and `.engine`."""
    engine = SimEngine(config or SimConfig())
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    try:
        yield RunningSim(url=f"http://{host}:{bound}", engine=engine)
    finally:
        await runner.cleanup()


@dataclass
class RunningSim:
    url: str
    engine: SimEngine


def load_answers(tasks_path: str) -> dict[str, str]:
    """question text -> label from a tasks.jsonl, for tasks the simulator cannot solve itself."""
    from pipeline.schema import decode_task_json

    answers: dict[str, str] = {}
    with open(tasks_path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            task: Task = decode_task_json(line)
            if task.label is not None:
                prompt = task.prompt if isinstance(task.prompt, str) else str(task.prompt[-1].get("content", ""))
                answers[prompt.strip()] = task.label
    return answers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollout engine", description="Serve the SIMULATED SGLang engine.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    defaults = SimConfig()
    for name in ("accuracy", "tool_use", "malformed_rate", "length_mu", "length_sigma", "token_latency_s", "latency_sigma"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    for name in ("slots", "context_length", "seed", "max_filler_tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--weight-version", default=defaults.weight_version)
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: the shared test tokenizer)")
    p.add_argument("--tasks", default="", help="tasks.jsonl whose labels the simulator may answer with")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        accuracy=args.accuracy, tool_use=args.tool_use, malformed_rate=args.malformed_rate,
        length_mu=args.length_mu, length_sigma=args.length_sigma, max_filler_tokens=args.max_filler_tokens,
        token_latency_s=args.token_latency_s, latency_sigma=args.latency_sigma, slots=args.slots,
        context_length=args.context_length, weight_version=args.weight_version, seed=args.seed,
        tokenizer_path=args.tokenizer, answers=load_answers(args.tasks) if args.tasks else {},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    engine = SimEngine(config_from_args(args))
    print(f"simulated SGLang engine on http://{args.host}:{args.port} (tokenizer {engine.tokenizer_path})", flush=True)
    web.run_app(engine.app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
