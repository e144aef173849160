"""`sums`: the tiny policy's task family whose answer length varies with the problem, for the
learning bench's generation-bound clock (docs/benchmarks.md "The user's clock").

A problem is "Start at 7 and add 4, 6 times." Its worked answer counts the additions, one line
each, then boxes the result:

    1: 11
    2: 15
    ...
    6: 31
    \\boxed{31}

so the answer's length is set by the problem (4-5 tokens a step: the counter, the running
value), and every step is local (the counter plus one, the value plus the prompt's addend, stop
when the counter reaches the prompt's count), which a 0.2M-parameter model learns in a few
minutes of one core. The counts follow a heavy tail, a power law P(k) ~ k^-2 over 2..30
(most answers a few lines, a few 30), so a step's longest answer, which sync's generation waits
for, is several times its mean. The lengths the runs see are the model's own: it decides when to
stop (a miscount ends early or runs on; the budget `MAX_RESPONSE_TOKENS` holds the longest
worked answer with room to spare).

The held-out split (`HELD_OUT` distinct problems) and the train split (`TRAIN`, drawn after it
with the same law) are disjoint as (start, addend, count) triples; the warm start trains on the train
split only. The math environment grades the box (`\\boxed{}` + math-verify), as for `arith`.
The warm start is built once per machine and cached (`warm_checkpoint`), as arith's is.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

ENV = "sums"  # the environment name of the family's tasks (workers/sim/arith.py `grader` knows it)
MIN_STEPS, MAX_STEPS = 2, 30  # the shortest and the longest count
TAIL_EXPONENT = 2.0  # P(k) ~ k^-TAIL_EXPONENT: a power law's heavy tail, cut at MAX_STEPS
STARTS, ADDENDS = 100, 9  # start 0..99, addend 1..9
TRAIN, HELD_OUT = 4000, 256
SPLIT_SEED = 4545
# the longest worked answer is 30 lines of <= 6 tokens (counter, ':', value in <= 3 tokens, '\n')
# plus the box (~9 tokens), ~190 tokens; the budget leaves a miscount room to run on, and with
# the prompt (~25 tokens) stays under the tiny model's 256 positions
MAX_RESPONSE_TOKENS = 224
WARM_STEPS = 1200  # supervised steps of 32 examples
WARM_LR = 3e-3
WARM_VERSION = "s1"  # bump when the problems, the answer's form or the warm start change
_QUESTION = re.compile(r"Start at (\d+) and add (\d+), (\d+) times?\.")


def question(start: int, addend: int, count: int) -> str:
    return f"Start at {start} and add {addend}, {count} time{'s' if count > 1 else ''}."


def parse(text: str) -> tuple[int, int, int]:
    """(start, addend, count) of a question of this family."""
    found = _QUESTION.fullmatch(text)
    if found is None:
        raise ValueError(f"sums: {text!r} is not a question of workers/sim/sums.py")
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def worked_answer(start: int, addend: int, count: int) -> str:
    """The answer the warm start is taught: one line per addition, then the box."""
    lines = [f"{i}: {start + i * addend}" for i in range(1, count + 1)]
    return "\n".join(lines) + f"\n\\boxed{{{start + count * addend}}}"


def draw_count(rng: random.Random) -> int:
    counts = range(MIN_STEPS, MAX_STEPS + 1)
    return rng.choices(counts, weights=[k ** -TAIL_EXPONENT for k in counts])[0]


def problems() -> list[tuple[str, str, bool]]:
    """(question, answer, held_out): HELD_OUT held-out problems, distinct (start, addend, count)
    triples drawn with the count's heavy tail, then TRAIN train problems drawn with the same law,
    none of them a held-out triple (a train triple may repeat: the short counts have only
    STARTS x ADDENDS triples each, and a split of distinct ones would thin the law's head)."""
    rng = random.Random(SPLIT_SEED)

    def draw() -> tuple[int, int, int]:
        return rng.randrange(STARTS), rng.randrange(1, ADDENDS + 1), draw_count(rng)

    held: dict[tuple[int, int, int], None] = {}
    while len(held) < HELD_OUT:
        held[draw()] = None
    train: list[tuple[int, int, int]] = []
    while len(train) < TRAIN:
        triple = draw()
        if triple not in held:
            train.append(triple)
    return [(question(*t), str(t[0] + t[1] * t[2]), t in held) for t in train + list(held)]


def warm_start_rows() -> list[tuple[str, str, bool]]:
    """The problems the warm start trains on: the train split's, never a held-out one."""
    return [row for row in problems() if not row[2]]


def warm_start(path: Path, *, seed: int = 0, steps: int = WARM_STEPS, lr: float = WARM_LR) -> dict[str, Any]:
    """Train the tiny LM on the train split's worked answers (never a held-out problem) and save
    it at `path` (a second call with the same path reuses it). Returns {steps, parameters,
    version, heldout_accuracy (pass@1 at temperature 1 over the held-out problems, graded by the
    box: the start), heldout_greedy_accuracy, response_tokens (percentiles of the held-out
    answers' lengths at temperature 1)}."""
    import torch

    from workers.sim.arith import _prompt_ids, prompt_tokenizers, saved_policy, sft_step
    from workers.sim.tinylm import count_parameters, new_model
    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    info_file = path / "warm_start.json"
    if info_file.exists():
        return dict(json.loads(info_file.read_text()))
    torch.set_num_threads(1)
    tokenizer = load_test_tokenizer(default_tokenizer_path())
    eos = tokenizer.eos_token_id
    model = new_model(len(tokenizer), seed=seed, eos_id=eos)
    examples = []  # (token ids, which are trained): both ways a client tokenizes the prompt
    for (text, _, _), client in ((row, c) for row in warm_start_rows() for c in prompt_tokenizers()):
        prompt = _prompt_ids(client, text)
        answer = list(tokenizer.encode(worked_answer(*parse(text)), add_special_tokens=False)) + [eos]
        examples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        sft_step(model, optimizer, [rng.choice(examples) for _ in range(32)], eos)
    policy = saved_policy(model, path, tokenizer, seed)
    held_out = [row for row in problems() if row[2]]
    sampled, lengths = accuracy(policy, tokenizer, held_out, temperature=1.0)
    greedy, _ = accuracy(policy, tokenizer, held_out, temperature=0.0)
    info = {"steps": steps, "parameters": count_parameters(model), "version": WARM_VERSION, "heldout_accuracy": sampled,
            "heldout_greedy_accuracy": greedy, "response_tokens": percentiles(lengths)}
    info_file.write_text(json.dumps(info))
    return info


def accuracy(policy: Any, tokenizer: Any, rows: list[tuple[str, str, bool]], *,
             temperature: float) -> tuple[float, list[int]]:
    """pass@1 of one answer per problem (the test tokenizer's prompt), graded by the last box,
    and the answers' lengths in tokens."""
    from workers.sim.arith import _BOXED, _prompt_ids
    from workers.sim.tinylm import GenRequest

    requests = [GenRequest(_prompt_ids(tokenizer, q), MAX_RESPONSE_TOKENS, temperature=temperature) for q, _, _ in rows]
    results = policy.generate(requests)
    right = 0
    for result, (_, answer, _) in zip(results, rows):
        found = _BOXED.findall(tokenizer.decode(result.ids, skip_special_tokens=True))
        right += bool(found) and found[-1] == answer
    return right / len(rows), [len(r.ids) for r in results]


def percentiles(values: list[int]) -> dict[str, float]:
    """p50, p90, p99 and max of `values` (nearest rank), and their mean."""
    ordered = sorted(values)
    if not ordered:
        return {}

    def rank(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": float(ordered[-1]),
            "mean": sum(ordered) / len(ordered)}


def warm_checkpoint() -> Path:
    """The family's warm start, built once per machine under
    ~/.cache/rollout-pipeline/tiny-sums-<version> (workers/sim/arith.py `warm_checkpoint`'s cache)."""
    from workers.sim.arith import cached_build

    return cached_build(f"tiny-sums-{WARM_VERSION}", warm_start)
