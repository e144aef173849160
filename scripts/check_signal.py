"""`rollout check-signal`: does the pipeline, as you configured it, hand the trainer an aligned
training signal, and does a policy learn from it? A few minutes on a CPU, no GPU, no model of yours.

Two stages, then one verdict.

The signal checks. The tiny policy (workers/sim/tinylm.py, warm-started on arithmetic:
workers/sim/arith.py) behind the simulated engine, a redis-server of its own, the producer and the
arq workers with your configuration's rollout and worker settings (sampling, eta, concurrency,
retries) on the tiny policy's own tasks (one- and two-turn arithmetic: your environments and
their servers are not called); two rollouts of each task through the pipeline's slime data source
(`pipeline.slime.data_source.generate_rollout`: the conversion slime trains on) as slime's train.py
takes them, with a weight push between them (`--push-mode`, slime's labels: a perturbed copy of
the policy as version 1). Every sample's log-probs are recomputed under the weights of the version
the sample says generated it (a sample whose calls span the push is counted and left out) and the
checks of pipeline/learning/signal_check.py run (docs/signal-bugs.md):

- the mismatch bound: slime's `train_rollout_logprob_abs_diff` (mean |recomputed - rollout|
  over trained tokens, per sample, averaged) under 1e-5, overall, for one- and two-turn
  samples and per turn (an aligned pipeline measures 3.6-7.2e-7 on a CPU in fp32);
- no model token outside the loss mask; every reward its own response's grade; failed samples
  out of the loss and no other; every version within eta of its rollout (and, through the
  recompute, the one whose weights made the tokens).

It prints each figure and check, and the drift per lag (pipeline/learning/drift.py: mean |dlogp|,
the share outside |ratio - 1| > 0.2, the TIS-clipped share, the ESS) of every sample against
version 1 (a perturbed copy, not a trained step: the learning stage's table is a run's drift).

The learning stage (scripts/check_learning.py), when the signal checks pass: `--learn-steps`
(default 10) steps of slime's own train.py (eta 0) or train_async.py (eta > 0, as the launcher
runs it) over the same pipeline at your eta, sampling and push mode, trained by slime's loss with
your loss flags (`--slime-args`, default scripts/run_slime_grpo.sh's), through the learning oracle
(scripts/oracle/). It prints greedy held-out accuracy before and after with its standard error,
slime's `train_rollout_logprob_abs_diff` per step, the drift per lag of the trained tokens, each
step's checks, and LEARNS / DOES NOT LEARN against a margin of 0.15 in 10 steps. It needs
slime's pinned snapshot (scripts/upstream.py), torch and megatron-core (the conformance extra).

`VERDICT: PASS` (exit 0) needs the signal checks and learning; `--learn-steps 0` checks the
signal only and says "learning not checked". `VERDICT: FAIL` exits 4. A stage that cannot run
here (no torch; for learning no slime snapshot or megatron-core) says what is missing and exits
5, checking nothing. ~30 s for the signal checks and ~1-2 min for learning once the tiny policy's
warm start is cached (~1-5 min more the first time on a machine). Not covered: your tool formats
and environments, your model's own numerics.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_FAIL = 4  # the checks ran and the signal failed them, or the policy did not learn (scripts/cli.py's exit table)
EXIT_UNCHECKED = 5  # a stage cannot run on this machine (torch, slime's snapshot, megatron-core missing): nothing checked


@dataclass
class CheckOptions:
    groups: int = 8  # groups in the checked batch
    n: int = 4  # samples per group
    fail_divisor: int = 0  # > 0: the two-turn environment fails on labels divisible by it (failed samples)
    push_mode: Any = "abort"  # pipeline.slime.weight_push.PushMode of the push between the two rollouts
    timeout_s: float = 300.0  # for the batch to fill


@dataclass
class SignalVerdict:
    audit: Any  # signal_check.TokenAudit
    failures: dict[str, list[str]] = field(default_factory=dict)
    samples: int = 0
    turns: dict[int, int] = field(default_factory=dict)  # episode turns -> samples
    by_version: dict[str, int] = field(default_factory=dict)  # policy versions of a sample's calls -> samples
    spanning: int = 0  # samples whose calls span the push (left out of the token audit)
    drift: list[Any] = field(default_factory=list)  # pipeline.learning.drift.LagDrift per lag, against the newest version

    @property
    def passed(self) -> bool:
        return not self.failures


PASSES = ("arith", "arith2")  # one batch of each task: two-turn groups finish after one-turn ones


def check_config(user: dict[str, Any] | None, redis_url: str, engine_url: str, options: CheckOptions,
                 env: str) -> dict[str, Any]:
    """The configuration of one pass: the user's rollout and workers sections, on this check's
    Redis (namespace `check-signal-<env>`), engine and task `env`, at its batch shape and the tiny
    policy's answer length."""
    from workers.sim.arith import math_env, two_turn_env

    user = user or {}
    rollout = {**dict(user.get("rollout") or {}), "n_samples_per_prompt": options.n,
               "rollout_batch_size": options.groups, "max_response_tokens": 16}
    rollout.setdefault("sampling", {"temperature": 1.0})
    environments = {"arith": math_env(), "arith2": two_turn_env(options.fail_divisor)}
    if env not in environments:
        raise ValueError(f"check_config: task {env!r}: one of {', '.join(environments)}")
    workers = {"concurrency": 32, "heartbeat_s": 2.0, "dead_after_s": 30.0, "poll_delay_s": 0.02,
               **dict(user.get("workers") or {})}
    return {"redis": {"url": redis_url, "namespace": f"check-signal-{env}"}, "engine": {"url": engine_url},
            "rollout": rollout, "environments": {env: environments[env]}, "workers": workers}


