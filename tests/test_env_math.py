"""`math` environment: math-verify on real answer forms, in its process pool and inline."""

from __future__ import annotations

import sys

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


# ------------------------------------------------------------------ only a final box that can be read is graded

NEST_200 = "1"
for _ in range(200):
    NEST_200 = f"\\frac{{1}}{{{NEST_200}}}"


@pytest.mark.parametrize("answer", [
    "first \\boxed{3}, final answer \\boxed{4",  # the last box cut off (a truncated response)
    "\\boxed{3} then \\boxed 4",  # the last box without braces
    "\\fbox{3}, no: \\fbox{4",
    "The answer is 3. Final: \\boxed{",
])
async def test_an_unreadable_final_box_scores_zero_with_its_reason_never_an_earlier_box(answer):
    """Gold 3 is in an earlier box or the text: reading either would score 1.0."""
    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline"}))
    verification, reward = await _score(env, "3", answer)
    assert reward == 0.0 and verification.components["reason"] == "unreadable final box"
    assert verification.components["answer"] is None and verification.components["correct"] is False


def test_an_unreadable_final_box_is_none_for_nemo_skills_too():
    from tests.conformance_support import require_nemo_skills

    extract_answer = require_nemo_skills("nemo_skills.evaluation.math_grader").modules[
        "nemo_skills.evaluation.math_grader"].extract_answer  # the pinned snapshot
    from workers.envs.math import final_box

    for text in ("first \\boxed{3}, final answer \\boxed{4", "\\boxed{3} then \\boxed 4"):
        assert extract_answer(text) is None and final_box(text) == (True, None), text
    assert final_box("\\boxed {4}") == (True, "\\boxed {4}") and final_box("no box") == (False, None)


# ------------------------------------------------------------------ math-verify giving up is no answer


@pytest.mark.parametrize("label,answer,timeout_s,why", [
    # right, but its LaTeX parser hits the recursion limit (or math-verify's timeout first, on a busy machine)
    ("1", f"\\boxed{{{NEST_200}}}", 5, "(RecursionError|timed out after 5s)"),
    ("5", "\\boxed{10^{10^{10}}}", 1, "timed out after 1s \\(Timeout during comparison\\)"),  # sympy cannot compare it in time
], ids=["fraction-200-deep", "power-tower"])
async def test_math_verify_giving_up_is_a_failed_measurement_not_a_zero(label, answer, timeout_s, why):
    from workers.envs.base import MeasurementFailed

    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline", "parse_timeout_s": timeout_s}))
    # Python's default depth, as in a worker's checker process: an import elsewhere in the suite
    # raises the limit, and the 200-deep fraction then parses (and is graded right, 1.0)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        with pytest.raises(MeasurementFailed, match=f"math-verify gave up: .*{why}"):
            await _score(env, label, answer)
    finally:
        sys.setrecursionlimit(limit)


async def test_an_undecided_check_fails_the_episode_through_the_checker_pool_and_runner():
    """Through the worker's episode runner, the check in its process pool: the episode is failed
    with math-verify's reason (removed from the loss, counted with the failed episodes), not a 0."""
    from pipeline.config import PipelineConfig
    from pipeline.schema import SamplingParams
    from tests.env_helpers import chat_tokens
    from workers.engine import EngineClient
    from workers.episode import EpisodeRunner, EpisodeSettings
    from workers.sim.engine import SimConfig, serve_sim_engine

    question = "How large is it?"
    sim = SimConfig(accuracy=1.0, length_mu=1.0, answers={question: "\\boxed{10^{10^{10}}}"})
    env = MathEnvironment("m", EnvConfig(kind="math", options={"processes": 1, "parse_timeout_s": 1}))
    task = Task(id="big", env="m", prompt=question, label="5")
    try:
        async with serve_sim_engine(sim) as engine, EngineClient(engine.url, max_retries=1) as client:
            settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=256))
            sample = await EpisodeRunner(client, chat_tokens(), env, settings, run="t").run(task, "big/0", 0)
    finally:
        await env.aclose()
    assert sample.status is Status.FAILED and sample.reward == 0.0, sample.metadata
    assert "math-verify gave up: timed out after 1s" in sample.metadata["error"]
    assert "10^{10^{10}}" in sample.response


async def test_nemo_skills_math_grading_that_math_verify_gave_up_on_is_a_failed_measurement():
    """NeMo-Skills' own `math_equal` says False when math-verify's timeout stopped it (one warning
    line, no exception): the `nemo_skills` kind fails the measurement instead of training that 0."""
    from tests.conformance_support import require_nemo_skills
    from workers.envs.base import MeasurementFailed
    from workers.envs.nemo_skills import NemoSkillsEnvironment

    require_nemo_skills("nemo_skills.evaluation.math_grader")
    answer = "So it is \\boxed{10^{10^{10}}}."
    env = NemoSkillsEnvironment("skills", EnvConfig(kind="nemo_skills", options={"check_in": "inline"}))
    task = Task(id="t", env="skills", prompt="How large?", label="5")
    session = await env.start(task)
    record = EpisodeRecord(task=task, messages=[*session.messages, {"role": "assistant", "content": answer}],
                           response_text=answer, status=Status.COMPLETED, turns=1)
    with pytest.raises(MeasurementFailed, match=r"math-verify gave up: Timeout during comparison"):
        await session.verify(record)
    wrong = EpisodeRecord(task=task, messages=[*session.messages, {"role": "assistant", "content": "\\boxed{4}"}],
                          response_text="\\boxed{4}", status=Status.COMPLETED, turns=1)
    assert (await session.verify(wrong)).reward == 0.0  # a decided 0 stays a 0
