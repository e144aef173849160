"""A policy that learns through the whole path: the run.

- **Tasks and warm start**: workers/sim/arith.py (the product's, which `rollout check-signal`
  runs too), imported here under their old names.
- **Run** (`run_learning`): redis-server, the producer, arq workers, SGLang's front over the
  simulator serving the tiny LM (workers/sim/stack.py), and slime's own train.py /
  train_async.py (scripts/oracle/slime_loop.py) with the CPU actor (scripts/oracle/cpu_actor.py) training
  on what slime's RolloutManager hands it and pushing weights with /update_weights_from_disk.
  Held-out accuracy is the pipeline's own eval (`pipeline_eval_datasets`, slime's
  `rollout_manager.eval` at `eval_interval`).
"""

from __future__ import annotations

import json
import random
import re
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.tiny_tasks import prepare_tasks  # noqa: F401  (the tests import it from here)
from workers.sim.arith import (  # noqa: F401  (the tasks and warm start moved to the product; tests import them here)
    FOLLOW_UP,
    LEARN_LR,
    TwoTurnArithmetic,
    grader,
    math_env,
    problems,
    sample_accuracy,
    two_turn_env,
    warm_checkpoint,
    warm_start,
)

REPO = Path(__file__).resolve().parent.parent
# A short sync run learns when it gains this much greedy held-out accuracy (temperature 0, one
# episode per held-out problem: no sampling noise) in `LEARN_STEPS` steps over its own start:
# the CI learning test's margin (tests/conformance/test_learning.py) and `rollout check-signal`'s
LEARN_STEPS = 10
LEARN_MARGIN = 0.15

# ---------------------------------------------------------------- the run


@dataclass
class LearnRun:
    """One learning run's settings: the batch shape, the staleness bound and the loop."""

    steps: int = 12
    batch: int = 16  # groups per step (rollout_batch_size)
    n: int = 8  # samples per group
    eta: int = 0
    loop: str = "train"  # slime's train.py ("train") or train_async.py ("train_async")
    eval_interval: int | None = 4  # None: no eval round (the signal checks need none)
    eval_samples: int = 4  # episodes per held-out task
    # also a greedy round (temperature 0, one episode per task): no sampling noise, so a CI test can
    # hold a margin on it (tests/conformance/test_learning.py); LearnResult.greedy
    eval_greedy: bool = False
    lr: float = LEARN_LR
    use_tis: bool = True
    use_rollout_logprobs: bool = False  # slime's --use-rollout-logprobs
    # slime's loss arguments in full (scripts/oracle/slime_flags.py `loss_flags`: a user's flags on
    # slime's defaults); None: cpu_actor.slime_loss_args with `use_tis` and `use_rollout_logprobs`
    slime_loss: dict[str, Any] | None = None
    push_mode: str = "abort"  # SGLang's pause mode of every weight push (pipeline.slime.weight_push.PushMode)
    # also evaluate the start under train_async.py (which evaluates after steps only): one round
    # through the pipeline's eval before the producer starts (slime's fully async rollout always does)
    eval_start: bool = False
    seed: int = 0
    controls: Any = None  # cpu_actor.Controls
    workers: int = 2
    concurrency: int = 32
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0})
    # the trainer's step on the simulated GPU's clock (cpu_actor.TrainerClock): its token rate
    # there and the engine's time scale; 0 = the step lasts what the CPU takes
    trainer_tokens_per_s: float = 0.0
    time_scale: float = 1.0
    # the arq workers in a `rollout workers` child process (their grading and HTTP then leave the
    # trainer's process and its GIL, as on a cluster), else `workers` of them in this process
    worker_process: bool = False
    # what feeds slime's loop: "pipeline" (RedisDataSource + pipeline.slime.data_source.generate_rollout, the
    # producer and workers) or "slime_fully_async" (slime's own RolloutDataSourceWithBuffer and
    # fully_async_rollout over the train split's single-turn problems; `slime_fully_async_args`;
    # its RolloutManager in a process of its own, scripts/oracle/rollout_process.py)
    rollout: str = "pipeline"
    two_turn: bool = True  # the two-turn task in the producer's train mix (a quarter of it)
    # the task family: "arith" (workers/sim/arith.py, 16 response tokens) or "sums"
    # (workers/sim/sums.py: worked answers of 2-30 lines, a heavy tail; single-turn only)
    family: str = "arith"
    env_fail_divisor: int = 0  # > 0: the two-turn environment fails on labels divisible by it (TwoTurnArithmetic)
    # slime's --sglang-server-concurrency (its default, slime/backends/sglang_utils/arguments.py):
    # the fully async worker's groups in flight and slime's per-sample semaphore, x engines
    slime_concurrency: int = 512


