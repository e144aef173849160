"""`math` environment: math-verify on real answer forms, in its process pool and inline."""

from __future__ import annotations

import re
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
    """A checker that died is a failed measurement (removed from the loss), not an outage."""
    from workers.envs.base import MeasurementFailed
    from workers.envs.checkers import CheckerPool

    pool = CheckerPool(1, "math env 'm'")
    try:
        with pytest.raises(MeasurementFailed, match="math env 'm': checker process died"):
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
    from tests.support.conformance_support import require_nemo_skills

    extract_answer = require_nemo_skills("nemo_skills.evaluation.math_grader").modules[
        "nemo_skills.evaluation.math_grader"].extract_answer  # the pinned snapshot
    from workers.envs.math import final_box

    for text in ("first \\boxed{3}, final answer \\boxed{4", "\\boxed{3} then \\boxed 4"):
        assert extract_answer(text) is None and final_box(text) == (True, None), text
    assert final_box("\\boxed {4}") == (True, "\\boxed {4}") and final_box("no box") == (False, None)


# ------------------------------------------------------------------ what math-verify does not decide (issue 39 item 13)

async def _at_default_depth(fn):
    """Python's default depth, as in a worker's checker process: an import elsewhere in the suite
    raises the limit, and the 200-deep fraction then parses (and is graded right, 1.0). Awaited
    inside: the grading runs when the coroutine does, not when it is made."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        return await fn()
    finally:
        sys.setrecursionlimit(limit)


GIVE_UPS = [
    # (gold, answer, math-verify's timeout, its reason): right or wrong, the answer exhausts its budget
    ("1", f"\\boxed{{{NEST_200}}}", 5, "(RecursionError|timed out after 5s)"),
    ("1", f"So the answer is ${NEST_200}$.", 5, "(RecursionError|timed out after 5s)"),  # not boxed: the same rule
    ("5", "So it is \\boxed{10^{10^{10}}}.", 1, "timed out after 1s \\(Timeout during comparison\\)"),
]


@pytest.mark.parametrize("label,answer,timeout_s,why", GIVE_UPS, ids=["fraction-boxed", "fraction-plain", "power-tower"])
async def test_an_answer_math_verify_gives_up_on_scores_zero_with_its_reason_boxed_or_not(label, answer, timeout_s, why):
    """`on_undecided: zero` (the default): a 0 with math-verify's reason and `undecided`, never
    removed (a removed sample has no negative advantage: a verifier-timeout reward hack). The text
    math-verify was given (the final box, else the response) stays in the components, capped."""
    from workers.envs.math import final_box
    from workers.envs.rewards import MAX_COMPONENT_CHARS, capped

    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline", "parse_timeout_s": timeout_s}))
    verification, reward = await _at_default_depth(lambda: _score(env, label, answer))
    assert reward == 0.0 and verification.components["undecided"] is True, verification
    assert re.search(f"math-verify gave up: .*{why}", verification.components["reason"]), verification.components
    given = final_box(answer)[1] or answer
    assert verification.components["answer"] == capped(given)
    assert len(verification.components["answer"]) <= MAX_COMPONENT_CHARS + len("...")


async def test_on_undecided_remove_makes_it_a_failed_measurement():
    from workers.envs.base import MeasurementFailed, Undecided

    config = EnvConfig(kind="math", on_undecided="remove", options={"check_in": "inline", "parse_timeout_s": 5})
    env = MathEnvironment("m", config)
    with pytest.raises(Undecided, match="math-verify gave up") as caught:
        await _at_default_depth(lambda: _score(env, "1", f"${NEST_200}$"))
    assert isinstance(caught.value, MeasurementFailed)
    assert (await _score(env, "1", "\\boxed{1}"))[1] == 1.0  # a decided answer is graded as ever


async def test_a_gold_math_verify_cannot_read_is_a_task_error_at_prepare_and_in_the_check():
    """A gold math-verify reads nothing from would score every sample of its task 0: `rollout
    prepare`'s check names it; a task that slipped through fails each check (`TaskUngradable`,
    removed), never a trained 0. A price (`\\$18.90`) is a gold it reads."""
    from pipeline.config import parse_config
    from workers.envs.base import TaskUngradable
    from workers.validate import task_problem

    env = MathEnvironment("m", EnvConfig(kind="math", options={"check_in": "inline"}))
    with pytest.raises(TaskUngradable, match="reads no expression from the gold answer '\\[\\[\\['"):
        await _score(env, "[[[", "\\boxed{2}")
    assert (await _score(env, "\\$18.90", "It costs \\boxed{18.90} dollars."))[1] == 1.0
    config = parse_config({"environments": {"m": {"kind": "math"}}})
    checks: dict = {}
    bad = task_problem(Task(id="t", env="m", prompt="?", label="[[["), config, checks)
    assert bad is not None and "task 't' (m, kind math): math-verify reads no expression" in bad
    assert task_problem(Task(id="t", env="m", prompt="?", label="[[["), config, checks, gold=False) is None
    for gold in ("\\$18.90", "\\frac{1}{2}", "72", "Natalia sold 48 clips. #### 72", "\\text{(A)}", "x \\in [2, 5)"):
        assert task_problem(Task(id="t", env="m", prompt="?", label=gold), config, checks) is None, gold


async def test_undecided_and_failed_measurements_through_the_runner_and_the_trainers_batch_metrics():
    """Through the worker's episode runner (the check in its process pool): an answer math-verify
    gives up on completes with reward 0, `undecided` and its reason (not removed); under
    `on_undecided: remove` it fails with the measurement flagged. The trainer's batch metrics
    (`pipeline.slime.data_source.BatchStats`) count both apart per environment, and `reward_mean/<env>` is over
    the samples not failed: a failed sample's 0 is no reward (issue 39 item 17)."""
    from pipeline.config import PipelineConfig
    from pipeline.schema import MEASUREMENT_FAILED, SampleGroup, SamplingParams
    from pipeline.slime.data_source import METRIC_PREFIX, BatchStats
    from tests.support.env_helpers import chat_tokens
    from workers.engine import EngineClient
    from workers.episode import EpisodeRunner, EpisodeSettings
    from workers.sim.engine import SimConfig, serve_sim_engine

    big, easy = "How large is it?", "What is 2 + 2?"
    sim = SimConfig(accuracy=1.0, length_mu=1.0, answers={big: "\\boxed{10^{10^{10}}}", easy: "\\boxed{4}"})
    env = MathEnvironment("m", EnvConfig(kind="math", options={"processes": 1, "parse_timeout_s": 1}))
    removing = MathEnvironment("m", EnvConfig(kind="math", on_undecided="remove",
                                              options={"check_in": "inline", "parse_timeout_s": 1}))
    tasks = [Task(id="big", env="m", prompt=big, label="5"), Task(id="easy", env="m", prompt=easy, label="4")]
    try:
        async with serve_sim_engine(sim) as engine, EngineClient(engine.url, max_retries=1) as client:
            settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=256))
            undecided = await EpisodeRunner(client, chat_tokens(), env, settings, run="t").run(tasks[0], "big/0", 0)
            right = await EpisodeRunner(client, chat_tokens(), env, settings, run="t").run(tasks[1], "easy/0", 0)
            removed = await EpisodeRunner(client, chat_tokens(), removing, settings, run="t").run(tasks[0], "big/1", 1)
    finally:
        await env.aclose()
    assert undecided.status is Status.COMPLETED and undecided.reward == 0.0, undecided.metadata
    assert undecided.reward_components["undecided"] is True
    assert "math-verify gave up: timed out after 1s" in undecided.reward_components["reason"]
    assert "10^{10^{10}}" in undecided.response and right.reward == 1.0
    assert undecided.reward_components["answer"] == "\\boxed{10^{10^{10}}}"  # back from the checker process
    assert removed.status is Status.FAILED and removed.reward_components == {MEASUREMENT_FAILED: True}
    assert "math-verify gave up: timed out after 1s" in removed.metadata["error"]

    stats = BatchStats()
    stats.add_group(SampleGroup(group_id="big:0", task=tasks[0], admission_version=0, n_samples=3,
                                samples=[undecided, right, removed]))
    metrics = stats.metrics(0, 0, {})
    assert metrics[f"{METRIC_PREFIX}/reward_mean/m"] == 0.5  # (0 + 1) / 2: the failed sample's 0 is out
    assert metrics[f"{METRIC_PREFIX}/undecided/m"] == 1 and metrics[f"{METRIC_PREFIX}/measurements_failed/m"] == 1
    assert metrics[f"{METRIC_PREFIX}/samples_failed"] == 1


