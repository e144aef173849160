"""The learning stage of `rollout check-signal` (scripts/check_signal.py): does the tiny policy
learn from what the pipeline, configured as yours, hands slime's loss?

A short run of the learning oracle (scripts/oracle/run.py `run_learning`, the one the CI learning
test and the learning bench run): a redis-server and `rollout engine --policy-path` (the warm tiny
LM behind smg and SGLang's own HTTP front, as CI's learning test runs it) of its own, the producer and two arq workers in this
process on the tiny policy's one- and two-turn arithmetic (a quarter two-turn) at your
configuration's eta and sampling; slime's own train.py at eta 0, else train_async.py as the
launcher runs it (scripts/run_slime_grpo.sh; `--trainer-loop` to choose); slime's RolloutManager
conversion; the CPU actor (scripts/oracle/cpu_actor.py) running slime's advantage and loss code
with your loss flags (scripts/oracle/slime_flags.py; default the launcher's), pushing its weights
after every step in your push mode. 16 groups x 8 samples a step at lr `LEARN_LR`.

What decides: greedy held-out accuracy (temperature 0, one episode per held-out problem, none of
them in the warm start's data: no sampling noise) before the first step and after the last, each
with its standard error over the problems. The run LEARNS when it gains `LEARN_MARGIN` in
`LEARN_STEPS` steps (the CI learning test's margin; with fewer steps it may not reach it). Beside
it: the sampled accuracy (temperature 1, one episode a problem: a rough figure), slime's
`train_rollout_logprob_abs_diff` per step, the drift per lag of the trained tokens
(pipeline/learning/drift.py), and the checks every trained step must pass (rewards and failed
samples always; under train.py at eta 0 the mismatch bound, untrained model tokens and versions
too: pipeline/learning/signal_check.py).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError
from scripts.oracle.run import LEARN_MARGIN, LEARN_STEPS

LOOPS = ("auto", "train", "train_async")  # --trainer-loop; auto: train.py at eta 0, else train_async.py


@dataclass
class LearnOptions:
    steps: int = LEARN_STEPS
    loop: str = "train"  # slime's train.py or train_async.py (`slime_loop`)
    loss: Any = None  # scripts.oracle.slime_flags.LossFlags
    push_mode: Any = "abort"  # pipeline.slime.weight_push.PushMode
    margin: float = LEARN_MARGIN
    slime: Any = None  # scripts.oracle.slime_flags.load_slime()


@dataclass
class LearnVerdict:
    steps: int
    loop: str  # slime's loop that ran: train or train_async
    eta: int
    greedy: dict[int, float]  # steps done -> greedy held-out pass@1
    greedy_se: dict[int, float]
    sampled: dict[int, float]  # steps done -> held-out pass@1 at temperature 1 (one episode a problem)
    sampled_se: dict[int, float]
    problems: int  # held-out problems
    abs_diff: list[float]  # slime's train_rollout_logprob_abs_diff, one a step
    margin: float
    wall_s: float
    failures: dict[int, dict[str, list[str]]] = field(default_factory=dict)  # step -> the checks it failed
    drift: list[Any] = field(default_factory=list)  # pipeline.learning.drift.LagDrift per lag

    @property
    def gain(self) -> float:
        return self.greedy.get(self.steps, math.nan) - self.greedy.get(0, math.nan)

    @property
    def gain_se(self) -> float:
        """The gain's standard error, the two rounds taken as independent (the problems are the
        same in both, so this errs high)."""
        return math.hypot(self.greedy_se.get(0, math.nan), self.greedy_se.get(self.steps, math.nan))

    @property
    def learns(self) -> bool:
        return self.gain >= self.margin  # False where a round is missing (nan)

    @property
    def passed(self) -> bool:
        return self.learns and not self.failures


def slime_loop(choice: str, eta: int) -> str:
    """slime's loop for `--trainer-loop` at `eta`: train.py's data is the current policy's (lag 0),
    train_async.py's one push behind (lag >= 1), so it needs eta >= 1 (pipeline/staleness.py)."""
    if choice not in LOOPS:
        raise ConfigError(f"--trainer-loop {choice!r}: one of {', '.join(LOOPS)}")
    loop = ("train" if eta == 0 else "train_async") if choice == "auto" else choice
    if loop == "train_async" and eta < 1:
        raise ConfigError("--trainer-loop train_async: the configuration's eta is 0, below that loop's lag of 1")
    return loop


def learning_options(steps: int, loop: str, slime_args: str | None, push_mode: Any, eta: int) -> LearnOptions:
    """The stage's options from the command line; slime loaded first, before anything imports the
    pipeline's data source, which binds slime's classes then (scripts/oracle/slime_flags.py
    `load_slime`; raises its SlimeMissing)."""
    from scripts.oracle.slime_flags import LAUNCHER_LOSS_FLAGS, load_slime, loss_flags

    slime = load_slime()
    return LearnOptions(steps=steps, loop=slime_loop(loop, eta), push_mode=push_mode, slime=slime,
                        loss=loss_flags(LAUNCHER_LOSS_FLAGS if slime_args is None else slime_args))