@dataclass
class LearnResult:
    accuracy: dict[int, float]  # trainer steps done -> held-out pass@1
    seconds: dict[int, float]  # trainer steps done -> wall seconds since the loop started
    metrics: list[dict[str, float]]
    wall_s: float
    two_turn_samples: int = 0  # trained samples whose loss mask has an untrained stretch between two trained ones
    trainer_overruns: int = 0  # steps whose CPU work outlasted their simulated budget (TrainerClock)
    trainer_cpu_share: float = 0.0  # the largest share of a step's budget the CPU's work took
    trainer_steps: list[tuple[int, float, float]] = field(default_factory=list)  # TrainerClock.steps, in order
    samples: dict[int, list[Any]] = field(default_factory=dict)  # rollout id -> the samples slime's loop trained
    eval_metrics: list[dict[str, Any]] = field(default_factory=list)  # every eval round's metrics, in order
    untrained_groups: int = 0  # slime_fully_async: groups its worker finished that no step took (never trained)
    greedy: dict[int, float] = field(default_factory=dict)  # trainer steps done -> greedy held-out pass@1 (eval_greedy)
    greedy_se: dict[int, float] = field(default_factory=dict)  # trainer steps done -> its standard error over the problems
    signal: dict[int, StepSignal] = field(default_factory=dict)  # rollout id -> the step's signal checks
    drift: list[Any] = field(default_factory=list)  # pipeline.learning.drift.LagDrift per lag, over every trained step
    accuracy_se: dict[int, float] = field(default_factory=dict)  # trainer steps done -> the eval's standard error
    # rollout id -> real seconds slime's loop spent in its generate call (sync: the step's whole generation)
    generate_s: dict[int, float] = field(default_factory=dict)
    # trainer steps done -> real seconds its eval round took (the loop's wait inside the eval call)
    eval_s: dict[int, float] = field(default_factory=dict)


@dataclass
class StepSignal:
    """One trained step's signal checks (pipeline/learning/signal_check.py): the token audit of what the
    actor was handed against its recomputed log-probs, and the checks on the samples themselves."""

    tokens: Any  # signal_check.TokenAudit
    rewards: list[str]  # reward_mismatches: rewards that are not their own response's grade
    removal: list[str]  # removal_mismatches: failed samples trained, or good ones removed
    versions: list[str] | None  # version_mismatches (None: not a sync run at eta 0, no single expected version)
    turns: dict[int, int] = field(default_factory=dict)  # episode turns (the episode's own count) -> samples

    def failures(self) -> dict[str, list[str]]:
        """The checks this step failed -> what they found ({} when the signal is aligned)."""
        from pipeline.learning.signal_check import REMOVAL, REWARD, VERSION

        found = {REWARD: self.rewards, REMOVAL: self.removal, VERSION: self.versions or []}
        return {**self.tokens.failures(), **{check: _first_few(messages) for check, messages in found.items() if messages}}


def _first_few(messages: list[str], few: int = 3) -> list[str]:
    return messages[:few] + ([f"... and {len(messages) - few} more"] if len(messages) > few else [])


def eval_file(workdir: Path, heldout: Path, samples: int, greedy: bool = False, env: str = "arith") -> Path:
    path = workdir / "eval.yaml"
    import yaml

    datasets = [{"name": "heldout", "env": env, "tasks": str(heldout), "n_samples": samples,
                 "sampling": {"temperature": 1.0}}]
    if greedy:
        datasets.append({"name": "greedy", "env": env, "tasks": str(heldout), "n_samples": 1,
                         "sampling": {"temperature": 0.0}})
    path.write_text(yaml.safe_dump(datasets))
    return path