async def test_nemo_skills_grading_follows_the_same_rule():
    """NeMo-Skills' own `math_equal` says False when math-verify's timeout stopped it (one warning
    line) or its parser hit the recursion limit (nothing said): undecided, a 0 with the reason;
    a gold it cannot read is a task error; a decided 0 stays a plain 0."""
    from tests.support.conformance_support import require_nemo_skills
    from workers.envs.base import TaskUngradable
    from workers.envs.nemo_skills import NemoSkillsEnvironment
    from workers.envs.rewards import capped

    require_nemo_skills("nemo_skills.evaluation.math_grader")
    env = NemoSkillsEnvironment("skills", EnvConfig(kind="nemo_skills", options={"check_in": "inline"}))

    async def verify(label: str, answer: str):
        task = Task(id="t", env="skills", prompt="How large?", label=label)
        session = await env.start(task)
        record = EpisodeRecord(task=task, messages=[*session.messages, {"role": "assistant", "content": answer}],
                               response_text=answer, status=Status.COMPLETED, turns=1)
        return await session.verify(record)

    timed_out = await verify("5", "So it is \\boxed{10^{10^{10}}}.")
    assert timed_out.reward == 0.0 and timed_out.components["undecided"] is True
    assert timed_out.components["reason"] == "math-verify gave up: Timeout during comparison"
    assert timed_out.components["answer"] == "10^{10^{10}}"  # what NeMo-Skills' extract_answer read
    deep = await _at_default_depth(lambda: verify("1", f"\\boxed{{{NEST_200}}}"))
    assert deep.reward == 0.0 and "math-verify gave up: RecursionError" in deep.components["reason"]
    assert deep.components["answer"] == capped(NEST_200)
    with pytest.raises(TaskUngradable, match="reads no expression from the gold answer"):
        await verify("[[[", "\\boxed{2}")
    wrong = await verify("5", "\\boxed{4}")
    assert wrong.reward == 0.0 and "undecided" not in wrong.components  # a decided 0 stays a 0
    assert (await verify("Evelyn", "\\boxed{Evelyn}")).reward == 1.0  # text NeMo-Skills compares literally