def trainer_args(config: Any, redis_url: str, options: CheckOptions) -> Namespace:
    """slime's arguments the pipeline's data source reads, for a sync loop (train.py)."""
    return Namespace(
        pipeline_redis_url=redis_url, pipeline_namespace=config.redis.namespace, rollout_batch_size=options.groups,
        n_samples_per_prompt=options.n, pipeline_eta=config.rollout.eta, pipeline_wait_timeout_s=options.timeout_s,
        pipeline_wait_log_s=30.0, pipeline_trainer_loop="sync", update_weights_interval=1)


async def two_rollouts(raw_config: dict[str, Any], tasks: Path, redis_url: str, options: CheckOptions,
                       push: Any) -> list[tuple[int, Any]]:
    """The producer and one in-process arq worker on `raw_config`; rollouts 0 and 1 as the
    pipeline's slime data source hands them to slime, with `push()` between them where slime's
    train.py updates the weights. Returns (rollout id, sample) in order."""
    from pipeline.config import parse_config
    from pipeline.slime.data_source import RedisDataSource, generate_rollout
    from pipeline.store.redis_conn import connect
    from producers.enqueue import ProducerOptions, run_producer
    from workers.settings import build_worker, stop_worker

    config = parse_config(raw_config)
    worker = build_worker(config, handle_signals=False)
    running = asyncio.create_task(worker.async_run())
    redis = connect(redis_url)
    producer = asyncio.create_task(run_producer(config, tasks, follow=True, epochs=1000, redis=redis,
                                                options=ProducerOptions(poll_s=0.02)))
    source = RedisDataSource(trainer_args(config, redis_url, options))
    out: list[tuple[int, Any]] = []
    try:
        for rollout_id in range(2):
            output = await asyncio.to_thread(generate_rollout, source.args, rollout_id, source)
            out += [(rollout_id, s) for group in output.samples for s in group]
            if rollout_id == 0:
                await asyncio.to_thread(push)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await stop_worker(worker, running)
        await asyncio.to_thread(source.close)
        await redis.aclose()
    return out


def pushed_policy(warm: Path, path: Path, scale: float = 0.02, seed: int = 1) -> Path:
    """Version 1: the warm policy with seeded noise on every weight, so that a log-prob of one
    version recomputed under the other misses by far more than the mismatch bound."""
    import torch

    from workers.sim.tinylm import load_model, save_checkpoint

    model = load_model(warm)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return Path(save_checkpoint(model, path))


def push_policy(engine_url: str, path: Path, label: str, mode: Any) -> None:
    """slime's updater on one engine: pause (in `mode`), load the checkpoint with the version
    label, continue (an in-place pause keeps the KV cache: no flush, as slime's updaters do)."""
    from pipeline.slime.weight_push import PushMode, parse_push_mode, pause_body, post_json

    mode = parse_push_mode(mode, "push_policy mode")
    post_json(engine_url, "/pause_generation", pause_body(mode))
    post_json(engine_url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": label,
                                                        "flush_cache": mode is not PushMode.IN_PLACE})
    post_json(engine_url, "/continue_generation", {})


