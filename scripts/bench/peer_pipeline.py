"""The pipeline's contender of the peer benchmark, (d): redis-server, `rollout workers`, `rollout
enqueue --follow` (scripts/bench/harness.py starts them), and pipeline.slime.data_source.generate_rollout +
RedisDataSource with save(rid) each step in train.py's loop (scripts/bench/peer_measure.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from scripts.bench.harness import CpuMeter, Fleet, as_fleet, pipeline_contender, wait_until
from scripts.bench.peer_measure import SlotSampler, read_engine_counts, trainer_loop
from scripts.bench.peer_slime import slime_path
from scripts.bench.peer_workload import CONTENDERS, Result, Workload

NS = "peer"


def pipeline_config(wl: Workload, redis_url: str, engine_url: str, eval_share: float | None) -> dict[str, Any]:
    from workers.sim.tokenizer import default_tokenizer_path

    config: dict[str, Any] = {
        "redis": {"url": redis_url, "namespace": NS},
        "engine": {"url": engine_url, "tokenizer": default_tokenizer_path(),
                   "request_timeout_s": wl.request_timeout_s},
        "rollout": {"n_samples_per_prompt": wl.n, "rollout_batch_size": wl.batch, "eta": wl.eta,
                    "max_response_tokens": wl.max_response_len, "max_turns": 1,
                    "sampling": {"temperature": 1.0}},
        # liveness lenient: on a loaded 2-core machine a 5 s silence reaped a live worker and
        # re-ran its 16 groups (duplicates refused, tokens wasted)
        "workers": {"concurrency": wl.pipeline_groups(), "job_timeout_s": 120.0, "heartbeat_s": 1.0,
                    "dead_after_s": 30.0, "drain_grace_s": 5.0, "poll_delay_s": 0.05},
        "environments": {"math": {"kind": "math", "options": {"check_in": "inline"}}},
    }
    if eval_share is not None:
        config["workers"]["eval_share"] = eval_share
    return config


def trainer_args(wl: Workload, redis_url: str, evaluation: dict[str, Any] | None) -> SimpleNamespace:
    """The fields of slime's `args` that RedisDataSource and generate_rollout read."""
    args = SimpleNamespace(
        pipeline_redis_url=redis_url, pipeline_namespace=NS, rollout_batch_size=wl.batch,
        n_samples_per_prompt=wl.n, pipeline_eta=wl.eta, pipeline_stale_policy="requeue",
        pipeline_wait_timeout_s=120.0, pipeline_wait_log_s=30.0, pipeline_publish_engine=False,
        pipeline_trainer_loop="sync",  # weights pushed after each step, before the next rollout
    )
    if evaluation:
        args.pipeline_eval_datasets, args.pipeline_eval_mode = str(evaluation["datasets"]), "background"
        args.pipeline_eval_timeout_s = 600.0
        # what slime's eval logger reads (slime's parser sets them; nothing is sent anywhere)
        args.__dict__.update(custom_eval_rollout_log_function_path=None, log_passrate=False, reward_key=None,
                             n_samples_per_eval_prompt=1, wandb_always_use_train_step=False, use_wandb=False,
                             use_tensorboard=False, advantage_estimator="grpo", log_reward_category=None)
    return args


def run_pipeline_contender(wl: Workload, engine_url: str | Fleet, tasks: Path, workdir: Path, engine_pid: int = 0,
                           evaluation: dict[str, Any] | None = None) -> Result:
    """(d). `evaluation` (scripts/bench/peer_eval.py): {"datasets": path, "every": k, "share": s}: a
    background eval round (pipeline_eval_mode background) after every k-th step, eval jobs held to
    the share s of worker slots; the eval calls' waits go into `notes`, the round counts into
    `counters` (eval_*)."""
    import redis as redis_sync

    from pipeline.keys import Keys
    from pipeline.schema import decode_group
    from pipeline.slime.data_source import RedisDataSource, generate_rollout

    sys.path.insert(0, str(slime_path()))  # RedisDataSource hands out slime's own Sample
    fleet = as_fleet(engine_url)
    result = Result("d", CONTENDERS["d"], eta=wl.eta)
    keys = Keys(NS)
    share = evaluation["share"] if evaluation else None
    with pipeline_contender(workdir, tasks, lambda redis_url, url: pipeline_config(wl, redis_url, url, share),
                            fleet=fleet, concurrency=wl.pipeline_groups()) as contender:
        args = trainer_args(wl, contender.redis.url, evaluation)
        source = RedisDataSource(args)  # publishes the trainer's settings: the producer starts admitting
        client: Any = redis_sync.Redis.from_url(contender.redis.url)  # sync client: redis-py types replies Awaitable | T
        ready = wait_until(lambda: client.exists(keys.workers) and client.zcard(keys.queue) > 0, 60)
        result.notes.append(f"workers registered and jobs queued before the clock started: {ready}")

        def held() -> int:  # finished groups in the stream, not yet trained
            return sum(s.response_length for _, fields in client.xrange(keys.groups)
                       for s in decode_group(fields[b"g"]).samples)

        def generate(rollout_id: int) -> list[list[Any]]:
            out = generate_rollout(args, rollout_id, source)
            result.cohort_tails_s.append(max(float(s.metadata.get("episode_s", 0.0))
                                             for group in out.samples for s in group))
            return list(out.samples)

        def evaluate(rollout_id: int) -> None:  # train.py's order: after the push
            if evaluation and (rollout_id + 1) % evaluation["every"] == 0:
                called = time.monotonic()
                generate_rollout(args, rollout_id, source, evaluation=True)
                result.notes.append(f"eval call at {rollout_id}: {time.monotonic() - called:.3f} s")

        sampler = SlotSampler(fleet.engines[0], fleet.engines[1:])
        cpu = CpuMeter({"trainer (data source)": os.getpid(), **contender.pids(engine_pid)})
        cpu.start()
        sampler.start()
        try:
            trainer_loop(wl, result, fleet, sampler, generate,
                         lambda s: s.metadata.get("engine_weight_versions") or s.weight_versions,
                         source.save, held, after_push=evaluate, overheads=True)
            stats = source.last_stats
        finally:
            sampler.finish(result)
            result.cpu_s = cpu.stop()
            source.close()
        read_engine_counts(result, fleet)  # END_RULE: at once, nothing drained
        contender.procs.producer.stop()
        result.carried_tokens = held()
        counters = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()}
        counters |= {f"eval_{k.decode()}": int(v) for k, v in client.hgetall(keys.eval_stats).items()}
        counters["eval_in_flight"] = int(client.hlen(keys.eval_rounds))
        client.close()
        result.notes.append(f"last step stats: {stats}")
        result.counters = counters
    return result
