"""The tiny policy's tasks, their graders and its warm start: what the learning oracle and
`rollout check-signal` run the tiny LM (workers/sim/tinylm.py) on.

- **Tasks**: arithmetic over operands 0..19 ("What is 17 * 8?", + and *, 800 problems), written
  as raw JSONL and turned into tasks.jsonl by the project's own `rollout prepare` (scripts/tiny_tasks.py: a
  producer's step, above this layer) for a `math` environment (`\\boxed{}` + math-verify), and once more as the two-turn task `arith2`
  (`TwoTurnArithmetic`: answer, an observation, the answer plus one; over the train problems
  with single-digit operands, whose two turns fit 16 tokens). The held-out split (the
  eval dataset, `problems`) is 201 problems: whole facts (both operand orders) drawn with a seed
  of their own, in neither the train split the producer enqueues nor the warm start's data.
- **Warm start**: a supervised run of the tiny LM on the train split's answers, boxed
  ("\\boxed{answer}") half the time and "Answer: answer" (graded 0) the other half. It knows
  some sums and products it never saw (greedy after a forced "\\boxed{": 0.39 of the held-out
  problems) and boxes half its answers, so it starts at 0.14 on the held-out problems at
  temperature 1 (its build measures it: `warm_start.json` `heldout_accuracy`) and RL has room
  both ways; built once per machine and cached.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

WARM_STEPS = 1500  # supervised steps of 64 examples
WARM_LR = 3e-3
WARM_TWO_TURN = 0.25  # share of the warm start's examples in the two-turn task's layout
WARM_BOXED = 0.5  # share of the warm start's examples that box their answer
WARM_VERSION = "w5"  # bump when the tasks, the model shape or the warm start change
FOLLOW_UP = "\nNow add 1 to it.\n"  # the two-turn task's observation after the first answer
# The trainer's default learning rate for the tiny policy (the learning bench, the learning test):
# one step of lag then moves the policy about as far as a real run's does (docs/benchmarks.md
# "Learning": lag 1's mean |dlogp| <= 0.03 a token, <= 3% of tokens outside |ratio - 1| > 0.2)
LEARN_LR = 5e-4
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


OPERANDS = 20  # operands 0..OPERANDS-1
HELD_OUT = 200  # at least this many held-out problems
HELD_OUT_SEED = 1234
# The two-turn task's problems: single-digit operands, so that both answers and the observation
# between them fit the runs' 16 response tokens (a three-digit product takes more tokens than
# the budget leaves a second turn)
TWO_TURN_OPERANDS = 10


def fact(question: str) -> tuple[str, frozenset[int]]:
    """A problem's fact: its operator and operands, order aside ("3 + 5" and "5 + 3" are one fact)."""
    found = re.fullmatch(r"What is (\d+) ([+*]) (\d+)\?", question)
    if found is None:
        raise ValueError(f"fact: {question!r} is not an arithmetic problem of workers/sim/arith.py")
    return found.group(2), frozenset((int(found.group(1)), int(found.group(3))))


def problems() -> list[tuple[str, str, bool]]:
    """(question, answer, held_out) for every problem: + and * over operands 0..OPERANDS-1. The
    held-out problems are whole facts (both operand orders) drawn with their own seed until there
    are HELD_OUT of them: no held-out fact is in the train split or the warm start's data, which
    both take the rest only."""
    rows = []
    for a in range(OPERANDS):
        for b in range(OPERANDS):
            for op, value in (("+", a + b), ("*", a * b)):
                rows.append((f"What is {a} {op} {b}?", str(value)))
    facts = sorted({fact(q) for q, _ in rows}, key=lambda f: (f[0], sorted(f[1])))
    random.Random(HELD_OUT_SEED).shuffle(facts)
    held: set[tuple[str, frozenset[int]]] = set()
    count = {f: 0 for f in facts}
    for q, _ in rows:
        count[fact(q)] += 1
    for f in facts:
        if sum(count[h] for h in held) >= HELD_OUT:
            break
        held.add(f)
    return [(q, a, fact(q) in held) for q, a in rows]


