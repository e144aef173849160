"""A policy that learns through the whole path: the task set, the warm start and the run.

- **Tasks**: single-digit arithmetic ("What is 7 * 8?", + and *, 200 problems), written as raw
  JSONL and turned into tasks.jsonl by the project's own `rollout prepare` for a `math`
  environment (`\\boxed{}` + math-verify). A fixed fifth of the problems is the held-out split
  (the eval dataset); the rest is what the producer enqueues.
- **Warm start**: a short supervised run of the tiny LM (workers/sim/tinylm.py) on
  "\\boxed{answer}" over every problem (its "pre-training": it has seen the held-out problems
  too), stopped as soon as its accuracy at temperature 1 reaches `WARM_TARGET`, so it starts
  between 10% and 50% and RL has room to sharpen it.
- **Run** (`run_learning`): redis-server, the producer, arq workers, SGLang's front over the
  simulator serving the tiny LM (tests/engine_stack.py), and slime's own train.py /
  train_async.py (tests/slime_loop_helpers.py) with the CPU actor (tests/cpu_actor.py) training
  on what slime's RolloutManager hands it and pushing weights with /update_weights_from_disk.
  Held-out accuracy is the pipeline's own eval (`pipeline_eval_datasets`, slime's
  `rollout_manager.eval` at `eval_interval`).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WARM_STEPS = 600  # supervised steps of 64 examples
WARM_LR = 3e-3
WARM_TWO_TURN = 0.25  # share of the warm start's examples in the two-turn task's layout
WARM_BOXED = 0.25  # share of the warm start's examples that box their answer
WARM_VERSION = "w3"  # bump when the tasks, the model shape or the warm start change
FOLLOW_UP = "\nNow add 1 to it.\n"  # the two-turn task's observation after the first answer
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


def problems() -> list[tuple[str, str, bool]]:
    """(question, answer, held_out) for every problem; every fifth is held out."""
    rows = []
    for a in range(10):
        for b in range(10):
            for op, value in (("+", a + b), ("*", a * b)):
                rows.append((f"What is {a} {op} {b}?", str(value)))
    rng = random.Random(1234)
    order = list(range(len(rows)))
    rng.shuffle(order)
    held = set(order[: len(rows) // 5])
    return [(q, a, i in held) for i, (q, a) in enumerate(rows)]


def math_env() -> dict[str, Any]:
    return {"kind": "math", "options": {"answer": "boxed", "check_in": "inline"}}


def _dataset(raw: str) -> dict[str, Any]:
    return {"source": "jsonl", "files": [raw], "fields": {"id": "id", "prompt": "question", "label": "answer"}}


def prepare_tasks(workdir: Path) -> tuple[Path, Path]:
    """tasks.jsonl (the train split, once as the single-turn `arith` task and once as the
    two-turn `arith2` task) and heldout.jsonl (`arith`), each written by `rollout prepare`."""
    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    for split, held in (("train", False), ("heldout", True)):
        rows = [(i, q, a) for i, (q, a, h) in enumerate(problems()) if h == held]
        raw = workdir / f"{split}-raw.jsonl"
        raw.write_text("".join(json.dumps({"id": f"{split}-{i}", "question": q, "answer": a}) + "\n" for i, q, a in rows))
        envs = {"arith": {**math_env(), "dataset": _dataset(raw.name)}}
        if not held:
            two = workdir / f"{split}2-raw.jsonl"
            two.write_text("".join(json.dumps({"id": f"{split}2-{i}", "question": q, "answer": a}) + "\n"
                                   for i, q, a in rows))
            envs["arith2"] = {**two_turn_env(), "dataset": _dataset(two.name)}
        config = workdir / f"prepare-{split}.yaml"
        config.write_text(yaml.safe_dump({"environments": envs}))
        tasks = workdir / ("tasks.jsonl" if split == "train" else "heldout.jsonl")
        subprocess.run([sys.executable, "-m", "producers.prepare_tasks", "--config", str(config),
                        "--output", str(tasks)], check=True, cwd=REPO, capture_output=True)
        out.append(tasks)
    return out[0], out[1]


# ---------------------------------------------------------------- warm start


def _prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_tokenizers() -> list[Any]:
    """The two ways a client tokenizes the prompt: the shared test tokenizer as its own class
    (the simulator's /model_info names it), and as transformers' Qwen2Tokenizer (what a client
    loads from the Qwen2 model directory SGLang's front serves in tests/engine_stack.py: it
    splits numbers into digits). The warm start teaches the model both."""
    from transformers import Qwen2Tokenizer

    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    return [load_test_tokenizer(default_tokenizer_path()), Qwen2Tokenizer.from_pretrained(default_tokenizer_path())]


def sample_accuracy(policy: Any, tokenizer: Any, rows: list[tuple[str, str, bool]], *, temperature: float = 1.0,
                    repeats: int = 2, prefix: str = "") -> float:
    """Fraction of sampled answers whose box holds the answer (a quick check for the warm start;
    the runs grade through the math environment)."""
    from workers.sim.tinylm import GenRequest

    start = list(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else []
    clients = prompt_tokenizers()
    requests = [GenRequest(_prompt_ids(client, q) + start, 16, temperature=temperature)
                for client in clients for q, _, _ in rows]
    results = policy.generate(requests * repeats)
    answers = [a for _, a, _ in rows] * 2 * repeats
    right = 0
    for result, answer in zip(results, answers):
        found = _BOXED.findall(prefix + tokenizer.decode(result.ids, skip_special_tokens=True))
        right += bool(found) and found[-1] == answer
    return right / len(answers)


def warm_start(path: Path, *, seed: int = 0, steps: int = WARM_STEPS, boxed_share: float = WARM_BOXED,
               lr: float = WARM_LR) -> dict[str, Any]:
    """Train the tiny LM on every problem's answer, written "\\boxed{answer}" in `boxed_share`
    of the examples and "Answer: answer" (which the math environment's `answer: boxed` scores 0)
    in the rest; save it at `path` (a second call with the same path reuses it). The model learns
    the sums and a habit of boxing a quarter of the time: at temperature 1 its accuracy starts
    low, and what RL can teach it (box, and be sure of the sum) carries over to the held-out
    problems. Returns {steps, accuracy, parameters}."""
    import torch

    from workers.sim.tinylm import TinyPolicy, count_parameters, new_model, save_checkpoint
    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    info_file = path / "warm_start.json"
    if info_file.exists():
        return dict(json.loads(info_file.read_text()))
    torch.set_num_threads(1)
    tokenizer = load_test_tokenizer(default_tokenizer_path())
    model = new_model(len(tokenizer), seed=seed, eos_id=tokenizer.eos_token_id)
    rows = problems()
    eos = tokenizer.eos_token_id
    clients = prompt_tokenizers()
    singles, doubles = [], []  # (token ids, which of them are trained) per example form
    for (question, answer, _), client in ((row, c) for row in rows for c in clients):
        prompt = _prompt_ids(client, question)
        follow = list(client.encode(FOLLOW_UP, add_special_tokens=False))  # raw observation tokens

        def replies(value: int) -> tuple[list[int], list[int]]:
            boxed = list(tokenizer.encode(f"\\boxed{{{value}}}", add_special_tokens=False)) + [eos]
            return boxed, list(tokenizer.encode(f"Answer: {value}", add_special_tokens=False)) + [eos]

        singles.append((prompt, replies(int(answer))))
        doubles.append((prompt, replies(int(answer)), follow, replies(int(answer) + 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()

    def pick(pair: tuple[list[int], list[int]]) -> list[int]:
        return pair[0] if rng.random() < boxed_share else pair[1]

    for _ in range(steps):
        batch = []
        for _ in range(64):
            if rng.random() < WARM_TWO_TURN:  # the two-turn task's layout: answer, observation, answer
                prompt, first, follow, second = rng.choice(doubles)
                one, two = pick(first), pick(second)
                batch.append((prompt + one + follow + two,
                              [0] * len(prompt) + [1] * len(one) + [0] * len(follow) + [1] * len(two)))
            else:
                prompt, first = rng.choice(singles)
                one = pick(first)
                batch.append((prompt + one, [0] * len(prompt) + [1] * len(one)))
        loss = _sft_loss(model, batch, eos)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    save_checkpoint(model, path)
    policy = TinyPolicy(path, tokenizer, seed=seed)
    accuracy = sample_accuracy(policy, tokenizer, rows, repeats=2)
    knows = sample_accuracy(policy, tokenizer, rows, repeats=1, temperature=0.0, prefix="\\boxed{")
    info = {"steps": steps, "accuracy": accuracy, "boxed_greedy_accuracy": knows, "parameters": count_parameters(model),
            "version": WARM_VERSION}
    info_file.write_text(json.dumps(info))
    return info


def warm_checkpoint() -> Path:
    """The warm start, built once per machine (~45 s of one core) under
    ~/.cache/rollout-pipeline/tiny-warm-<version> (a staging directory renamed into place, so
    racing builders never see half a checkpoint)."""
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollout-pipeline"
    target = root / f"tiny-warm-{WARM_VERSION}"
    if (target / "warm_start.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="warm-build-", dir=root))
    warm_start(staging / "ckpt")
    try:
        os.rename(staging / "ckpt", target)
    except OSError:  # another process won the race; its copy is built the same way
        pass
    shutil.rmtree(staging, ignore_errors=True)
    return target


def _sft_loss(model: Any, batch: list[tuple[list[int], list[int]]], pad: int) -> Any:
    """Cross-entropy on the tokens marked 1 in each (ids, trained) example."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (row, trained) in enumerate(batch):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.where(torch.tensor(trained) == 1, torch.tensor(row), -100)
        mask[i, : len(row)] = 1
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


# ---------------------------------------------------------------- the run


@dataclass
class LearnRun:
    """One learning run's settings: the batch shape, the staleness bound and the loop."""

    steps: int = 12
    batch: int = 16  # groups per step (rollout_batch_size)
    n: int = 8  # samples per group
    eta: int = 0
    loop: str = "train"  # slime's train.py ("train") or train_async.py ("train_async")
    eval_interval: int = 4
    eval_samples: int = 4  # episodes per held-out task
    lr: float = 1e-3
    use_tis: bool = True
    use_rollout_logprobs: bool = False  # slime's --use-rollout-logprobs
    seed: int = 0
    controls: Any = None  # cpu_actor.Controls
    workers: int = 2
    concurrency: int = 32
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0})