def worker_config(redis_url: str, ns: str, engine: str, run: LearnRun) -> dict[str, Any]:
    if run.family == "sums":  # one single-turn environment, answers up to its budget
        from workers.sim import sums

        environments, max_tokens = {sums.ENV: math_env()}, sums.MAX_RESPONSE_TOKENS
    else:
        environments = {"arith": math_env(), **(
            {"arith2": {**two_turn_env(run.env_fail_divisor), "weight": 1 / 3}} if run.two_turn else {})}
        max_tokens = 16
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": run.n, "rollout_batch_size": run.batch, "eta": run.eta,
                    "max_response_tokens": max_tokens, "sampling": run.sampling},
        # the two-turn task is a quarter of what the producer admits (its mixing weight)
        "environments": environments,
        # liveness lenient: the CPU actor shares this process, and a stalled event loop must not
        # make a job that is starting look orphaned (it would be re-run)
        "workers": {"concurrency": run.concurrency, "heartbeat_s": 2.0, "dead_after_s": 30.0, "poll_delay_s": 0.02},
    }


async def run_learning(run: LearnRun, *, slime: Any, workdir: Path, redis_url: str, ns: str, engine_url: str,
                       engine_urls: list[str], warm: Path, tasks: Path, heldout: Path,
                       monkeypatch: Any = None) -> LearnResult:
    """slime's loop with the CPU actor over the whole pipeline; held-out accuracy per eval.

    The stand-ins under slime's loop (slime_loop.install) go in through `monkeypatch` (pytest's,
    which the test undoes) or, None, through a `Patches` of the run's own, undone when it ends."""
    import asyncio
    import time

    from pipeline.config import parse_config
    from pipeline.slime.weight_push import parse_push_mode
    from pipeline.store.redis_conn import connect
    from producers.enqueue import ProducerOptions, run_producer
    from scripts.oracle.cpu_actor import (
        Controls,
        CPUActor,
        CPUTrainer,
        TrainerClock,
        quiet_transformers,
        slime_loss_args,
    )
    from scripts.oracle.rollout_process import RolloutProcess
    from scripts.oracle.slime_loop import Cluster, Patches, install, load_loop, slime_args
    from workers.settings import build_worker, stop_worker

    if run.rollout not in ROLLOUTS:
        raise ValueError(f"LearnRun.rollout {run.rollout!r}: one of {', '.join(ROLLOUTS)}")
    fully_async = run.rollout == "slime_fully_async"  # no producer: the workers run the eval jobs only
    if run.family not in ("arith", "sums") or (run.family == "sums" and (fully_async or run.two_turn)):
        raise ValueError(f"LearnRun.family {run.family!r}: arith, or sums (single-turn, the pipeline's rollout: "
                         "slime's fully async contender runs arith's 16-token answers)")
    quiet_transformers()
    loop = load_loop(slime.path, run.loop)
    raw_config = worker_config(redis_url, ns, engine_url, run)
    config = parse_config(raw_config)  # the producer's, and the in-process workers'
    child = _worker_process(raw_config, workdir, run) if run.worker_process else None
    workers = [] if child else [build_worker(config, handle_signals=False) for _ in range(run.workers)]
    tasks_running = [asyncio.create_task(w.async_run()) for w in workers]
    redis = connect(redis_url)

    def start_producer() -> asyncio.Task[Any]:
        return asyncio.create_task(run_producer(
            config, train_tasks(tasks, run.two_turn) if run.family == "arith" else tasks, follow=True, epochs=1000,
            redis=redis, options=ProducerOptions(poll_s=0.02)))

    # with `eval_start` the producer waits for the start's eval round (no training group is admitted under it)
    producer = None if fully_async or run.eval_start else start_producer()
    cluster = Cluster(engine_urls, push_mode=parse_push_mode(run.push_mode, "LearnRun.push_mode"))
    pipeline_args = dict(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=run.batch,
        n_samples_per_prompt=run.n, pipeline_eta=run.eta, pipeline_wait_timeout_s=300.0, pipeline_wait_log_s=30.0,
        pipeline_trainer_loop="sync" if run.loop == "train" else "async",
        pipeline_eval_datasets=str(eval_file(workdir, heldout, run.eval_samples, run.eval_greedy,
                                             "sums" if run.family == "sums" else "arith")),
        pipeline_eval_timeout_s=300.0,
        sglang_router_ip="127.0.0.1", sglang_router_port=int(engine_url.rsplit(":", 1)[1]),
        global_batch_size=run.batch * run.n, micro_batch_size=1, use_dynamic_batch_size=False,
        cpu_actor=True, **(run.slime_loss if run.slime_loss is not None
                           else slime_loss_args(use_tis=run.use_tis, use_rollout_logprobs=run.use_rollout_logprobs)),
    )
    if fully_async:
        pipeline_args.update(slime_fully_async_args(run, workdir, engine_url, len(engine_urls), tasks))
    controls = run.controls or Controls()
    if controls.shuffled_rewards:
        rng = random.Random(run.seed)

        def shuffle(samples: list[Any]) -> None:
            rewards = [s.reward for s in samples]
            rng.shuffle(rewards)
            for s, r in zip(samples, rewards):
                s.reward = r

        pipeline_args["before_convert"] = shuffle
    trainer = CPUTrainer(warm, Namespace(**pipeline_args), lr=run.lr, seed=run.seed, controls=controls,
                         clock=TrainerClock(run.trainer_tokens_per_s, run.time_scale))
    checkpoints = workdir / "checkpoints"

    def actor(cluster: Cluster, run_no: int, start: int, crash_at: int | None) -> CPUActor:
        return CPUActor(cluster, run_no, start, crash_at, trainer, checkpoints)

    args = slime_args(pipeline_args, num_rollout=run.steps, interval=1, save_interval=10**6)
    args.eval_interval, args.skip_eval_before_train = run.eval_interval, run.loop != "train"
    # slime's fully async rollout: its RolloutManager in a process of its own, as a Ray actor is,
    # started (its imports done) before the clock
    rollout_process = RolloutProcess(slime.path) if fully_async else None
    started = time.monotonic()
    seconds: dict[int, float] = {}
    first_eval, untrained = None, 0
    own_patches = Patches() if monkeypatch is None else None
    patches = own_patches or monkeypatch
    try:
        install(patches, loop, slime, cluster, actor=actor,
                manager=rollout_process.manager if rollout_process is not None else None)
        if (fully_async or run.eval_start) and args.skip_eval_before_train:  # train_async.py evaluates after steps only
            first_eval = await asyncio.to_thread(pipeline_eval, args, 0, None)
            first_eval_at = time.monotonic()
            first_eval_s = first_eval_at - started
            if not fully_async:  # the trainer's own data source (a trainer run of its own) evaluates from here
                close_eval_sources()
        if producer is None and not fully_async:
            producer = start_producer()
        await asyncio.to_thread(loop.train, args)
        wall = time.monotonic() - started
        manager = cluster.managers[-1]
        await asyncio.to_thread(manager.close)
    finally:
        if rollout_process is not None:
            untrained = await asyncio.to_thread(rollout_process.stop)
            close_eval_sources()  # the first eval's, in this process
        if producer is not None:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        for worker, task in zip(workers, tasks_running):
            await stop_worker(worker, task)
        if child is not None:
            await asyncio.to_thread(child.stop)
        close_eval_sources()  # a start's eval cut short
        await redis.aclose()
        if own_patches is not None:
            own_patches.undo()
    accuracy, greedy, accuracy_se, greedy_se, eval_s = {}, {}, {}, {}, {}
    rounds = [(0, first_eval.metrics, first_eval_at, first_eval_s)] if first_eval is not None else []
    call_s = [s for _, s in manager.eval_calls]  # in the order of manager.evals: one call, one round
    for i, (rid, metrics, when) in enumerate(manager.evals):
        done = 0 if (i == 0 and not args.skip_eval_before_train) else rid + 1  # train.py's eval before step 0
        rounds.append((done, metrics, when, call_s[i] if i < len(call_s) else 0.0))
    for done, metrics, when, took in rounds:
        accuracy[done], seconds[done], eval_s[done] = float(metrics["eval/heldout/pass@1"]), when - started, took
        accuracy_se[done] = float(metrics.get("eval/heldout/pass@1_stderr", float("nan")))
        if "eval/greedy/pass@1" in metrics:
            greedy[done] = float(metrics["eval/greedy/pass@1"])
            greedy_se[done] = float(metrics.get("eval/greedy/pass@1_stderr", float("nan")))
    signal = step_signals(cluster, manager, trainer.recomputed, sync=run.loop == "train" and run.eta == 0
                          and not fully_async)
    masks = [m for steps in cluster.trained.values() for data in steps.values() for m in data["loss_masks"]]
    evals = ([dict(first_eval.metrics)] if first_eval is not None else []) + [m for _, m, _ in manager.evals]
    return LearnResult(accuracy=accuracy, seconds=seconds, metrics=trainer.metrics, wall_s=wall,
                       two_turn_samples=sum(_gap_between_turns(list(m)) for m in masks),
                       trainer_overruns=trainer.clock.overruns, trainer_cpu_share=trainer.clock.cpu_share,
                       trainer_steps=list(trainer.clock.steps),
                       samples=dict(manager.batches), eval_metrics=evals, untrained_groups=untrained,
                       greedy=greedy, greedy_se=greedy_se, signal=signal, drift=drift_by_lag(cluster, manager, trainer),
                       accuracy_se=accuracy_se, generate_s=dict(manager.generate_s), eval_s=eval_s)


