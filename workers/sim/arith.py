"""The tiny policy's tasks, their graders and its warm start: what the learning oracle and
`rollout check-signal` run the tiny LM (workers/sim/tinylm.py) on.

- **Tasks**: single-digit arithmetic ("What is 7 * 8?", + and *, 200 problems), written as raw
  JSONL and turned into tasks.jsonl by the project's own `rollout prepare` (scripts/tiny_tasks.py:
  a producer's step, above this layer) for a `math` environment (`\\boxed{}` + math-verify), and once more as the two-turn task `arith2`
  (`TwoTurnArithmetic`: answer, an observation, the answer plus one). A fixed fifth of the
  problems is the held-out split (the eval dataset); the rest is what the producer enqueues.
- **Warm start**: a short supervised run of the tiny LM on "\\boxed{answer}" over every problem
  (its "pre-training": it has seen the held-out problems too), so it starts between 10% and 50%
  and RL has room to sharpen it; built once per machine and cached.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------- the two-turn task

class TwoTurnArithmetic:
    """A NeMo-RL-style environment (`kind: nemo_rl`, `multi_turn: true`): the first answer gets
    the observation FOLLOW_UP, the second must box the label plus one (reward 1, else 0). Its
    episodes carry a loss mask with the observation's tokens at 0 between two trained turns.
    `config["fail_divisor"]` k > 0: a `step` call with a task whose label is a multiple of k
    raises (the call's episodes end FAILED, with their first turn's tokens), so a run has failed
    samples for the failed-sample check."""

    def __init__(self, config: dict[str, Any] | None = None):
        self.fail_divisor = int((config or {}).get("fail_divisor", 0))

    def step(self, message_logs: list[list[dict[str, Any]]], metadata: list[dict[str, Any]]) -> tuple[Any, ...]:
        if self.fail_divisor and any(int(m["ground_truth"]) % self.fail_divisor == 0 for m in metadata):
            raise RuntimeError(f"TwoTurnArithmetic: a label divisible by {self.fail_divisor} (a planted env failure)")
        observations, rewards, done = [], [], []
        for log, meta in zip(message_logs, metadata):
            turns = [m for m in log if m.get("role") == "assistant"]
            if len(turns) < 2:
                observations.append({"role": "environment", "content": FOLLOW_UP})
                rewards.append(0.0)
                done.append(False)
                continue
            observations.append({"role": "environment", "content": ""})
            rewards.append(self.grade_turn(str(turns[-1].get("content") or ""), str(meta["ground_truth"])))
            done.append(True)
        return observations, list(metadata), [None] * len(metadata), rewards, done

    @staticmethod
    def grade_turn(second_turn: str, label: str) -> float:
        found = _BOXED.findall(second_turn)
        return 1.0 if found and found[-1] == str(int(label) + 1) else 0.0

    @classmethod
    def grade(cls, response: str, label: str) -> float:
        """The reward of a whole response (both turns and the observation between them)."""
        parts = response.split(FOLLOW_UP.strip(), 1)
        return cls.grade_turn(parts[1], label) if len(parts) == 2 else 0.0


def two_turn_env(fail_divisor: int = 0) -> dict[str, Any]:
    options: dict[str, Any] = {"cls": "workers.sim.arith:TwoTurnArithmetic", "multi_turn": True,
                               "label_key": "ground_truth"}
    if fail_divisor:
        options["config"] = {"fail_divisor": fail_divisor}
    return {"kind": "nemo_rl", "max_turns": 2, "options": options}


def grader() -> Any:
    """The reward each task's environment gives a sample, read again from the sample's own
    response tokens and label: `arith` is the math environment's `check_answer` (\\boxed{} +
    math-verify), `arith2` (TwoTurnArithmetic) boxes the label plus one in its second turn."""
    from workers.envs.math import check_answer
    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    tokenizer = load_test_tokenizer(default_tokenizer_path())

    def grade(sample: Any) -> float:
        response = tokenizer.decode(sample.tokens[len(sample.tokens) - sample.response_length:],
                                    skip_special_tokens=True)
        env = sample.metadata.get("source_name")
        if env == "arith":
            return float(check_answer(response, str(sample.label), "boxed", timeout_s=5).reward)
        if env == "arith2":
            return TwoTurnArithmetic.grade(response, str(sample.label))
        raise ValueError(f"grader: sample {sample.index} of environment {env!r}: only arith and arith2 are known")

    return grade



def tasks_of(tasks: Path, env: str) -> Path:
    """tasks.jsonl's rows of one environment, written beside it."""
    rows = [line for line in tasks.read_text().splitlines() if line.strip() and json.loads(line)["env"] == env]
    if not rows:
        raise ValueError(f"{tasks}: no task of environment {env!r}")
    out = tasks.with_name(f"{tasks.stem}-{env}.jsonl")
    out.write_text("".join(row + "\n" for row in rows))
    return out