@dataclass
class LearnResult:
    accuracy: dict[int, float]  # trainer steps done -> held-out pass@1
    seconds: dict[int, float]  # trainer steps done -> wall seconds since the loop started
    metrics: list[dict[str, float]]
    wall_s: float
    two_turn_samples: int = 0  # trained samples whose loss mask has an untrained stretch between two trained ones


def eval_file(workdir: Path, heldout: Path, samples: int) -> Path:
    path = workdir / "eval.yaml"
    import yaml

    path.write_text(yaml.safe_dump([{"name": "heldout", "env": "arith", "tasks": str(heldout), "n_samples": samples,
                                     "sampling": {"temperature": 1.0}}]))
    return path


def worker_config(redis_url: str, ns: str, engine: str, run: LearnRun) -> dict[str, Any]:
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": run.n, "rollout_batch_size": run.batch, "eta": run.eta,
                    "max_response_tokens": 16, "sampling": run.sampling},
        # the two-turn task is a quarter of what the producer admits (its mixing weight)
        "environments": {"arith": math_env(), "arith2": {**two_turn_env(), "weight": 1 / 3}},
        # liveness lenient: the CPU actor shares this process, and a stalled event loop must not
        # make a job that is starting look orphaned (it would be re-run)
        "workers": {"concurrency": run.concurrency, "heartbeat_s": 2.0, "dead_after_s": 30.0, "poll_delay_s": 0.02},
    }