def step_signals(cluster: Any, manager: Any, recomputed: dict[int, list[list[float]]], *,
                 sync: bool) -> dict[int, StepSignal]:
    """The signal checks of every step the actor trained (the last trainer process's run)."""
    from pipeline.learning.signal_check import audit_tokens, removal_mismatches, reward_mismatches, version_mismatches

    trained = cluster.trained[max(cluster.trained)] if cluster.trained else {}
    grade = grader()
    out = {}
    for rid, data in sorted(trained.items()):
        samples = flat_samples(manager.batches[rid])
        audit = audit_tokens(recomputed[rid], data["rollout_log_probs"], data["loss_masks"])
        turns: dict[int, int] = {}
        for sample in samples:
            count = int(sample.metadata.get("turns", 0))
            turns[count] = turns.get(count, 0) + 1
        out[rid] = StepSignal(tokens=audit, rewards=reward_mismatches(samples, grade),
                              removal=removal_mismatches(samples, data["loss_masks"]),
                              versions=version_mismatches(samples, rid) if sync else None, turns=turns)
    return out


def drift_by_lag(cluster: Any, manager: Any, trainer: Any) -> list[Any]:
    """The drift per lag (pipeline/learning/drift.py) over every step the actor trained: each trained
    token's rollout log-prob against the trainer's recompute at that step, its lag the trainer's
    version then minus the token's own policy version."""
    from pipeline.learning.drift import DriftTally, token_versions

    run = max(cluster.trained) if cluster.trained else 0
    trained = cluster.trained.get(run, {})
    tally = DriftTally()
    for rid, data in sorted(trained.items()):
        samples = flat_samples(manager.batches[rid])
        versions = [token_versions(s.response_length, s.metadata.get("token_version_runs"),
                                   call_versions(s, cluster.truth, run), mask)
                    for s, mask in zip(samples, data["loss_masks"])]
        tally.add_step(trainer.version_at[rid], trainer.recomputed[rid], data["rollout_log_probs"],
                       data["loss_masks"], versions)
    return tally.table()


