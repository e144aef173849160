"""A SIMULATED SGLang engine: a real aiohttp server with SGLang's native endpoints and a
scripted policy (or a tiny LM) instead of a model. It is the engine of the demo, the tests and the
benchmarks; it is never a stand-in for measuring model quality.

Its parts, each a module of its own:
- workers/sim/http_front.py: SGLang's native HTTP endpoints (docs/architecture.md "The engine"),
  its refusals and answer shapes, and the simulator's own /sim/ routes;
- workers/sim/core.py: the engine itself (`SimEngine`): the requests it holds, the scheduler's
  step loop that times them (workers/sim/scheduler.py, on a named model's measured step times,
  workers/sim/physics.py), pauses, aborts, weight updates and their weight-version spans;
- workers/sim/policy.py: what decides the tokens, one interface with two policies: the scripted
  one (workers/sim/scripted.py: regex answers, tool calls, sliding-puzzle moves) and, with
  `--policy-path`, a tiny causal LM (workers/sim/tinylm.py) whose weights
  `/update_weights_from_disk` replaces (`SimEngine.load_weights_from_disk`);
- workers/sim/config.py: `SimConfig` and the physics it makes.

A weight-version update aborts running requests unless told not to; under the
`in_place`/`retract` pause modes requests survive the pause, and an update during it shows up as
`meta_info.weight_versions` spans.

`rollout engine --port P [...]` serves it; `serve_sim_engine(SimConfig())` is an async
context manager that serves it in the caller's event loop and yields the URL.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from workers.sim.config import EnginePhysics, SimConfig, engine_physics
from workers.sim.core import SimEngine
from workers.sim.http_front import HttpFront
from workers.sim.scripted import load_answers

# what callers import from here, wherever it lives now
__all__ = [
    "SHUTDOWN_GRACE_S", "EnginePhysics", "RunningSim", "SimConfig", "SimEngine", "config_from_args", "engine_physics",
    "load_answers", "main", "parse_args", "serve_sim_engine",
]

# The in-process engine (the demo's, tests') stops as an SGLang process stopped by Ctrl-C does: its
# connections drop. aiohttp would first wait up to 60 s for handlers still running (whose clients,
# the demo's workers, are gone: its Ctrl-C took over a minute); this is that wait. It is no SGLang
# figure and no simulated time. `rollout engine` keeps aiohttp's drain on SIGTERM, as SGLang drains
# its requests then.
SHUTDOWN_GRACE_S = 2.0


@contextlib.asynccontextmanager
async def serve_sim_engine(config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[RunningSim]:
    """Serve the simulator in the current event loop; yields a handle with `.url` and `.engine`."""
    engine = SimEngine(config or SimConfig())
    runner = web.AppRunner(HttpFront(engine).app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rollout engine",
        description="Serve the SIMULATED SGLang engine: SGLang's native endpoints (/generate token in, token out; "
                    "/health, /server_info, /update_weight_version, ...) with a scripted policy instead of a model. "
                    "For demos and tests, never for measuring model quality.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only; 0.0.0.0 to expose it)")
    p.add_argument("--port", type=int, default=30000, help="port to serve on (default %(default)s)")
    d = SimConfig()
    answers = p.add_argument_group("answers")
    answers.add_argument("--tasks", default="", help="tasks.jsonl (from `rollout prepare`) whose labels are the right "
                         "answers to its prompts; a GSM8K label '... #### 72' means 72. Without it only arithmetic "
                         "questions ('What is 6 * 7?') have a known answer")
    answers.add_argument("--accuracy", type=float, default=d.accuracy,
                         help="probability that a final answer is the right one, else a wrong number "
                              "(default %(default)s)")
    answers.add_argument("--tool-use", type=float, default=d.tool_use,
                         help="probability to call a tool first when the prompt offers tools (default %(default)s)")
    answers.add_argument("--malformed-rate", type=float, default=d.malformed_rate,
                         help="probability that a tool call is broken JSON (default %(default)s)")
    answers.add_argument("--puzzle", action="store_true",
                         help="play sliding-puzzle games instead of answering questions (NeMo-RL's SlidingPuzzleEnv, "
                              "`kind: nemo_rl` multi_turn): each turn is one move '<action>up</action>' of a shortest "
                              "solution of the last board drawn in the context, cut at the request's stop strings")
    answers.add_argument("--seed", type=int, default=d.seed,
                         help="seed of every turn's plan, with the routing key (default %(default)s)")
    length = p.add_argument_group("response length (lognormal filler tokens before the answer: the long tail)")
    length.add_argument("--length-mu", type=float, default=d.length_mu,
                        help="mu of the lognormal: median exp(mu) tokens (3.5: about 33) (default %(default)s)")
    length.add_argument("--length-sigma", type=float, default=d.length_sigma,
                        help="sigma of the lognormal: larger = longer tail (default %(default)s)")
    length.add_argument("--max-filler-tokens", type=int, default=d.max_filler_tokens,
                        help="cap on the filler (default %(default)s)")
    physics = p.add_argument_group(
        "physics: SGLang's scheduler loop in simulated time (workers/sim/scheduler.py), step times of a real model")
    physics.add_argument("--model", default=d.model,
                         help="the model it plays, with aiconfigurator's measured step times and KV size for it "
                              f"(tables: {', '.join(_table_models())}); default: none (see --token-latency-s)")
    physics.add_argument("--gpu", default=d.gpu, help="GPU of the step times: h100_sxm or h200_sxm (default %(default)s)")
    physics.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default %(default)s)")
    physics.add_argument("--time-scale", type=float, default=d.time_scale,
                         help="simulated seconds per real second: 10 runs the engine 10x faster than the GPU it plays "
                              "(state it beside every figure measured with it) (default %(default)s)")
    physics.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static,
                         help="SGLang's flag: fraction of GPU memory for weights + KV pool (0: SGLang's default for "
                              "the GPU) (default %(default)s)")
    physics.add_argument("--max-total-tokens", type=int, default=d.kv_pool_tokens,
                         help="KV pool size in tokens (0: from model, GPU and memory fraction; no model: 2097152) "
                              "(default %(default)s)")
    physics.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                         help="SGLang's flag: most prompt tokens prefilled in one step, -1 = no chunking "
                              "(default %(default)s)")
    physics.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                         help="SGLang's flag: prefill token budget of one step (default %(default)s)")
    physics.add_argument("--slots", type=int, default=d.slots,
                         help="SGLang's --max-running-requests: requests decoding at once, the rest queue; 0 = "
                              "SGLang's default from the KV pool (default %(default)s)")
    physics.add_argument("--max-running-requests", dest="slots", type=int, default=argparse.SUPPRESS,
                         help="SGLang's name for --slots")
    physics.add_argument("--weight-push-gbps", type=float, default=d.weight_push_gbps,
                         help="with --model: a weight update keeps the GPU busy model bytes / this many GB/s "
                              "(an assumed link speed, not measured); 0 = free (default %(default)s)")
    physics.add_argument("--token-latency-s", type=float, default=d.token_latency_s,
                         help="without --model: every decode step lasts this long, prefill is free (tests); "
                              "0 with no --model = instant answers, no capacity (default %(default)s)")
    physics.add_argument("--step-time-factor", type=float, default=d.step_time_factor,
                         help="every step of the model's table (or --token-latency-s) this many times as long: a "
                              "slower engine per token (default %(default)s)")
    physics.add_argument("--latency-sigma", type=float, default=0.0,
                         help="ignored: the old per-request lognormal speed is gone (every running request gains a "
                              "token per step); accepted so old command lines still start")
    speed = p.add_argument_group("queue and limits")
    speed.add_argument("--enable-priority-scheduling", action="store_true",
                       help="order the waiting queue by each request's `priority`, as SGLang's flag does, and "
                            "preempt running requests past --priority-scheduling-preemption-threshold")
    speed.add_argument("--schedule-low-priority-values-first", action="store_true",
                       help="with --enable-priority-scheduling: lower `priority` values first (SGLang's flag)")
    speed.add_argument("--priority-scheduling-preemption-threshold", type=int, default=d.priority_preemption_threshold,
                       help="SGLang's flag: a waiting request preempts running ones whose priority is worse by more "
                            "than this (default %(default)s)")
    speed.add_argument("--context-length", type=int, default=d.context_length,
                       help="context length in tokens (/server_info); longer requests get SGLang's 400 (default %(default)s)")
    speed.add_argument("--startup-s", type=float, default=d.startup_s,
                       help="answer /health with 503 (and refuse /generate) this long after start (default %(default)s)")
    model = p.add_argument_group("model")
    model.add_argument("--weight-version", default=d.weight_version,
                       help="initial weight version label (POST /update_weight_version changes it) (default %(default)s)")
    model.add_argument("--policy-path", default="",
                       help="a tiny causal LM checkpoint (workers/sim/tinylm.py, needs torch) that decides the tokens "
                            "instead of the scripted policy; POST /update_weights_from_disk replaces its weights")
    model.add_argument("--tokenizer", default="", help="tokenizer directory (default: the shared test tokenizer)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        accuracy=args.accuracy, tool_use=args.tool_use, malformed_rate=args.malformed_rate,
        length_mu=args.length_mu, length_sigma=args.length_sigma, max_filler_tokens=args.max_filler_tokens,
        model=args.model, gpu=args.gpu, tp=args.tp, time_scale=args.time_scale,
        mem_fraction_static=args.mem_fraction_static, kv_pool_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
        weight_push_gbps=args.weight_push_gbps, token_latency_s=args.token_latency_s, slots=args.slots,
        step_time_factor=args.step_time_factor,
        priority_scheduling=args.enable_priority_scheduling,
        priority_preemption_threshold=args.priority_scheduling_preemption_threshold,
        low_priority_values_first=args.schedule_low_priority_values_first,
        context_length=args.context_length, weight_version=args.weight_version, seed=args.seed,
        startup_s=args.startup_s, puzzle=args.puzzle, policy_path=args.policy_path,
        tokenizer_path=args.tokenizer, answers=load_answers(args.tasks) if args.tasks else {},
    )


def _table_models() -> list[str]:
    from workers.sim.physics import available_tables

    return sorted({name.split("--h")[0].replace("--", "/") for name in available_tables()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        engine = SimEngine(config_from_args(args))
    except ValueError as exc:  # an unknown model/GPU, a model that does not fit: a usage error
        print(f"rollout engine: {exc}", file=sys.stderr)
        return 2
    plays = (f"{args.model} on {args.gpu} x tp {args.tp}, KV pool {engine.scheduler.config.kv_pool_tokens} tokens"
             if engine.table and engine.scheduler else "no model")
    print(f"simulated SGLang engine on http://{args.host}:{args.port} ({plays}, time scale {args.time_scale}; "
          f"tokenizer {engine.tokenizer_path})", flush=True)
    web.run_app(HttpFront(engine).app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