async def run_learning(run: LearnRun, *, slime: Any, monkeypatch: Any, workdir: Path, redis_url: str, ns: str,
                       engine_url: str, engine_urls: list[str], warm: Path, tasks: Path, heldout: Path) -> LearnResult:
    """slime's loop with the CPU actor over the whole pipeline; held-out accuracy per eval."""
    import asyncio
    import time

    from cpu_actor import Controls, CPUActor, CPUTrainer, quiet_transformers, slime_loss_args
    from slime_loop_helpers import Cluster, install, load_loop, slime_args

    from pipeline.config import parse_config
    from pipeline.redis_conn import connect
    from producers.enqueue import ProducerOptions, run_producer
    from workers.settings import build_worker, stop_worker

    quiet_transformers()
    loop = load_loop(slime.path, run.loop)
    config = parse_config(worker_config(redis_url, ns, engine_url, run))
    workers = [build_worker(config, handle_signals=False) for _ in range(run.workers)]
    tasks_running = [asyncio.create_task(w.async_run()) for w in workers]
    redis = connect(redis_url)
    producer = asyncio.create_task(run_producer(config, tasks, follow=True, epochs=1000, redis=redis,
                                                options=ProducerOptions(poll_s=0.02)))
    cluster = Cluster(engine_urls)
    pipeline_args = dict(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=run.batch,
        n_samples_per_prompt=run.n, pipeline_eta=run.eta, pipeline_wait_timeout_s=300.0, pipeline_wait_log_s=30.0,
        pipeline_trainer_loop="sync" if run.loop == "train" else "async",
        pipeline_eval_datasets=str(eval_file(workdir, heldout, run.eval_samples)), pipeline_eval_timeout_s=300.0,
        sglang_router_ip="127.0.0.1", sglang_router_port=int(engine_url.rsplit(":", 1)[1]),
        global_batch_size=run.batch * run.n, micro_batch_size=1, use_dynamic_batch_size=False,
        cpu_actor=True, **slime_loss_args(use_tis=run.use_tis, use_rollout_logprobs=run.use_rollout_logprobs),
    )
    controls = run.controls or Controls()
    if controls.shuffled_rewards:
        rng = random.Random(run.seed)

        def shuffle(samples: list[Any]) -> None:
            rewards = [s.reward for s in samples]
            rng.shuffle(rewards)
            for s, r in zip(samples, rewards):
                s.reward = r

        pipeline_args["before_convert"] = shuffle
    trainer = CPUTrainer(warm, Namespace(**pipeline_args), lr=run.lr, seed=run.seed, controls=controls)
    checkpoints = workdir / "checkpoints"

    def actor(cluster: Cluster, run_no: int, start: int, crash_at: int | None) -> CPUActor:
        return CPUActor(cluster, run_no, start, crash_at, trainer, checkpoints)

    args = slime_args(pipeline_args, num_rollout=run.steps, interval=1, save_interval=10**6)
    args.eval_interval, args.skip_eval_before_train = run.eval_interval, run.loop != "train"
    started = time.monotonic()
    seconds: dict[int, float] = {}
    try:
        install(monkeypatch, loop, slime, cluster, actor=actor)
        await asyncio.to_thread(loop.train, args)
        wall = time.monotonic() - started
        manager = cluster.managers[-1]
        await asyncio.to_thread(manager.close)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        for worker, task in zip(workers, tasks_running):
            await stop_worker(worker, task)
        await redis.aclose()
    accuracy = {}
    for i, (rid, metrics, when) in enumerate(manager.evals):
        done = 0 if (i == 0 and not args.skip_eval_before_train) else rid + 1  # train.py's eval before step 0
        accuracy[done] = float(metrics["eval/heldout/pass@1"])
        seconds[done] = when - started
    masks = [m for steps in cluster.trained.values() for data in steps.values() for m in data["loss_masks"]]
    return LearnResult(accuracy=accuracy, seconds=seconds, metrics=trainer.metrics, wall_s=wall,
                       two_turn_samples=sum(_gap_between_turns(list(m)) for m in masks))