def warm_start_rows() -> list[tuple[str, str, bool]]:
    """The problems the warm start trains on: the train split's, never a held-out one."""
    return [row for row in problems() if not row[2]]


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
    loads from the Qwen2 model directory SGLang's front serves in tests/support/engine_stack.py: it
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
    """Train the tiny LM on the train split's answers (`warm_start_rows`: never a held-out
    problem), written "\\boxed{answer}" in `boxed_share` of the examples and "Answer: answer"
    (which the math environment's `answer: boxed` scores 0) in the rest; save it at `path` (a
    second call with the same path reuses it). What RL can teach it (box, and be sure of the
    answer) is measured on problems it never saw. Returns {steps, accuracy (train problems,
    temperature 1), boxed_greedy_accuracy, parameters, version, heldout_accuracy (temperature 1:
    the start), heldout_greedy_accuracy, heldout_boxed_greedy_accuracy}: 1500 steps measured
    0.36, 0.90, 166528, w5, 0.14, 0.0 and 0.39 here (295 s of one core at a load of ~7)."""
    import torch

    from workers.sim.tinylm import count_parameters, new_model
    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    info_file = path / "warm_start.json"
    if info_file.exists():
        return dict(json.loads(info_file.read_text()))
    torch.set_num_threads(1)
    tokenizer = load_test_tokenizer(default_tokenizer_path())
    model = new_model(len(tokenizer), seed=seed, eos_id=tokenizer.eos_token_id)
    rows = warm_start_rows()
    held_out = [row for row in problems() if row[2]]
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
        sft_step(model, optimizer, batch, eos)
    policy = saved_policy(model, path, tokenizer, seed)
    accuracy = sample_accuracy(policy, tokenizer, rows, repeats=2)
    knows = sample_accuracy(policy, tokenizer, rows, repeats=1, temperature=0.0, prefix="\\boxed{")
    info = {"steps": steps, "accuracy": accuracy, "boxed_greedy_accuracy": knows, "parameters": count_parameters(model),
            "version": WARM_VERSION,
            # the start on the held-out problems (never in its data): at temperature 1 and greedy
            "heldout_accuracy": sample_accuracy(policy, tokenizer, held_out, repeats=2),
            "heldout_greedy_accuracy": sample_accuracy(policy, tokenizer, held_out, repeats=1, temperature=0.0),
            "heldout_boxed_greedy_accuracy": sample_accuracy(policy, tokenizer, held_out, repeats=1, temperature=0.0,
                                                             prefix="\\boxed{")}
    info_file.write_text(json.dumps(info))
    return info


def warm_checkpoint() -> Path:
    """The warm start, built once per machine (~2-5 min of one core) under
    ~/.cache/rollout-pipeline/tiny-warm-<version>."""
    return cached_build(f"tiny-warm-{WARM_VERSION}", warm_start)


def cached_build(name: str, build: Any) -> Path:
    """`build(path)`'s checkpoint, built once per machine under ~/.cache/rollout-pipeline/`name`
    (a staging directory renamed into place, so racing builders never see half a checkpoint)."""
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollout-pipeline"
    target = root / name
    if (target / "warm_start.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="warm-build-", dir=root))
    build(staging / "ckpt")
    try:
        os.rename(staging / "ckpt", target)
    except OSError:  # another process won the race; its copy is built the same way
        pass
    shutil.rmtree(staging, ignore_errors=True)
    return target


def sft_step(model: Any, optimizer: Any, batch: list[tuple[list[int], list[int]]], eos: int) -> None:
    """One optimizer step of the warm start's supervised loss on `batch` (both task families)."""
    loss = _sft_loss(model, batch, eos)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def saved_policy(model: Any, path: Path, tokenizer: Any, seed: int) -> Any:
    """The trained warm start saved at `path` (transformers' directory) and served as a TinyPolicy."""
    from workers.sim.tinylm import TinyPolicy, save_checkpoint

    model.eval()
    save_checkpoint(model, path)
    return TinyPolicy(path, tokenizer, seed=seed)


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
    response tokens and label: `arith` (and `sums`, workers/sim/sums.py) is the math environment's `check_answer` (\\boxed{} +
    math-verify), `arith2` (TwoTurnArithmetic) boxes the label plus one in its second turn."""
    from workers.envs.math import check_answer
    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    tokenizer = load_test_tokenizer(default_tokenizer_path())

    def grade(sample: Any) -> float:
        response = tokenizer.decode(sample.tokens[len(sample.tokens) - sample.response_length:],
                                    skip_special_tokens=True)
        env = sample.metadata.get("source_name")
        if env in ("arith", "sums"):  # the math environment (workers/sim/sums.py's family too)
            return float(check_answer(response, str(sample.label), "boxed", timeout_s=5).reward)
        if env == "arith2":
            return TwoTurnArithmetic.grade(response, str(sample.label))
        raise ValueError(f"grader: sample {sample.index} of environment {env!r}: only arith, arith2 and sums are known")

    return grade



def tasks_of(tasks: Path, env: str) -> Path:
    """tasks.jsonl's rows of one environment, written beside it."""
    rows = [line for line in tasks.read_text().splitlines() if line.strip() and json.loads(line)["env"] == env]
    if not rows:
        raise ValueError(f"{tasks}: no task of environment {env!r}")
    out = tasks.with_name(f"{tasks.stem}-{env}.jsonl")
    out.write_text("".join(row + "\n" for row in rows))
    return out