def call_versions(sample: Any, truth: dict[tuple[int, str], int], run: int) -> list[Any]:
    """A sample's policy version per generate call. The pipeline's samples carry versions already
    (pipeline/slime/samples.py: `weight_versions` are policy versions, the engine's labels kept in
    `engine_weight_versions`); slime's own generate (the fully async contender) keeps SGLang's
    labels, which the actor's pushes map to versions (`Cluster.truth`: slime's k-th push of a
    process is label k, the policy after k - 1 steps there); a label no push made (the engine's
    start, "0" in the bench) is its own number."""
    labels = list(sample.weight_versions or [])
    if "engine_weight_versions" in (sample.metadata or {}):
        return labels
    return [truth.get((run, str(label)), label) for label in labels]


def flat_samples(batch: list[Any]) -> list[Any]:
    """The samples of a rollout in the order slime's conversion flattens them (groups in order)."""
    out: list[Any] = []
    for item in batch:
        out += flat_samples(item) if isinstance(item, list) else [item]
    return out


def _worker_process(config: dict[str, Any], workdir: Path, run: LearnRun) -> Any:
    """`rollout workers` on `config`, one process with `run.workers` x its concurrency."""
    from scripts.processes import WorkerProcess, write_config

    config = {**config, "workers": {**config["workers"], "concurrency": run.workers * run.concurrency}}
    path = write_config(config, workdir / "workers.yaml")
    return WorkerProcess(path, log_path=str(workdir / "workers.log")).start()