def _gap_between_turns(mask: list[int]) -> bool:
    """A 0 after a 1 and before another 1: an observation between two trained turns."""
    text = "".join("1" if v else "0" for v in mask)
    return bool(re.search("10+1", text))


# ---------------------------------------------------------------- the two-turn task

class TwoTurnArithmetic:
    """A NeMo-RL-style environment (`kind: nemo_rl`, `multi_turn: true`): the first answer gets
    the observation FOLLOW_UP, the second must box the label plus one (reward 1, else 0). Its
    episodes carry a loss mask with the observation's tokens at 0 between two trained turns."""

    def step(self, message_logs: list[list[dict[str, Any]]], metadata: list[dict[str, Any]]) -> tuple[Any, ...]:
        observations, rewards, done = [], [], []
        for log, meta in zip(message_logs, metadata):
            turns = [m for m in log if m.get("role") == "assistant"]
            if len(turns) < 2:
                observations.append({"role": "environment", "content": FOLLOW_UP})
                rewards.append(0.0)
                done.append(False)
                continue
            found = _BOXED.findall(str(turns[-1].get("content") or ""))
            right = bool(found) and found[-1] == str(int(meta["ground_truth"]) + 1)
            observations.append({"role": "environment", "content": ""})
            rewards.append(1.0 if right else 0.0)
            done.append(True)
        return observations, list(metadata), [None] * len(metadata), rewards, done


def two_turn_env() -> dict[str, Any]:
    return {"kind": "nemo_rl", "max_turns": 2,
            "options": {"cls": "tests.learning:TwoTurnArithmetic", "multi_turn": True, "label_key": "ground_truth"}}