def recompute_log_probs(checkpoints: dict[int, Path], samples: list[Any], *,
                        version: int | None = None) -> list[list[float]]:
    """Each sample's response log-probs under the checkpoint of the policy version it says made
    it (or of `version`): the log-softmax of the logits before each response token, at that token (what slime's
    `compute_log_prob` computes, fp32, one sample at a time)."""
    import torch
    from transformers.utils import logging as hf_logging

    from workers.sim.tinylm import load_model

    hf_logging.disable_progress_bar()  # no bar for the checkpoint loads
    torch.set_num_threads(1)
    models = {version: load_model(path) for version, path in checkpoints.items()}
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s.tokens, dtype=torch.long).unsqueeze(0)
            logits = models[_version(s) if version is None else version](input_ids=ids).logits.float()[0]
            prompt = len(s.tokens) - s.response_length
            log_probs = torch.log_softmax(logits[prompt - 1: len(s.tokens) - 1], dim=-1)
            out.append(log_probs.gather(1, ids[0, prompt:].unsqueeze(1)).squeeze(1).tolist())
    return out


def _version(sample: Any) -> int:
    return int(sample.weight_versions[0])


def verdict(samples: list[tuple[int, Any]], checkpoints: dict[int, Path], eta: int) -> SignalVerdict:
    """Every check of pipeline/learning/signal_check.py on the two rollouts' samples. A sample whose
    generate calls span the push (two versions) has no one policy to recompute it with: counted,
    left out of the token audit."""
    from pipeline.learning.signal_check import (
        REMOVAL,
        REWARD,
        VERSION,
        audit_tokens,
        removal_mismatches,
        reward_mismatches,
        version_mismatches,
    )
    from workers.sim.arith import grader

    versions: list[str] = []
    for rollout_id in (0, 1):
        mine = [s for rid, s in samples if rid == rollout_id]
        versions += version_mismatches(mine, rollout_id, eta=eta)
    flat = [s for _, s in samples]
    one_version = [s for s in flat if len(set(s.weight_versions or ())) == 1
                   and str(s.weight_versions[0]).isdigit() and _version(s) in checkpoints]
    # slime's `_convert_samples_to_train_data`: a removed sample's loss mask is zeroed
    masks = [[0] * s.response_length if s.remove_sample else list(s.loss_mask) for s in one_version]
    audit = audit_tokens(recompute_log_probs(checkpoints, one_version),
                         [list(s.rollout_log_probs) for s in one_version], masks)
    all_masks = [[0] * s.response_length if s.remove_sample else list(s.loss_mask) for s in flat]
    found = {REWARD: reward_mismatches(flat, grader()), REMOVAL: removal_mismatches(flat, all_masks),
             VERSION: versions}
    turns: dict[int, int] = {}
    by_version: dict[str, int] = {}
    for s in flat:
        count = int(s.metadata.get("turns", 0))
        turns[count] = turns.get(count, 0) + 1
        key = "/".join(str(v) for v in dict.fromkeys(s.weight_versions or ["none"]))
        by_version[key] = by_version.get(key, 0) + 1
    failures = {**audit.failures(), **{check: messages for check, messages in found.items() if messages}}
    return SignalVerdict(audit=audit, failures=failures, samples=len(flat), turns=turns, by_version=by_version,
                         spanning=len(flat) - len(one_version), drift=drift_against_newest(checkpoints, flat))


def drift_against_newest(checkpoints: dict[int, Path], samples: list[Any]) -> list[Any]:
    """The drift per lag (pipeline/learning/drift.py) as the trainer would see it holding the newest
    version: every sample recomputed under it, each token at its own version's lag."""
    from pipeline.learning.drift import DriftTally, token_versions

    newest = max(checkpoints)
    current = recompute_log_probs(checkpoints, samples, version=newest)
    masks = [[0] * s.response_length if s.remove_sample else list(s.loss_mask) for s in samples]
    versions = [token_versions(s.response_length, s.metadata.get("token_version_runs"), s.weight_versions, mask)
                for s, mask in zip(samples, masks)]
    tally = DriftTally()
    tally.add_step(newest, current, [list(s.rollout_log_probs) for s in samples], masks, versions)
    return tally.table()


def run_check(user: dict[str, Any] | None, workdir: Path, options: CheckOptions, *, warm: Path,
              tasks: Path) -> SignalVerdict:
    """Engine and Redis of its own; per task two rollouts with a push between."""
    from pipeline.config import parse_config
    from pipeline.store.local_redis import LocalRedis
    from scripts.processes import SimEngineProcess
    from workers.sim.arith import tasks_of

    checkpoints = {0: warm, 1: pushed_policy(warm, workdir / "policy-1")}
    engine_args = ["--policy-path", str(warm), "--weight-version", "0"]
    samples: list[tuple[int, Any]] = []
    eta = 0
    with LocalRedis() as server, SimEngineProcess(engine_args, log_path=str(workdir / "engine.log")) as engine:
        for env in PASSES:
            # slime's labels (pipeline/staleness.py label_versions): train.py pushes the weights it
            # starts from before its first rollout ("1": version 0), then after each step ("2":
            # version 1); each task's pass starts over as a trainer process does
            push_policy(engine.url, warm, "1", options.push_mode)
            raw = check_config(user, server.url, engine.url, options, env)
            eta = parse_config(raw).rollout.eta
            samples += asyncio.run(two_rollouts(
                raw, tasks_of(tasks, env), server.url, options,
                lambda: push_policy(engine.url, checkpoints[1], "2", options.push_mode)))
    return verdict(samples, checkpoints, eta)