def run_learning_stage(workdir: Path, options: LearnOptions, *, eta: int, sampling: dict[str, Any], warm: Path,
                       tasks: Path, heldout: Path) -> LearnVerdict:
    """The run, on an engine and a Redis of its own; its figures and checks."""
    from pipeline.store.local_redis import LocalRedis
    from scripts.oracle.run import LearnRun, run_learning
    loop = options.loop
    run = LearnRun(steps=options.steps, eval_interval=options.steps, eta=eta, loop=loop, eval_greedy=True,
                   eval_samples=1, eval_start=True, slime_loss=dict(options.loss.values), sampling=dict(sampling),
                   push_mode=getattr(options.push_mode, "value", options.push_mode))
    workdir.mkdir(parents=True, exist_ok=True)
    engine_args = ["--policy-path", str(warm), "--weight-version", "0"]
    with LocalRedis() as server, _engine(engine_args, workdir) as (engine_url, engine_urls):
        result = asyncio.run(run_learning(run, slime=options.slime, workdir=workdir, redis_url=server.url,
                                          ns="check-signal-learn", engine_url=engine_url, engine_urls=engine_urls,
                                          warm=warm, tasks=tasks, heldout=heldout))
    return LearnVerdict(
        steps=options.steps, loop=loop, eta=eta, greedy=result.greedy, greedy_se=result.greedy_se,
        sampled=result.accuracy, sampled_se=result.accuracy_se,
        problems=sum(1 for line in heldout.read_text().splitlines() if line.strip()),
        abs_diff=[float(m.get("train_rollout_logprob_abs_diff", math.nan)) for m in result.metrics],
        margin=options.margin, wall_s=result.wall_s, failures=step_failures(result.signal, loop == "train" and eta == 0),
        drift=result.drift)


@contextmanager
def _engine(engine_args: list[str], workdir: Path) -> Iterator[tuple[str, list[str]]]:
    """The tiny policy's engine: behind SGLang's own HTTP front and smg, as CI's learning test and
    the learning bench run it (workers/sim/stack.py), where the conformance extra is installed
    (it is: slime's loss needs it); else behind the simulator's own routes, said on stdout. Yields
    the URL the workers call and the engines' URLs the weight push reaches."""
    from workers.sim.stack import engine_stack, missing_parts, sim_fields

    missing = missing_parts("smg")
    if missing is None:
        print("engine: the tiny policy behind smg and SGLang's own front (workers/sim/stack.py)", flush=True)
        with engine_stack(workdir / "engine", 1, router="smg", sim=sim_fields(engine_args)) as stack:
            yield stack.router_url, list(stack.engine_urls)
        return
    from scripts.processes import SimEngineProcess

    print(f"engine: the simulator's own routes ({missing})", flush=True)
    with SimEngineProcess(engine_args, log_path=str(workdir / "engine.log")) as engine:
        yield engine.url, [engine.url]


def step_failures(signal: dict[int, Any], sync: bool) -> dict[int, dict[str, list[str]]]:
    """Each trained step's failed checks (scripts/oracle/run.py StepSignal): every check under a sync
    loop; otherwise rewards and failed samples only, since a lagged token's log-prob rightly
    differs from the trainer's recompute (the drift table shows by how much)."""
    from pipeline.learning.signal_check import REMOVAL, REWARD

    out = {}
    for rid, step in sorted(signal.items()):
        failed = step.failures() if sync else {c: m for c, m in ((REWARD, step.rewards), (REMOVAL, step.removal)) if m}
        if failed:
            out[rid] = failed
    return out


def report_learning(v: LearnVerdict, options: LearnOptions) -> list[str]:
    from pipeline.learning.drift import format_table
    from pipeline.learning.signal_check import MISMATCH_BOUND
    from scripts.oracle.run import LearnRun

    flags = options.loss
    mode = getattr(options.push_mode, "value", options.push_mode)
    lines = [f"learning: {v.steps} steps of slime's {v.loop}.py at eta {v.eta}, push mode {mode}, "
             f"{LearnRun.batch} groups x {LearnRun.n} a step ({v.wall_s:.0f} s); slime's loss flags: "
             f"{' '.join(flags.given) or 'slime defaults'}"]
    if flags.ignored or flags.unknown:
        lines.append(f"  not read by the check: {' '.join(flags.ignored) or '-'} (the run's own: batch, lr, paths); "
                     f"not slime's parser's: {' '.join(flags.unknown) or '-'}")
    lines += [f"greedy held-out accuracy ({v.problems} problems, temperature 0): {_acc(v.greedy, v.greedy_se, 0)} "
              f"before, {_acc(v.greedy, v.greedy_se, v.steps)} after {v.steps} steps: gain {v.gain:+.3f} "
              f"± {v.gain_se:.3f} (margin {v.margin:g})",
              f"sampled held-out accuracy (temperature 1, one episode a problem; rough): "
              f"{_acc(v.sampled, v.sampled_se, 0)} -> {_acc(v.sampled, v.sampled_se, v.steps)}"]
    figures = [f"{x:.2g}" for x in v.abs_diff]
    sync = v.loop == "train" and v.eta == 0
    lines.append(f"slime's train_rollout_logprob_abs_diff per step: {', '.join(figures)} "
                 + (f"(bound {MISMATCH_BOUND:g} on every step)" if sync else
                    "(tokens a lag behind the trainer: their drift is the table's)"))
    for rid, failed in v.failures.items():
        lines += [f"FAIL step {rid} {check}: " + "; ".join(messages[:3]) for check, messages in failed.items()]
    if not v.failures:
        lines.append("PASS every trained step's checks (" + ("all of them: a sync loop" if sync else
                                                              "reward and failed-sample checks") + ")")
    if v.drift:
        lines += ["drift per lag of the trained tokens (the trainer's version at the step minus each token's own):",
                  format_table(v.drift)]
    lines.append(f"{'LEARNS' if v.learns else 'DOES NOT LEARN'}: greedy gain {v.gain:+.3f} "
                 f"{'>=' if v.learns else '<'} margin {v.margin:g} in {v.steps} steps")
    return lines


def _acc(values: dict[int, float], se: dict[int, float], step: int) -> str:
    if step not in values:
        return "none"
    return f"{values[step]:.3f} ± {se.get(step, math.nan):.3f}"
