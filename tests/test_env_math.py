"""`math` environment: math-verify on real answer forms, in its process pool and inline."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, EpisodeRecord
from workers.envs.math import MathEnvironment
from workers.envs.rewards import final_reward


def _episode(task: Task, answer: str, status: Status = Status.COMPLETED) -> EpisodeRecord:
    messages = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": answer}]
    return EpisodeRecord(task=task, messages=messages, response_text=answer, status=status, turns=1)


async def _score(env: MathEnvironment, label: str, answer: str, status: Status = Status.COMPLETED):
    task = Task(id="m1", env="math", prompt="Solve it.", label=label)
    session = await env.start(task)
    try:
        verification = await session.verify(_episode(task, answer, status))
    finally:
        await session.close()
    return verification, final_reward(env.config, verification, finished=False)


CASES = [
    # (gold label, model's final message, correct?)
    ("\\frac{1}{2}", "Adding the halves... so the answer is $\\boxed{\\frac12}$.", True),
    ("0.5", "Therefore the probability is \\boxed{\\frac{1}{2}}", True),
    ("2\\sqrt{2}", "The diagonal is \\boxed{\\sqrt{8}}.", True),
    ("42", "We get 6 * 7. The final answer is 42", True),
    ("(1, 2)", "The intersection point is \\boxed{(1,2)}", True),
    ("x^2 + 2x + 1", "Expanding: $\\boxed{(x+1)^2}$", True),
    ("3", "I think the answer is \\boxed{4}", False),
    ("7", "I am not sure.", False),
]


async def test_math_verify_real_answer_forms_in_the_process_pool():
    env = MathEnvironment("math", EnvConfig(kind="math", options={"processes": 1}))
    try:
        for label, answer, correct in CASES:
            verification, reward = await _score(env, label, answer)
            assert reward == (1.0 if correct else 0.0), (label, answer)
            assert verification.components["correct"] is correct
            assert verification.components["gold"] == label
            assert bool(verification.components["answer"]) or not correct
    finally:
        await env.aclose()


async def test_boxed_only_ignores_plain_answers():
    env = MathEnvironment("m", EnvConfig(kind="math", options={"answer": "boxed", "check_in": "inline"}))
    _, plain = await _score(env, "42", "The final answer is 42")
    _, boxed = await _score(env, "42", "The final answer is \\boxed{42}")
    assert (plain, boxed) == (0.0, 1.0)


async def test_only_the_last_assistant_message_counts():
    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline"}))
    task = Task(id="m2", env="math", prompt="2+2?", label="4")
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "maybe \\boxed{4}", "tool_calls": []},
        {"role": "tool", "content": "no tools"},
        {"role": "assistant", "content": "final: \\boxed{5}"},
    ]
    session = await env.start(task)
    verification = await session.verify(EpisodeRecord(task=task, messages=messages, response_text="", turns=2))
    assert verification.reward == 0.0 and verification.components["answer"] == "5"


async def test_truncated_episode_gets_nonterminal_reward_and_clamp():
    config = EnvConfig(kind="math", nonterminal_reward=-1.0, min_reward=-0.5, options={"check_in": "inline"})
    env = MathEnvironment("m", config)
    _, truncated = await _score(env, "4", "I was about to say \\boxed{4", Status.TRUNCATED)
    _, completed = await _score(env, "4", "\\boxed{4}", Status.COMPLETED)
    assert truncated == -0.5  # [0, -1] summed, clamped at min_reward
    assert completed == 1.0


async def test_task_without_label_fails_the_episode_and_bad_options_name_the_key():
    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline"}))
    with pytest.raises(EnvError, match="no label"):
        await env.start(Task(id="nolabel", env="m", prompt="?"))
    with pytest.raises(ConfigError, match=r"environments\.m\.options\.answr"):
        MathEnvironment("m", EnvConfig(kind="math", options={"answr": "boxed"}))


def _die() -> None:  # a checker killed mid-check (OOM, a parser's C stack)
    import os

    os._exit(1)


async def test_a_checker_that_dies_fails_that_check_and_the_next_one_runs():
    from workers.envs.base import EnvError
    from workers.envs.checkers import CheckerPool

    pool = CheckerPool(1, "math env 'm'")
    try:
        with pytest.raises(EnvError, match="math env 'm': checker process died"):
            await pool.run(_die)
        assert await pool.run(pow, 2, 10) == 1024  # a fresh pool
    finally:
        pool.close()