def report(result: SignalVerdict) -> str:
    from pipeline.learning.signal_check import CHECKS, MISMATCH_BOUND

    a = result.audit
    lines = [f"samples {result.samples} (episode turns: {dict(sorted(result.turns.items()))}; policy versions: "
             f"{dict(sorted(result.by_version.items()))}), audited {a.samples} ({result.spanning} span the push), "
             f"trained tokens {a.trained_tokens}",
             f"train_rollout_logprob_abs_diff {a.abs_diff:.3g} (bound {MISMATCH_BOUND:g}); one-turn samples "
             f"{_figure(a.abs_diff_single)}, two-turn {_figure(a.abs_diff_multi)}; per turn "
             + ", ".join(f"{k}: {v:.3g}" for k, v in sorted(a.abs_diff_by_turn.items())),
             f"model tokens untrained {a.model_tokens_untrained}"]
    if a.abs_diff_multi is None:
        lines.append("note: no sample with two trained turns (every two-turn episode ran out of tokens or "
                     "failed): the bookkeeping across turns went unchecked")
    for check in CHECKS:
        messages = result.failures.get(check)
        if not messages:
            lines.append(f"PASS {check}")
            continue
        lines.append(f"FAIL {check}: " + "; ".join(messages[:3]) + (f" (+{len(messages) - 3} more)"
                                                                    if len(messages) > 3 else ""))
    if result.drift:
        from pipeline.learning.drift import format_table

        lines += ["drift per lag, every sample against the newest version (version 1 is a perturbed copy of the "
                  "policy, not a trained step: the rows show each token's lag, the learning stage a run's drift):",
                  format_table(result.drift)]
    return "\n".join(lines)


def final_verdict(signal: SignalVerdict, learning: Any, learn_steps: int) -> tuple[bool, str]:
    """(passed, the verdict's line): PASS needs the signal checks and learning
    (check_learning.LearnVerdict; None: not run, because the signal failed or `--learn-steps 0`)."""
    if not signal.passed:
        return False, f"VERDICT: FAIL (the signal checks failed; learning {'not run' if learn_steps else 'not checked'})"
    if learning is None:
        return True, "VERDICT: PASS (the signal checks; learning not checked: --learn-steps 0)"
    if not learning.learns:
        return False, "VERDICT: FAIL (the signal checks passed; the policy DOES NOT LEARN)"
    if learning.failures:
        return False, "VERDICT: FAIL (the signal checks passed; the learning run's steps failed their checks)"
    return True, "VERDICT: PASS (the signal checks and learning)"


def _figure(value: float | None) -> str:
    return "none" if value is None else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    user = _user_config(args.config)
    import os

    from pipeline.slime.weight_push import PUSH_MODE_ENV, parse_push_mode

    push_mode = parse_push_mode(args.push_mode or os.environ.get(PUSH_MODE_ENV) or "abort", "--push-mode")
    options = CheckOptions(groups=args.groups, n=args.n, push_mode=push_mode)
    rollout = _rollout_settings(user, options)  # a configuration that does not load fails here (exit 2)
    if importlib.util.find_spec("torch") is None:
        return _not_run("torch is not installed (the tiny policy runs on it)")
    learning = None
    if args.learn_steps:
        from scripts.check_learning import learning_options
        from scripts.oracle.slime_flags import SlimeMissing

        try:
            learning = learning_options(args.learn_steps, args.trainer_loop, args.slime_args, push_mode, rollout.eta)
        except SlimeMissing as exc:
            return _not_run(f"the learning stage: {exc}; `--learn-steps 0` runs the signal checks only")
    with tempfile.TemporaryDirectory(prefix="check-signal-") as tmp:
        passed = run_stages(user, Path(args.workdir or tmp), options, learning, rollout)
    return 0 if passed else EXIT_FAIL


def _not_run(missing: str) -> int:
    print(f"rollout check-signal: cannot run here: {missing}\nVERDICT: NOT RUN (nothing checked)", file=sys.stderr)
    return EXIT_UNCHECKED