def _gap_between_turns(mask: list[int]) -> bool:
    """A 0 after a 1 and before another 1: an observation between two trained turns."""
    text = "".join("1" if v else "0" for v in mask)
    return bool(re.search("10+1", text))


# ---------------------------------------------------------------- slime's fully async rollout

ROLLOUTS = ("pipeline", "slime_fully_async")
EVAL_FUNCTION_PATH = "scripts.oracle.run.pipeline_eval"  # slime's --eval-function-path for slime's own rollout
_EVAL_SOURCES: dict[tuple[str, str], Any] = {}  # (redis url, namespace) -> the eval's RedisDataSource


def train_tasks(tasks: Path, two_turn: bool) -> Path:
    """What the producer enqueues: tasks.jsonl as `prepare_tasks` wrote it, or (`two_turn` off)
    its single-turn `arith` rows only, the problems slime's own generate can run."""
    if two_turn:
        return tasks
    single = tasks.with_name("tasks-single-turn.jsonl")
    rows = [line for line in tasks.read_text().splitlines() if line.strip() and json.loads(line)["env"] == "arith"]
    single.write_text("".join(row + "\n" for row in rows))
    return single


def slime_fully_async_args(run: LearnRun, workdir: Path, engine_url: str, engines: int, tasks: Path) -> dict[str, Any]:
    """slime's arguments for its own fully async rollout, as a slime user runs it:

    --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async
    --data-source-path slime.rollout.data_source.RolloutDataSourceWithBuffer
    --prompt-data train-raw.jsonl --input-key question --label-key answer --apply-chat-template
    --custom-rm-path workers.inslime.reward --custom-config-path <the `arith` math environment>
    --eval-function-path scripts.oracle.run.pipeline_eval --sglang-server-concurrency `run.slime_concurrency`

    The prompts are the train split's raw problems (what `rollout prepare` turned into the
    pipeline's `arith` tasks); slime's default generate runs one turn, so only those. The reward
    is the project's math environment (\\boxed{} + math-verify) run in slime's process, the grader
    of the pipeline's workers. The rest (router, sampling at temperature 1 and 16 response
    tokens, tokenizer) is what the peer bench's contender (c) sets (peer_contenders.slime_args).
    `pipeline_eta` concerns the eval's data source only (slime's async loop's floor)."""
    from pipeline.staleness import TrainerLoop, lag_floor
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_contenders import slime_args as peer_slime_args

    if run.two_turn:
        raise ValueError("LearnRun(rollout='slime_fully_async'): slime's default generate runs one turn; "
                         "set two_turn=False")
    raw = tasks.parent / "train-raw.jsonl"  # prepare_tasks' train split, before `rollout prepare`
    if not raw.exists():
        raise FileNotFoundError(f"{raw}: the train split's raw problems (scripts/oracle/run.py prepare_tasks writes it)")
    reward_config = workdir / "slime-reward.yaml"
    reward_config.write_text(json.dumps({"environments": {"arith": math_env()}}))  # JSON is YAML
    workload = Workload(batch=run.batch, n=run.n, max_response_len=16, concurrency=run.slime_concurrency,
                        engines=engines)
    slime_rollout = vars(peer_slime_args("c", workload, engine_url, raw, workdir))
    return {
        **slime_rollout, "input_key": "question", "label_key": "answer", "apply_chat_template": True,
        "data_source_path": "slime.rollout.data_source.RolloutDataSourceWithBuffer",
        "rollout_function_path": "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
        "eval_function_path": EVAL_FUNCTION_PATH,
        "custom_rm_path": "workers.inslime.reward", "custom_config_path": str(reward_config),
        "pipeline_eta": lag_floor(loop=TrainerLoop.SYNC if run.loop == "train" else TrainerLoop.ASYNC),
    }


