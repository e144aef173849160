"""Issue 27 item 2: the silences and misleading figures a new user meets in the first hour.
Each test here fails on fe89cd3."""

from __future__ import annotations

import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from tests.conformance_support import require_nemo_skills
from workers.envs.base import EpisodeRecord
from workers.envs.math import MathEnvironment, last_boxed

# ------------------------------------------------------------------ math: the last \boxed{} is the answer


async def _math_reward(label: str, answer: str) -> tuple[float, object]:
    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline"}))
    task = Task(id="m1", env="m", prompt="Solve it.", label=label)
    session = await env.start(task)
    try:
        messages = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": answer}]
        verification = await session.verify(EpisodeRecord(task=task, messages=messages, response_text=answer,
                                                           status=Status.COMPLETED, turns=1))
    finally:
        await session.close()
        await env.aclose()
    return verification.reward, verification.components["answer"]


@pytest.mark.parametrize("label,answer,reward", [
    ("4", "First \\boxed{3}. Wait, I dropped a carry: the final answer is \\boxed{4}.", 1.0),
    ("3", "First \\boxed{3}. Wait, I dropped a carry: the final answer is \\boxed{4}.", 0.0),
    ("\\frac{1}{2}", "maybe \\boxed{\\frac{1}{3}}, no: \\boxed{\\frac{1}{2}}", 1.0),
    ("(1, 2)", "one box holds both: \\boxed{(1, 2)}", 1.0),
])
async def test_math_scores_the_last_boxed_answer(label, answer, reward):
    got, extracted = await _math_reward(label, answer)
    assert got == reward, (label, answer, extracted)


def test_last_boxed_reads_as_nemo_skills_does():
    extract_answer = require_nemo_skills("nemo_skills.evaluation.math_grader").modules[
        "nemo_skills.evaluation.math_grader"].extract_answer  # the pinned snapshot

    for text in ("a \\boxed{3} b \\boxed{\\frac{1}{2}} c", "\\boxed{{1,2}}", "no box"):
        ours = last_boxed(text)
        theirs = extract_answer(text)
        assert (ours is None) == (theirs is None), text
        if ours is not None:
            assert theirs in ours, (text, ours, theirs)
    assert last_boxed("cut off \\boxed{4") is None
