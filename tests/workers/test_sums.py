"""The `sums` task family (workers/sim/sums.py): the tiny policy's answers whose length is set by
the problem, with a heavy tail; held-out problems disjoint from every train and warm-start item;
the math environment accepts the worked answer; the budget holds the longest one."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

from workers.sim import sums


def _tokenizer():
    from workers.sim.tokenizer import default_tokenizer_path, load_test_tokenizer

    return load_test_tokenizer(default_tokenizer_path())


def test_answer_length_is_set_by_the_problem_with_a_heavy_tail():
    """Each addition is one more line, so the worked answer grows with the count; the counts are
    mostly short with a long tail (the longest answers several times the median)."""
    tokenizer = _tokenizer()

    def length(count: int) -> int:
        return len(tokenizer.encode(sums.worked_answer(57, 8, count), add_special_tokens=False))

    lengths = [length(k) for k in range(sums.MIN_STEPS, sums.MAX_STEPS + 1)]
    assert all(a < b for a, b in zip(lengths, lengths[1:]))
    counts = Counter(sums.parse(q)[2] for q, _, _ in sums.problems())
    total = sum(counts.values())
    assert counts[2] / total > 0.3  # the head: most answers are two or three lines
    assert sum(n for k, n in counts.items() if k >= 10) / total > 0.03  # the tail
    assert max(counts) >= 25
    answer_tokens = sorted(len(tokenizer.encode(sums.worked_answer(*sums.parse(q)), add_special_tokens=False))
                           for q, _, _ in sums.problems())
    stats = sums.percentiles(answer_tokens)
    assert stats["max"] >= 4 * stats["p50"] and stats["p99"] >= 3 * stats["p50"]


def test_held_out_problems_are_disjoint_from_train_and_warm_start_items(tmp_path):
    """At least 200 distinct held-out problems; none is a train problem or in the warm start's
    data (the train split); the task files `rollout prepare` writes agree."""
    from scripts.tiny_tasks import prepare_sums_tasks

    rows = sums.problems()
    held = [q for q, _, h in rows if h]
    train = {q for q, _, h in rows if not h}
    assert len(set(held)) == len(held) >= sums.HELD_OUT >= 200
    assert train.isdisjoint(held)
    assert {q for q, _, _ in sums.warm_start_rows()} == train
    tasks, heldout = prepare_sums_tasks(tmp_path)

    def questions(path):
        out = set()
        for line in path.read_text().splitlines():
            prompt = json.loads(line)["prompt"]
            out.add(prompt if isinstance(prompt, str) else prompt[-1]["content"])
        return out

    assert questions(heldout) == set(held) and questions(tasks) == train
    assert {json.loads(line)["env"] for line in tasks.read_text().splitlines()} == {sums.ENV}


def test_the_math_environment_accepts_the_worked_answer():
    """The worked answer (its lines, then the box) scores 1 for its own label and 0 for another,
    through the math environment's check and the oracle's grader."""
    from workers.envs.math import check_answer
    from workers.sim.arith import grader

    tokenizer = _tokenizer()
    grade = grader()
    for question, label, _ in sums.problems()[:5] + sums.problems()[-5:]:
        answer = sums.worked_answer(*sums.parse(question))
        assert check_answer(answer, label, "boxed", timeout_s=5).reward == 1.0
        assert check_answer(answer, str(int(label) + 1), "boxed", timeout_s=5).reward == 0.0
        ids = list(tokenizer.encode(answer, add_special_tokens=False))
        sample = SimpleNamespace(tokens=[1, 2, 3] + ids, response_length=len(ids), label=label,
                                 metadata={"source_name": sums.ENV}, index=0)
        assert grade(sample) == 1.0


def test_the_budget_holds_the_longest_worked_answer_and_its_prompt():
    """max_response_tokens covers every worked answer and its end token, and with the longest
    prompt stays inside the tiny model's positions."""
    from workers.sim.arith import _prompt_ids
    from workers.sim.tinylm import TINY_SHAPE

    tokenizer = _tokenizer()
    longest = max(len(tokenizer.encode(sums.worked_answer(*sums.parse(q)), add_special_tokens=False)) + 1
                  for q, _, _ in sums.problems())
    prompt = max(len(_prompt_ids(tokenizer, q)) for q, _, _ in sums.problems())
    assert longest <= sums.MAX_RESPONSE_TOKENS
    assert prompt + sums.MAX_RESPONSE_TOKENS <= TINY_SHAPE["max_position_embeddings"]