def pipeline_eval(args: Any, rollout_id: int, data_source: Any, evaluation: bool = True) -> Any:
    """slime's --eval-function-path for a run whose data source is not the pipeline's: the
    pipeline's eval (`pipeline.slime.eval_entry.evaluate`, `pipeline_eval_datasets`, through the
    workers) on a RedisDataSource built on first use from the pipeline_* args and kept per
    (redis, namespace) until `close_eval_sources`. No producer is needed: the workers run the eval
    jobs. So every contender's held-out accuracy is one code, sampling and grader."""
    from pipeline.slime.data_source import RedisDataSource
    from pipeline.slime.eval_entry import evaluate

    if not evaluation:
        raise ValueError("scripts.oracle.run.pipeline_eval is an eval function (slime calls it with evaluation=True)")
    key = (str(args.pipeline_redis_url), str(args.pipeline_namespace))
    source = _EVAL_SOURCES.get(key)
    if source is None:
        source = _EVAL_SOURCES[key] = RedisDataSource(args)
    return evaluate(args, rollout_id, source)


def close_eval_sources() -> None:
    while _EVAL_SOURCES:
        _, source = _EVAL_SOURCES.popitem()
        source.close()


def fresh_slime_rollout_process() -> None:
    """slime's rollout-side singletons as a new RolloutManager process has them (a Ray actor is
    one process per run; here runs share one): no fully async worker, no HTTP client, no
    GenerateState, no background loop (the peer bench resets the same, run_slime_contender)."""
    from slime.rollout import fully_async_rollout
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils import async_utils, http_utils

    fully_async_rollout._global_worker = None
    http_utils._http_client = None
    async_utils.async_loop = None
    GenerateState.clear_instances()


def stop_fully_async_worker(args: Any, timeout_s: float = 60.0) -> int:
    """End slime's fully async worker and background loop; return how many finished groups it
    left in its queue (generated, never trained: no step took them). slime's own signal first
    (`GenerateState.aborted`: a generation not yet sent ends ABORTED at once instead of running
    for nothing), then slime's own `_stop_global_worker` (what its atexit hook runs), whose 5 s
    join the drain of requests in flight can outlast: the thread is joined here until it ends."""
    from slime.rollout import fully_async_rollout
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils import async_utils
    from slime.utils.types import Sample

    worker = fully_async_rollout._global_worker
    left = 0
    if worker is not None:
        thread = worker.worker_thread
        worker.running = False  # no top-up from here
        GenerateState(args).aborted = True
        fully_async_rollout._stop_global_worker()
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"slime's fully async worker still running {timeout_s:.0f} s after its stop")
        done = (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        left = sum(all(s.status in done for s in group) for _, group in worker.get_completed_groups())
    background = async_utils.async_loop  # generate_rollout_fully_async's `run` (slime.utils.async_utils)
    if background is not None:
        background.loop.call_soon_threadsafe(background.loop.stop)
        background._thread.join(timeout_s)
        background.loop.close()
    fresh_slime_rollout_process()  # the HTTP client belonged to the worker's loop: dropped with it
    return left