def run_stages(user: dict[str, Any] | None, workdir: Path, options: CheckOptions, learning: Any,
               rollout: Any) -> bool:
    """The signal checks, then (`learning`: check_learning.LearnOptions) the learning stage if they
    passed; prints each stage's report as it ends, then the verdict; whether it passed."""
    import msgspec

    from scripts.check_learning import report_learning, run_learning_stage
    from scripts.oracle.cpu_actor import quiet_transformers
    from scripts.tiny_tasks import prepare_tasks
    from workers.sim.arith import warm_checkpoint

    quiet_transformers()  # no progress bar for each checkpoint the checks load and save
    warm = warm_checkpoint()  # 2-5 min of one core the first time on a machine, then cached
    tasks, heldout = prepare_tasks(workdir / "tasks")
    signal = run_check(user, workdir, options, warm=warm, tasks=tasks)
    print(report(signal), flush=True)
    learned = None
    if learning is not None and signal.passed:
        learned = run_learning_stage(workdir / "learn", learning, eta=rollout.eta,
                                     sampling=msgspec.to_builtins(rollout.sampling), warm=warm, tasks=tasks,
                                     heldout=heldout)
        print("\n".join(report_learning(learned, learning)))
    passed, line = final_verdict(signal, learned, learning.steps if learning is not None else 0)
    print(line, flush=True)
    return passed


def _parser() -> argparse.ArgumentParser:
    from scripts.check_learning import LOOPS
    from scripts.oracle.run import LEARN_STEPS

    parser = argparse.ArgumentParser(prog="rollout check-signal", description=__doc__.split("\n\n")[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="your pipeline configuration (YAML): its rollout and workers "
                        "sections are kept; redis, engine URL and environments are the check's own")
    parser.add_argument("--groups", type=int, default=CheckOptions.groups, help="groups per rollout of the signal checks")
    parser.add_argument("--n", type=int, default=CheckOptions.n, help="samples per group of the signal checks")
    parser.add_argument("--push-mode", default=None, help="the pause mode of every weight push: abort (slime's "
                        "default), retract or in_place (default: $ROLLOUT_PUSH_MODE, else abort)")
    parser.add_argument("--learn-steps", type=_steps, default=LEARN_STEPS, help="trainer steps of the learning "
                        f"stage (default {LEARN_STEPS}, what its margin is set for); 0: the signal checks only, and "
                        "the verdict says 'learning not checked'")
    parser.add_argument("--slime-args", default=None, help="your slime loss flags as one argument (e.g. \"--use-tis "
                        "--eps-clip 0.2 --kl-loss-coef 0.0\"), read with slime's own parser on slime's defaults; a whole "
                        "slime command line may be given: what is not the loss's is listed and not used (default: "
                        "scripts/run_slime_grpo.sh's loss flags)")
    parser.add_argument("--trainer-loop", choices=LOOPS, default="auto", help="slime's loop of the learning stage: "
                        "train (train.py), train_async, or auto: train.py at eta 0, else train_async.py (the launcher's)")
    parser.add_argument("--workdir", help="where tasks and logs go (default: a temporary directory)")
    return parser


EPILOG = """stages:
  1. the signal checks: two rollouts per task (one- and two-turn) with a weight push between, every
     sample recomputed under its version's weights: slime's train_rollout_logprob_abs_diff under
     1e-5, no model token untrained, rewards, failed samples, versions; the drift per lag
  2. learning (if 1 passed): --learn-steps steps of slime's train.py (eta 0) or train_async.py at
     your eta, trained by slime's loss with your --slime-args; greedy held-out accuracy before and
     after with its standard error, LEARNS when it gains 0.15; the drift per lag of the run
VERDICT: PASS needs both (--learn-steps 0: the signal checks only, "learning not checked").

exit codes: 0 PASS, 4 FAIL, 5 not run here (torch missing; for the learning stage slime's
snapshot or megatron-core), 2 a bad flag or configuration. docs/signal-bugs.md says what each check
catches, docs/check-signal-demo.txt shows a run."""


def _steps(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _user_config(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    import yaml

    user = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(user, dict):
        raise ValueError(f"--config {path}: a YAML mapping expected, got {type(user).__name__}")
    return user


def _rollout_settings(user: dict[str, Any] | None, options: CheckOptions) -> Any:
    """The configuration's rollout section as the checks run it (pipeline.config.RolloutSection)."""
    from pipeline.config import parse_config

    return parse_config(check_config(user, "redis://127.0.0.1:6379", "http://127.0.0.1:30000", options, "arith")).rollout