# ------------------------------------------------------------------ where the box is read otherwise than NeMo-Skills reads it

# (response, what this kind reads, what NeMo-Skills' extract_answer reads): each said in math.py's docstring
BOX_DIFFERENCES = [
    ("\\fbox{3}", "\\fbox{3}", None),
    ("\\boxed {4}", "\\boxed {4}", None),
    ("\\boxed{3} hmm \\fbox{4}", "\\fbox{4}", "3"),
]


def test_the_box_is_read_as_nemo_skills_reads_it_except_where_the_docstring_says():
    from tests.support.conformance_support import require_nemo_skills
    from workers.envs import math as math_env

    extract_answer = require_nemo_skills("nemo_skills.evaluation.math_grader").modules[
        "nemo_skills.evaluation.math_grader"].extract_answer  # the pinned snapshot
    doc = " ".join((math_env.__doc__ or "").split())
    for response, ours, theirs in BOX_DIFFERENCES:
        assert math_env.last_boxed(response) == ours and extract_answer(response) == theirs, response
        assert f"`{response}`" in doc, f"math.py's docstring does not say how {response!r} is read"
    for response in ("So \\boxed{42}.", "\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\boxed{3", "\\boxed 4", "no box"):
        box = math_env.last_boxed(response)
        assert (box[len("\\boxed{"):-1] if box else None) == extract_answer(response), response  # the same elsewhere
