"""`rollout bench --sections learn`: does a policy trained on what the pipeline hands slime learn,
per step as sync does, and sooner per second?

Every run: a fresh redis-server; the engine path CI's learning tests run (workers/sim/stack.py,
child processes of their own: smg -> SGLang's own HTTP front and TokenizerManager -> the simulator
as its scheduler) serving the warm-started tiny LM (workers/sim/tinylm.py; step times from the
Qwen3-0.6B H100 aiconfigurator table), the producer and arq workers on the arithmetic task set (scripts/oracle/run.py, `rollout
prepare`, the math environment), and slime's own train.py with the CPU actor running slime's
advantage and loss code (scripts/oracle/cpu_actor.py). Held-out accuracy is the pipeline's own eval
(pass@1 over the held-out problems, temperature 1) every `eval_interval` steps.

Contenders: sync (eta 0), this pipeline at eta 1, 2, 4, 8, eta 8 with TIS off, and the four
controls at sync: (a) advantages of the wrong sign, (b) the actor's targets one token back, (c)
rollout log-probs of another sample, (d) rewards shuffled across groups; and slime's own fully
async rollout (slime.rollout.fully_async_rollout with slime's RolloutDataSourceWithBuffer, its
generate and the math environment's reward, under train_async.py; scripts/oracle/run.py
`slime_fully_async_args`); the stress rows, sync and eta 2 at lr 1e-3. The train mix is the single-turn problems unless `--two-turn` (slime's
generate runs one turn; the CI test keeps the two-turn task in its mix). Seeds (engine
sampling, trainer init order, control shuffles) run seed-major, so a run cut short still has
whole seeds. Reported: accuracy per step and per second (mean over seeds), steps and seconds to
reach sync's final accuracy, per-step accuracy minus sync's with a bootstrap 95% interval over
seeds, each accuracy with the eval's standard error over the held-out problems (201, none in the
warm start's data: workers/sim/arith.py; the start at temperature 1 printed first), and per
contender the drift per lag of its trained tokens (pipeline/learning/drift.py: mean |dlogp|, the share
outside |ratio - 1| > 0.2, slime's TIS-clipped share, the ESS). The trainer's lr is `--lr`
(default the calibrated 5e-4, workers/sim/arith.py `LEARN_LR`); the stress rows run 1e-3.

Seconds are a simulated H100's. The world runs `--time-scale` (default 0.025) times as fast as
the GPUs it plays: the engine's steps are the Qwen3-0.6B H100 aiconfigurator table's, slowed by
the scale; the trainer's step (cpu_actor.TrainerClock) lasts its tokens / `trainer_tokens_per_s()`
simulated seconds, slowed alike, and the CPU actor's real work has to fit inside it. A run's
seconds are its real seconds x the scale. Two checks say whether that holds, per run: how far the
engine's steps fell behind its clock (`max_behind_sim_s`, simulated seconds; ~0 when the machine
kept the scale) and the trainer's CPU share (the largest share of a step's budget the CPU's own
work took; above 1 the step overran and the seconds are the CPU's, counted as overruns). Beside
them, the engine's busy share (its clock runs while it has work: busy simulated s / the run's).

`--family sums` (workers/sim/sums.py: worked answers of 2-30 lines, a heavy tail the tiny model
writes itself) with the engine's steps stretched by the family's calibrated factor
(`--step-time-factor`; scripts/bench/learn_clock.py) puts the run on a real run's clock: the bench
then prints, per contender, the generate call's seconds a step against the trainer's (sync's
against the 2-3x goal), the answers' length percentiles, and the seconds to sync's final accuracy
(eta 2's against the goal of 0.6x sync's), each goal MET / NOT MET (docs/benchmarks.md "The
user's clock").
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pipeline.learning.drift import LagDrift, format_table
from scripts.bench.learn_clock import STEP_TIME_FACTOR, clock_lines, length_stats, step_split
from scripts.bench.learn_stats import goal_rows, goal_table, paired_interval, sync_intervals
from scripts.bench.report import Figure
from workers.sim.arith import LEARN_LR

REPO = Path(__file__).resolve().parents[2]
MODEL, GPU, TIME_SCALE = "Qwen/Qwen3-0.6B", "h100_sxm", 0.025

# The trainer's speed, from the measured source the frontier's trainer step comes from (AReaL
# v0.3's asynchronous 7B run: 1000 steps of 512 prompts x 16 answers in 25.4 h on 24 nodes of 8
# GPUs; docs/benchmarks.md "The workload and its sources"), per GPU of that cluster (the
# frontier's mapping: one simulated engine is one GPU's share), scaled to the engine's model by
# parameter count (a step's FLOPs are ~6 x parameters per token): R1-Distill-Qwen-7B 7.6B,
# Qwen3-0.6B 0.6B (their model cards).
AREAL_PROMPTS_PER_STEP, AREAL_GPUS = 512, 24 * 8
AREAL_PARAMS, MODEL_PARAMS = 7.6e9, 0.6e9


SIMULATED = "simulated H100"
# The trainer's default learning rate: calibrated so that one step of lag moves the tiny policy
# about as far as a real run's policy moves (lag 1's mean |dlogp| <= 0.03 a token, <= 3% of tokens
# outside |ratio - 1| > 0.2; docs/benchmarks.md "The drift per lag", the table and its anchors:
# 0.018 and 0.7% measured at 5e-4). STRESS_LR, the old default, moves it twice as far and more.
DEFAULT_LR = LEARN_LR
STRESS_LR = 1e-3


def trainer_tokens_per_s() -> float:
    """Tokens a simulated H100 trains per second for Qwen3-0.6B: AReaL's answers per step x their
    mean length (the areal-7b workload's lognormal, capped at 27K: E[min(X, cap)]) / its step
    time / its GPUs x the parameter ratio (~47k)."""
    import math

    from scripts.bench.peer_contenders import WORKLOADS

    wl = WORKLOADS["areal-7b"]
    mu, sigma, cap = wl.length_mu, wl.length_sigma, wl.max_response_len

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    mean_len = (math.exp(mu + sigma**2 / 2) * phi((math.log(cap) - mu - sigma**2) / sigma)
                + cap * (1 - phi((math.log(cap) - mu) / sigma)))
    per_gpu = AREAL_PROMPTS_PER_STEP * wl.n * mean_len / wl.train_step_s / AREAL_GPUS
    return per_gpu * AREAL_PARAMS / MODEL_PARAMS


@dataclass(frozen=True)
class Contender:
    name: str
    eta: int = 0
    use_tis: bool = True
    use_rollout_logprobs: bool = False  # slime's --use-rollout-logprobs: rollout log-probs are the old policy
    controls: dict[str, bool] = field(default_factory=dict)
    rollout: str = "pipeline"  # scripts/oracle/run.py LearnRun.rollout: "pipeline" or "slime_fully_async"
    loop: str = "train"  # slime's train.py or train_async.py
    slime_concurrency: int = 512  # slime's --sglang-server-concurrency (its default) for slime's own rollout
    lr: float | None = None  # the trainer's learning rate; None: the run's default (bench_learn's `lr`)


# The pipeline's async contenders run under slime's train_async.py, as the launcher runs them
# (scripts/run_slime_grpo.sh; `pipeline_trainer_loop: async`): the next rollout is asked for before
# the step trains, so every token has lag >= 1 and eta bounds it. Sync is train.py at eta 0.
ASYNC = "train_async"
CONTENDERS = (
    Contender("sync"), Contender("eta 1", 1, loop=ASYNC), Contender("eta 2", 2, loop=ASYNC),
    Contender("eta 4", 4, loop=ASYNC), Contender("eta 8", 8, loop=ASYNC),
    Contender("eta 8, TIS off", 8, use_tis=False, loop=ASYNC),
    Contender("(a) wrong-sign advantages", controls={"wrong_sign": True}),
    Contender("(b) targets one token back in the actor", controls={"actor_targets_shifted": True}),
    Contender("(c) foreign rollout log-probs", controls={"foreign_logprobs": True}),
    Contender("(d) rewards shuffled across groups", controls={"shuffled_rewards": True}),
    # (c) above reaches only the TIS weight (slime recomputes the old policy); with
    # --use-rollout-logprobs the rollout log-probs are the old policy of the PPO ratio
    Contender("sync, --use-rollout-logprobs", use_rollout_logprobs=True),
    Contender("(c) foreign rollout log-probs, --use-rollout-logprobs", use_rollout_logprobs=True,
              controls={"foreign_logprobs": True}),
    # slime's own fully async rollout and data source under train_async.py, at slime's defaults
    # (scripts/oracle/run.py slime_fully_async_args): single-turn problems only, the same eval
    Contender("slime fully async", rollout="slime_fully_async", loop="train_async"),
    # its staleness is its concurrency: up to that many groups in flight and as many finished ones
    # queued (fully_async_rollout's backpressure), 2 x 512 / 16 = 64 steps at the default; at 64,
    # the pipeline's own episodes in flight (2 workers x 32), 8 steps at most
    Contender("slime fully async, concurrency 64", rollout="slime_fully_async", loop="train_async",
              slime_concurrency=64),
    # the stress rows: the old default lr, whose one step of lag moves the tiny policy by a mean
    # |dlogp| of 0.036 a token with 7% of its tokens outside |ratio - 1| > 0.2 (warm start w5; 0.10
    # and 15% on the earlier one): past a real run's drift (docs/benchmarks.md "The drift per lag")
    Contender("sync, lr 1e-3 (stress)", lr=STRESS_LR), Contender("eta 2, lr 1e-3 (stress)", 2, lr=STRESS_LR, loop=ASYNC),
)


@dataclass
class Curve:
    contender: str
    seed: int
    accuracy: dict[int, float]
    seconds: dict[int, float]  # simulated H100 seconds since slime's loop started (real seconds x time_scale)
    clock_rate: float  # the engine's busy share: its clock (which runs while it has work) / the run's simulated s
    wall_s: float
    error: str = ""
    time_scale: float = 1.0
    trainer_overruns: int = 0  # steps whose CPU work outlasted their simulated budget
    trainer_cpu_share: float = 0.0  # the largest share of a step's budget the CPU's work took
    seconds_are: str = "this machine's"  # or "simulated H100" (the trainer on the engine's clock)
    engine_behind_s: float = 0.0  # the most the engine's steps fell behind its clock, in simulated s
    untrained_groups: int = 0  # slime's fully async: finished groups its worker held at the end (never trained)
    lag_mean: float = 0.0  # trained tokens' policy lag: the trainer's version then - the token's own (_lags)
    lag_max: int = -1  # -1: not recorded (curves from before the lag was counted)
    # `seconds` less the trainer's overruns so far (x the scale): the time had every step kept its
    # budget. Exact where the trainer is the critical path (sync: the engine idles while it
    # trains); a lower bound where generation is (an overrun then hides behind it)
    seconds_kept: dict[int, float] = field(default_factory=dict)
    lr: float = 0.0  # the trainer's learning rate (0: not recorded)
    accuracy_se: dict[int, float] = field(default_factory=dict)  # the eval's standard error over its problems
    drift: list[dict[str, Any]] = field(default_factory=list)  # pipeline.learning.drift.LagDrift per lag, as builtins
    split: dict[str, float] = field(default_factory=dict)  # learn_clock.step_split: generate vs trainer s a step
    response_tokens: dict[str, Any] = field(default_factory=dict)  # learn_clock.length_stats
    # `seconds` less every eval round's own seconds so far (x the scale): the training's clock, as a
    # run that evaluates rarely or in the background pays it (the workers generate on during a round)
    seconds_less_eval: dict[int, float] = field(default_factory=dict)


def _sim_stat(url: str, key: str) -> float:
    with urllib.request.urlopen(f"{url}/sim/stats", timeout=10) as reply:
        return float(json.loads(reply.read()).get(key, 0.0))


def run_one(contender: Contender, seed: int, *, steps: int, eval_interval: int, workdir: Path, setup: Any,
            time_scale: float = TIME_SCALE, two_turn: bool = False, lr: float = DEFAULT_LR,
            family: str = "arith", step_time_factor: float | None = None) -> Curve:
    from pipeline.store.local_redis import LocalRedis
    from scripts.oracle.cpu_actor import Controls
    from scripts.oracle.run import LearnRun, run_learning

    slime, warm, tasks, heldout = setup
    sub = workdir / f"{re.sub(r'[^a-z0-9]+', '-', contender.name.lower()).strip('-')}-s{seed}"
    sub.mkdir(parents=True, exist_ok=True)
    engine_args = ["--policy-path", str(warm), "--model", MODEL, "--gpu", GPU, "--time-scale", str(time_scale),
                   "--seed", str(seed), "--weight-version", "0", "--step-time-factor",
                   str(step_time_factor if step_time_factor is not None else STEP_TIME_FACTOR[family])]
    lr = contender.lr if contender.lr is not None else lr
    run = LearnRun(steps=steps, eval_interval=eval_interval, eta=contender.eta, lr=lr, use_tis=contender.use_tis,
                   use_rollout_logprobs=contender.use_rollout_logprobs, seed=seed, controls=Controls(**contender.controls),
                   trainer_tokens_per_s=trainer_tokens_per_s(), time_scale=time_scale, worker_process=True,
                   rollout=contender.rollout, loop=contender.loop, slime_concurrency=contender.slime_concurrency,
                   two_turn=two_turn and contender.rollout == "pipeline", family=family)  # slime's generate: one turn
    with LocalRedis() as server, _engine(engine_args, sub) as stack:
        stats = stack.control_url(0)  # the simulator's own routes, beside SGLang's front
        clock0, real0 = _sim_stat(stats, "sim_time_s"), time.monotonic()
        result = asyncio.run(run_learning(run, slime=slime, workdir=sub, redis_url=server.url, ns="learn",
                                          engine_url=stack.router_url, engine_urls=stack.engine_urls, warm=warm,
                                          tasks=tasks, heldout=heldout))
        rate = (_sim_stat(stats, "sim_time_s") - clock0) / max(time.monotonic() - real0, 1e-9) / time_scale
        behind = _sim_stat(stats, "max_behind_sim_s")
    kept = {k: (v - _overrun_before(result.trainer_steps, k)) * time_scale for k, v in result.seconds.items()}
    less_eval = {k: (v - sum(s for d, s in result.eval_s.items() if d <= k)) * time_scale for k, v in result.seconds.items()}
    return Curve(contender.name, seed, result.accuracy, {k: v * time_scale for k, v in result.seconds.items()}, rate,
                 result.wall_s, accuracy_se=dict(result.accuracy_se), time_scale=time_scale, trainer_overruns=result.trainer_overruns,
                 trainer_cpu_share=result.trainer_cpu_share, seconds_are=SIMULATED, engine_behind_s=behind,
                 untrained_groups=result.untrained_groups, seconds_kept=kept, lr=lr,
                 drift=[msgspec.to_builtins(row) for row in result.drift], **_lags(result.drift),
                 split=step_split(result.generate_s, result.trainer_steps, time_scale),
                 response_tokens=length_stats(result.samples), seconds_less_eval=less_eval)


def _engine(engine_args: list[str], sub: Path) -> Any:
    """The engine path CI's learning tests run (workers/sim/stack.py): smg -> SGLang's own HTTP
    front and TokenizerManager (its /generate, /update_weights_from_disk, /update_weight_version,
    /pause_generation) -> the simulator as its scheduler, in child processes of their own; the
    simulator set by `engine_args`, `rollout engine` flags. SGLang and smg are the `conformance`
    extra's: without them the bench says so rather than run another engine path."""
    from workers.sim.stack import engine_stack, missing_parts, sim_fields

    missing = missing_parts("smg")
    if missing is not None:
        raise SystemExit(f"[learn] the bench runs SGLang's front as CI does: {missing}")
    return engine_stack(sub / "engine", 1, router="smg", sim=sim_fields(engine_args))


def _overrun_before(steps: list[tuple[int, float, float]], done: int) -> float:
    """Real seconds the first `done` trainer steps ran past their budgets (TrainerClock.steps)."""
    return sum(max(0.0, used - budget) for _, budget, used in steps[:done] if budget)


def _lags(drift: list[Any]) -> dict[str, Any]:
    """The policy lag of every trained token, from the run's drift table (scripts/oracle/run.py
    `drift_by_lag`): the trainer's version at the step that trained it minus the token's own
    policy version (`Sample.token_version_runs`, so a call that lived through a push counts each
    token at the weights that made it, not at the call's first label). Sync: 0 for every token."""
    counted = [(int(row.lag), int(row.tokens)) for row in drift if row.tokens]
    tokens = sum(n for _, n in counted)
    return {"lag_mean": sum(lag * n for lag, n in counted) / tokens if tokens else 0.0,
            "lag_max": max((lag for lag, _ in counted), default=0)}


def _setup(workdir: Path, family: str = "arith") -> Any:
    """slime on sys.path with pipeline.slime.data_source bound to its classes, the task set, the warm start."""
    import importlib
    from types import SimpleNamespace

    from scripts import upstream

    path = upstream.snapshot_path("slime")
    if not (path / "slime").is_dir():
        raise SystemExit(f"[learn] slime's snapshot is not at {path}: `python -m scripts.upstream fetch` "
                         "(scripts/run_conformance.sh --setup-only installs the rest)")
    sys.path[:0] = [str(path), str(REPO)]
    names = ("slime.ray.rollout", "slime.backends.megatron_utils.loss", "slime.observability.rollout_data_utils",
             "slime.ray.placement_group")
    slime = SimpleNamespace(path=path, modules={name: importlib.import_module(name) for name in names})
    import pipeline.slime.data_source  # noqa: F401  (after slime: its samples are slime's)
    from scripts.tiny_tasks import prepare_sums_tasks, prepare_tasks
    from workers.sim import arith, sums

    if family == "sums":  # the answers of heavy-tailed length (workers/sim/sums.py), its own warm start
        return slime, sums.warm_checkpoint(), *prepare_sums_tasks(workdir / "tasks")
    tasks, heldout = prepare_tasks(workdir / "tasks")
    return slime, arith.warm_checkpoint(), tasks, heldout


def start_line(warm: Path) -> str:
    """The warm start on the held-out problems (none of them in its data), as its build measured
    it: at temperature 1 (the eval's pass@1; goal 10-50%, room both ways) and greedy."""
    info = json.loads((warm / "warm_start.json").read_text())
    if "heldout_accuracy" not in info:
        return f"[learn] warm start {warm}: held-out accuracy not measured (built before issue 45)"
    t1 = info["heldout_accuracy"]
    verdict = "MET" if 0.10 <= t1 <= 0.50 else "NOT MET"
    line = (f"[learn] the start on the held-out problems: {t1:.3f} at temperature 1 (goal 10-50%: {verdict}), "
            f"greedy {info['heldout_greedy_accuracy']:.3f}")
    if "response_tokens" in info:  # the sums family (workers/sim/sums.py): its answers' lengths at temperature 1
        return line + ("; its held-out answers' tokens at temperature 1: "
                       + ", ".join(f"{k} {v:.0f}" for k, v in info["response_tokens"].items()))
    return (line + f", greedy after a forced \\boxed{{ {info['heldout_boxed_greedy_accuracy']:.3f}; "
            f"on its train problems {info['accuracy']:.3f} at temperature 1")


def _mean_curve(curves: list[Curve], key: str) -> dict[int, float]:
    return _mean_dicts([getattr(c, key) for c in curves])


def _start(c: Curve, sync: list[Curve]) -> float:
    """The run's held-out accuracy before its first step: its own round at step 0, else (train_async.py
    evaluates after steps only) sync's round of the same seed, the same warm start through the same
    eval; else its first round."""
    if 0 in c.accuracy:
        return c.accuracy[0]
    same = [s.accuracy[0] for s in sync if s.seed == c.seed and 0 in s.accuracy]
    return same[0] if same else c.accuracy[min(c.accuracy)]


def _training_clock(c: Curve) -> dict[int, float]:
    """The run's simulated seconds less its eval rounds and its trainer's overruns: the clock of
    the training a user pays for (a run evaluates rarely or in the background, and an overrun is
    this CPU's, not the simulated H100's: exact where the trainer is the critical path)."""
    return {k: v - (c.seconds[k] - c.seconds_kept.get(k, c.seconds[k])) for k, v in c.seconds_less_eval.items()
            if k in c.seconds}


def _mean_dicts(dicts: list[dict[int, float]]) -> dict[int, float]:
    steps = sorted(set.intersection(*(set(d) for d in dicts))) if dicts else []
    return {s: statistics.fmean(d[s] for d in dicts) for s in steps}


def summarize(curves: list[Curve]) -> dict[str, Any]:
    by: dict[str, list[Curve]] = {}
    for c in curves:
        if not c.error:
            by.setdefault(c.contender, []).append(c)
    sync = by.get("sync", [])
    sync_acc = _mean_curve(sync, "accuracy")
    target = sync_acc[max(sync_acc)] if sync_acc else float("nan")
    intervals = sync_intervals(sync)
    final_low = intervals[max(intervals)][0] if intervals else float("nan")
    out: dict[str, Any] = {"sync_final_accuracy": target, "contenders": {},
                           "sync_interval": {s: list(v) for s, v in intervals.items()}}
    for name, runs in by.items():
        acc, secs, kept = _mean_curve(runs, "accuracy"), _mean_curve(runs, "seconds"), _mean_curve(runs, "seconds_kept")
        less_eval = _mean_dicts([_training_clock(c) for c in runs])
        # the eval's standard error of the mean over seeds (each seed's round independent)
        se = {s: (sum(c.accuracy_se.get(s, float("nan")) ** 2 for c in runs)) ** 0.5 / len(runs) for s in acc}
        reach = next((s for s in sorted(acc) if acc[s] >= target), None)
        # the first eval inside (or above) sync's final 95% interval: a reach that equal learners share
        reach_low = next((s for s in sorted(acc) if acc[s] >= final_low), None)
        per_step = {}
        for step in sorted(acc):
            pairs = [(c.accuracy[step], c.accuracy_se.get(step, math.nan), s.accuracy[step], s.accuracy_se.get(step, math.nan))
                     for c in runs for s in sync if s.seed == c.seed and step in s.accuracy and step in c.accuracy]
            if pairs:
                low, high = paired_interval(pairs)
                per_step[step] = {"diff": statistics.fmean(a - b for a, _, b, _ in pairs), "ci95": [low, high]}
        last = max(acc)
        gains = [c.accuracy[last] - _start(c, sync) for c in runs]
        out["contenders"][name] = {
            "seeds": sorted(c.seed for c in runs), "accuracy": acc, "accuracy_se": se, "seconds": secs,
            "gain": statistics.fmean(gains), "gain_per_seed": gains,
            "steps_to_sync_final": reach, "seconds_to_sync_final": secs.get(reach) if reach is not None else None,
            "seconds_kept": kept, "seconds_less_eval": less_eval,
            "seconds_less_eval_to_sync_final": less_eval.get(reach) if reach is not None else None,
            "seconds_less_eval_to_sync_interval": less_eval.get(reach_low) if reach_low is not None else None,
            "vs_sync": per_step, "clock_rate": [round(c.clock_rate, 3) for c in runs],
            "wall_s": [round(c.wall_s, 1) for c in runs],
            "seconds_are": sorted({c.seconds_are for c in runs}),
            "trainer_cpu_share": [round(c.trainer_cpu_share, 2) for c in runs],
            "trainer_overruns": [c.trainer_overruns for c in runs],
            "engine_behind_s": [round(c.engine_behind_s, 3) for c in runs],
            "lag_mean": [round(c.lag_mean, 2) for c in runs], "lag_max": [c.lag_max for c in runs],
            "untrained_groups": [c.untrained_groups for c in runs],
            "lr": sorted({c.lr for c in runs}), "drift": [msgspec.to_builtins(r) for r in _pooled_drift(runs)],
            "split": [c.split for c in runs], "response_tokens": [c.response_tokens.get("overall", {}) for c in runs],
        }
    return out


def _pooled_drift(runs: list[Curve]) -> list[LagDrift]:
    """The drift per lag over the seeds: token-weighted means of the per-run figures (ESS too:
    a pooled ESS over runs whose weights differ in scale would mix them)."""
    by_lag: dict[int, list[LagDrift]] = {}
    for c in runs:
        for row in c.drift:
            by_lag.setdefault(int(row["lag"]), []).append(msgspec.convert(row, LagDrift))
    out = []
    for lag, rows in sorted(by_lag.items()):
        total = sum(r.tokens for r in rows)
        if not total:
            out.append(LagDrift(lag=lag, tokens=0, mean_abs_dlogp=0.0, share_outside=0.0, tis_clipped=0.0, ess=1.0))
            continue

        def mean(key: str, rows: list[LagDrift] = rows, total: int = total) -> float:
            return sum(getattr(r, key) * r.tokens for r in rows) / total

        out.append(LagDrift(lag=lag, tokens=total, mean_abs_dlogp=mean("mean_abs_dlogp"),
                            share_outside=mean("share_outside"), tis_clipped=mean("tis_clipped"), ess=mean("ess")))
    return out


def drift_tables(summary: dict[str, Any]) -> str:
    """Per contender, its trained tokens' drift per lag (pipeline/learning/drift.py), pooled over seeds."""
    parts = []
    for name, c in summary["contenders"].items():
        rows = [msgspec.convert(r, LagDrift) for r in c.get("drift", [])]
        if rows:
            lr = ", ".join(f"{v:g}" for v in c.get("lr", []))
            parts.append(f"drift per lag, {name} (lr {lr}):\n" + format_table(rows))
    return "\n\n".join(parts)


def table(summary: dict[str, Any]) -> str:
    lines = [f"sync's final held-out accuracy (mean of its seeds): {summary['sync_final_accuracy']:.3f}", "",
             "| contender | seeds | held-out accuracy by step (mean ± the eval's standard error) | gain from step 0 (per seed; async: sync's step-0 round of the seed) | steps to sync's final | "
             "simulated H100 s to sync's final (at step) | final step minus sync, paired by seed (95% bootstrap over seeds and problems) | "
             "simulated H100 s at the last step, mean [less overruns] | lag per trained token (its own version), mean / max | finished groups never trained | "
             "engine busy share (behind its clock, max s) | trainer CPU share of its step, max (overruns) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in summary["contenders"].items():
        se = c.get("accuracy_se", {})
        acc = ", ".join(f"{s}: {v:.3f}" + (f" ± {se[s]:.3f}" if not math.isnan(se.get(s, math.nan)) else "")
                        for s, v in c["accuracy"].items())
        last = max(c["vs_sync"]) if c["vs_sync"] else None
        vs = (f"{c['vs_sync'][last]['diff']:+.3f} [{c['vs_sync'][last]['ci95'][0]:+.3f}, "
              f"{c['vs_sync'][last]['ci95'][1]:+.3f}]") if last is not None else "-"
        reach = c["steps_to_sync_final"]
        secs = c["seconds_to_sync_final"] if c["seconds_are"] == [SIMULATED] else None
        trainer = (", ".join(f"{share:.2f}" for share in c["trainer_cpu_share"])
                   + f" ({sum(c['trainer_overruns'])})") if c["seconds_are"] == [SIMULATED] else "not on the clock"
        lines.append(f"| {name} | {len(c['seeds'])} | {acc} | {c['gain']:+.3f} ({', '.join(f'{g:+.2f}' for g in c['gain_per_seed'])}) | "
                     f"{reach if reach is not None else 'not reached'} | {f'{secs:.1f}' if secs is not None else '-'} | "
                     f"{vs} | {_at_last_step(c)} | {_lag(c)} | {_sum_or_dash(c.get('untrained_groups'))} | "
                     f"{', '.join(f'{r:.2f} ({b:.2f})' for r, b in zip(c['clock_rate'], c['engine_behind_s']))} | {trainer} |")
    return "\n".join(lines)


def _at_last_step(c: dict[str, Any]) -> str:
    """The mean simulated seconds at the last eval; with overruns, [what they were had every
    trainer step kept its budget, a lower bound] beside it."""
    if c["seconds_are"] != [SIMULATED] or not c["seconds"]:
        return "-"
    last = max(c["seconds"])
    kept = c.get("seconds_kept", {}).get(last)
    shown = f"{c['seconds'][last]:.2f}"
    return shown + (f" [{kept:.2f}]" if kept is not None and sum(c["trainer_overruns"]) else "")


def _lag(c: dict[str, Any]) -> str:
    means, maxes = c.get("lag_mean") or [], c.get("lag_max") or []
    if not maxes or min(maxes) < 0:
        return "-"
    return f"{statistics.fmean(means):.2f} / {max(maxes)}"


def _sum_or_dash(values: list[int] | None) -> str:
    return str(sum(values)) if values else "-"


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(15, 4.8))
    colors = plt.get_cmap("tab20")  # an int picks one of its 20 colours: more contenders than the default cycle's ten colours
    for i, (name, c) in enumerate(summary["contenders"].items()):
        style = "--" if name.startswith("(") else "-"
        steps = list(c["accuracy"])
        color = colors((2 * i) % 20 + (2 * i) // 20)
        by_step.plot(steps, [c["accuracy"][s] for s in steps], style, marker="o", label=name, color=color)
        if c["seconds_are"] == [SIMULATED] and not name.startswith("("):  # controls: by step only
            secs = [c["seconds"].get(s) for s in steps]
            by_time.plot(secs, [c["accuracy"][s] for s in steps], style, marker="o", label=name, color=color)
    by_step.set_xlabel("trainer steps")
    by_time.set_xlabel("simulated H100 seconds since the loop started (Qwen3-0.6B step tables, trainer on the same clock)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out pass@1 (temperature 1)")
        ax.grid(alpha=0.3)
    handles, labels = by_step.get_legend_handles_labels()  # every contender; the time panel leaves the controls out
    fig.suptitle("tiny LM through the pipeline and slime's train.py (CPU actor, slime's loss): mean over seeds")
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.savefig(path, dpi=110)


def bench_learn(*, quick: bool = False, seeds: int = 5, steps: int = 12, eval_interval: int = 4,
                deadline_s: float | None = None, out_dir: Path = Path("."), contenders: tuple[Contender, ...] = CONTENDERS,
                seed_ids: tuple[int, ...] | None = None, merge: tuple[Path, ...] = (),
                time_scale: float = TIME_SCALE, two_turn: bool = False, lr: float = DEFAULT_LR,
                family: str = "arith", step_time_factor: float | None = None) -> list[Figure]:
    """Run every contender for every seed (seed-major), write learn.json / learn.txt / learn.png
    in `out_dir`, return the figures. `deadline_s`: stop starting runs past it (said in the table).
    `seed_ids`: these seeds instead of 0..seeds-1. `merge`: earlier learn.json files whose curves
    (and skipped runs) are kept, except those this run redoes, so the table and plot cover both.
    `two_turn`: the producer's train mix has the two-turn task (off: the single-turn problems only,
    which every contender, slime's fully async included, can train on)."""
    import tempfile

    if quick:
        seeds, steps = 1, 8
    workdir = Path(tempfile.mkdtemp(prefix="bench-learn-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = _setup(workdir, family)
    print(start_line(setup[1]), flush=True)
    from scripts.oracle.cpu_actor import quiet_transformers

    quiet_transformers()
    started = time.monotonic()
    curves: list[Curve] = []
    skipped: list[str] = []
    for path in merge:
        more_curves, more_skipped = _load(path)
        curves, skipped = curves + more_curves, skipped + more_skipped
    for seed in seed_ids if seed_ids is not None else range(seeds):
        for contender in contenders:
            done = f"{contender.name} seed {seed}"
            curves = [c for c in curves if f"{c.contender} seed {c.seed}" != done]
            skipped = [s for s in skipped if s != done]
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                skipped.append(f"{contender.name} seed {seed}")
                continue
            try:
                curve = run_one(contender, seed, steps=steps, eval_interval=eval_interval, workdir=workdir, setup=setup,
                                time_scale=time_scale, two_turn=two_turn, lr=lr, family=family,
                                step_time_factor=step_time_factor)
            except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others go on
                curve = Curve(contender.name, seed, {}, {}, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")
            curves.append(curve)
            accuracy = {k: f"{v:.3f} ± {curve.accuracy_se.get(k, float('nan')):.3f}" for k, v in curve.accuracy.items()}
            print(f"[learn] {contender.name} seed {seed}: {accuracy or curve.error} "
                  f"({curve.wall_s:.0f} s real, {curve.wall_s * time_scale:.1f} s simulated; engine busy "
                  f"{curve.clock_rate:.2f}, behind its clock by up to {curve.engine_behind_s:.2f} s; trainer CPU share {curve.trainer_cpu_share:.2f}, "
                  f"{curve.trainer_overruns} overruns"
                  f"{f'; {curve.untrained_groups} finished groups never trained' if curve.untrained_groups else ''})"
                  f"; lr {curve.lr:g}, drift per lag: " + _drift_line(curve) + _clock_line(curve), flush=True)
            _write(curves, skipped, out_dir)
    summary = _write(curves, skipped, out_dir)
    print(table(summary))
    print("\n" + goal_table(summary) + "\n")
    print(drift_tables(summary))
    print(clock_lines(summary))
    figures = []
    inside = {r["contender"]: r["met"] for r in goal_rows(summary)}
    for name, c in summary["contenders"].items():
        goal_met = c["gain"] < 0.1 if name.startswith("(") else inside.get(name, c["steps_to_sync_final"] is not None)
        figures.append(Figure(section="learn", name=f"{name}: held-out gain over {steps} steps", value=c["gain"],
                              unit="accuracy", goal="no rise (a control)" if name.startswith("(") else
                              "inside sync's interval at the last step" if name in inside else
                              "reaches sync's final accuracy", met=goal_met, details=c))
    return figures


def _clock_line(curve: Curve) -> str:
    """The run's generation vs trainer seconds a step and its answers' lengths, per step."""
    if not curve.split:
        return ""
    steps = "; ".join(f"{rid}: p50 {p['p50']:.0f} p90 {p['p90']:.0f} max {p['max']:.0f}"
                      for rid, p in curve.response_tokens.get("by_step", {}).items() if p)
    return (f"; generate {curve.split['generate_s']:.2f} s vs trainer {curve.split['trainer_s']:.2f} s a step "
            f"(median, simulated: {curve.split['ratio']:.2f}x); response tokens per step: {steps}")


def _drift_line(curve: Curve) -> str:
    return "; ".join(f"lag {r['lag']}: |dlogp| {r['mean_abs_dlogp']:.4f}, outside {r['share_outside']:.1%}, "
                     f"TIS-clipped {r['tis_clipped']:.1%}, ESS {r['ess']:.3f} ({r['tokens']} tokens)"
                     for r in curve.drift) or "-"


def _load(path: Path) -> tuple[list[Curve], list[str]]:
    """An earlier run's curves (JSON keys back to step numbers) and the runs it skipped."""
    data = json.loads(path.read_text())
    curves = [Curve(**{**c, "accuracy": {int(k): v for k, v in c["accuracy"].items()},
                       "seconds": {int(k): v for k, v in c["seconds"].items()},
                       "seconds_kept": {int(k): v for k, v in c.get("seconds_kept", {}).items()},
                       "accuracy_se": {int(k): v for k, v in c.get("accuracy_se", {}).items()},
                       "seconds_less_eval": {int(k): v for k, v in c.get("seconds_less_eval", {}).items()}})
              for c in data["curves"]]
    return curves, list(data["summary"].get("skipped", []))


def _chosen(only: list[str]) -> tuple[Contender, ...]:
    """`--only` values: exact contender names, or comma-separated 0-based numbers."""
    by_name = {c.name: c for c in CONTENDERS}
    chosen: list[Contender] = []
    for value in only:
        if value in by_name:
            chosen.append(by_name[value])
        elif all(part.strip().isdigit() for part in value.split(",")):
            chosen.extend(CONTENDERS[int(part)] for part in value.split(","))
        else:
            raise SystemExit(f"--only {value!r}: not a contender; one of {sorted(by_name)} or their numbers")
    return tuple(chosen) or CONTENDERS


def _write(curves: list[Curve], skipped: list[str], out_dir: Path) -> dict[str, Any]:
    summary = summarize(curves)
    summary["skipped"] = skipped
    summary["failed"] = [f"{c.contender} seed {c.seed}: {c.error}" for c in curves if c.error]
    (out_dir / "learn.json").write_text(json.dumps({"summary": summary, "curves": [asdict(c) for c in curves]},
                                                   indent=1, default=str))
    text = (table(summary) + "\n\n" + goal_table(summary) + "\n\n" + drift_tables(summary) + "\n\n" + clock_lines(summary)
            if summary["contenders"] else "(no run finished)")
    if skipped:
        text += f"\n\nnot run (time budget): {', '.join(skipped)}"
    if summary["failed"]:
        text += "\n\nfailed: " + "; ".join(summary["failed"])
    (out_dir / "learn.txt").write_text(text + "\n")
    if summary["contenders"]:
        plot(summary, out_dir / "learn.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m scripts.bench.learn", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-interval", type=int, default=4)
    p.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--out", default=".", help="directory for learn.json, learn.txt, learn.png")
    p.add_argument("--only", action="append", default=[],
                   help="a contender's exact name, or comma-separated 0-based numbers; repeatable; default all")
    p.add_argument("--seed-ids", default="", help="comma-separated seeds to run instead of 0..seeds-1")
    p.add_argument("--time-scale", type=float, default=TIME_SCALE,
                   help="simulated seconds per real second (engine and trainer); small enough that the CPU's work fits")
    p.add_argument("--two-turn", action="store_true",
                   help="the two-turn task in the train mix (default: the single-turn problems, which slime's own "
                        "fully async rollout can run too; it trains single-turn either way)")
    p.add_argument("--lr", type=float, default=DEFAULT_LR,
                   help=f"the trainer's learning rate for contenders without their own (default {DEFAULT_LR:g}, "
                        f"calibrated to a real run's drift; the stress rows run {STRESS_LR:g})")
    p.add_argument("--family", choices=("arith", "sums"), default="arith",
                   help="the task family: arith (16-token answers; the CI tests') or sums (worked answers of 2-30 "
                        "lines, a heavy tail: the generation-bound clock, docs/benchmarks.md \"The user's clock\")")
    p.add_argument("--step-time-factor", type=float, default=None,
                   help="the engine's steps this many times the table's (default: the family's calibrated factor, "
                        "scripts/bench/learn_clock.py STEP_TIME_FACTOR)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the table, verdicts and plot of the --merge files' curves")
    p.add_argument("--merge", type=Path, action="append", default=[],
                   help="an earlier learn.json (repeatable): keep its curves (those rerun here replaced) in the table and plot")
    a = p.parse_args(argv)
    seed_ids = tuple(int(s) for s in a.seed_ids.split(",")) if a.seed_ids.strip() else None
    bench_learn(seeds=a.seeds, steps=a.steps, eval_interval=a.eval_interval, deadline_s=a.deadline_s,
                out_dir=Path(a.out), contenders=() if a.report_only else _chosen(a.only), seed_ids=seed_ids, merge=tuple(a.merge),
                time_scale=a.time_scale, two_turn=a.two_turn, lr=a.lr, family=a.family,
                step_time_factor=a.step_time_factor)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
