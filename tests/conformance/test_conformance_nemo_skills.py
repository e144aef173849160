"""`kind: nemo_skills` against NeMo-Skills' own code (the pinned snapshot, tests/support/conformance_support.py).

- prompts: the environment's messages are NeMo-Skills' `get_prompt(...).fill(row)` (generic/math,
  few-shot `examples_type`, a system message, a config of our own with system/user templates),
  and the runner's prompt tokens are NeMo-Skills' `fill` with the tokenizer, byte for byte;
- scoring: NeMo-Skills' math grader (what its NeMo-RL math environment runs) on right and wrong
  answers, inline and in the process pool, through a whole episode of the real runner;
- `rollout prepare` reads NeMo-Skills rows (`problem`, `expected_answer`, the row as metadata).
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, EnvConfig, parse_config
from pipeline.schema import Status, Task, decode_task_json
from producers.prepare_tasks import PrepareError, prepare_tasks
from tests.support.conformance_support import require_nemo_skills
from tests.support.env_helpers import chat_tokens, run_episodes
from workers.envs.base import EpisodeRecord
from workers.envs.nemo_skills import NemoSkillsEnvironment
from workers.envs.rewards import final_reward
from workers.sim.engine import SimConfig

pytestmark = pytest.mark.conformance

ROW = {
    "problem": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "expected_answer": "72",
    "id": "gsm8k-0",
}

OWN_CONFIG = {
    "system": "You are a careful {{grader}} of math.",  # NeMo-Skills formats only `user`
    "user": "Problem ({source}):\n{problem}\n\nAnswer in \\boxed{{}}.",
}

PROMPT_CASES = [
    ({"prompt_config": "generic/math"}, {}),
    ({"prompt_config": "generic/math", "examples_type": "gsm8k_text_with_code"}, {"examples_type": "gsm8k_text_with_code"}),
    ({"prompt_config": "generic/math", "examples_type": "math_standard_few_shot", "system_message": "Think step by step."},
     {"examples_type": "math_standard_few_shot", "system_message": "Think step by step."}),
    ({"prompt_config": "generic/general-boxed"}, {}),
    ({"prompt_config": "generic/hle", "system_message": ""}, {"system_message": ""}),
    ({"prompt_config": OWN_CONFIG}, {}),
]


def _env(options: dict, **extra) -> NemoSkillsEnvironment:
    return NemoSkillsEnvironment("skills", EnvConfig(kind="nemo_skills", options={"check_in": "inline", **options}, **extra))


def _task(row: dict = ROW) -> Task:
    return Task(id=str(row.get("id", "t")), env="skills", prompt=row["problem"], label=row["expected_answer"],
                metadata={**row, "source": "gsm8k"})


def _upstream(config, **kwargs):
    from nemo_skills.prompt.utils import get_prompt

    return get_prompt(json.loads(json.dumps(config)) if isinstance(config, dict) else config, **kwargs)


@pytest.mark.parametrize("options,upstream_kwargs", PROMPT_CASES)
async def test_prompt_messages_and_tokens_are_nemo_skills_own_fill(options, upstream_kwargs):
    require_nemo_skills("nemo_skills.prompt.utils")
    task = _task()
    session = await _env(options).start(task)
    row = dict(task.metadata)

    expected = _upstream(options["prompt_config"], **upstream_kwargs).fill(row)
    assert session.messages == expected  # the same message list, text byte-identical
    if "examples_type" in options:
        assert "Here are some examples" in session.messages[-1]["content"]
    if "system_message" in options:
        assert session.messages[0] == {"role": "system", "content": options["system_message"]}

    # The runner tokenizes the messages once with the chat template: exactly NeMo-Skills' own
    # `fill` with that tokenizer (a string), encoded without extra special tokens.
    chat = chat_tokens()
    text = _upstream(options["prompt_config"], tokenizer=chat.tokenizer, **upstream_kwargs).fill(row)
    assert isinstance(text, str)
    assert chat.prompt_ids(session.messages, session.tools) == chat.tokenizer.encode(text, add_special_tokens=False)
    assert chat.tokenizer.decode(chat.prompt_ids(session.messages, None)) == text


GRADE_CASES = [
    # (gold, the model's answer, NeMo-Skills' math grader says correct?)
    ("72", "In May she sold 24, so 48 + 24 = \\boxed{72}.", True),
    ("\\frac{1}{2}", "The probability is \\boxed{0.5}", True),
    ("2\\sqrt{2}", "The diagonal is \\boxed{\\sqrt{8}}.", True),
    ("B", "The right option is \\boxed{B}", True),
    ("72", "So she sold \\boxed{96} clips.", False),
    ("72", "I do not know.", False),
]


async def _grade(env: NemoSkillsEnvironment, gold: str, answer: str):
    row = {**ROW, "expected_answer": gold}
    task = _task(row)
    session = await env.start(task)
    messages = session.messages + [{"role": "assistant", "content": answer}]
    record = EpisodeRecord(task=task, messages=messages, response_text=answer, status=Status.COMPLETED, turns=1)
    verification = await session.verify(record)
    return verification, final_reward(env.config, verification, finished=False)


@pytest.mark.parametrize("check_in", ["inline", "process"])
async def test_math_scoring_is_nemo_skills_grader(check_in):
    ns = require_nemo_skills("nemo_skills.evaluation.math_grader")
    grader = ns.modules["nemo_skills.evaluation.math_grader"]
    env = NemoSkillsEnvironment("skills", EnvConfig(kind="nemo_skills", options={"check_in": check_in, "processes": 1}))
    try:
        for gold, answer, correct in GRADE_CASES:
            upstream = float(grader.math_equal(gold, grader.extract_answer(answer)))
            assert upstream == (1.0 if correct else 0.0), (gold, answer)  # the cases mean what they say
            verification, reward = await _grade(env, gold, answer)
            assert reward == upstream, (gold, answer)
            assert verification.components["correct"] is correct
            assert verification.components["gold"] == gold
            assert verification.components["answer"] == grader.extract_answer(answer)
    finally:
        await env.aclose()


async def test_whole_episode_through_the_runner_scores_right_and_wrong():
    require_nemo_skills("nemo_skills.prompt.utils", "nemo_skills.evaluation.math_grader")
    env = _env({"prompt_config": "generic/math"})
    task = _task()
    # The simulator answers "... Answer: X" to the last user message (here NeMo-Skills' rendered
    # one); told its answer, it is right with probability `accuracy`.
    question = _upstream("generic/math").fill(dict(task.metadata))[-1]["content"].strip()
    right = await run_episodes(env, task, n=2, sim=SimConfig(accuracy=1.0, tool_use=0.0, answers={question: "\\boxed{72}"}))
    wrong = await run_episodes(env, task, n=2, sim=SimConfig(accuracy=0.0, tool_use=0.0, answers={question: "\\boxed{72}"}))
    for sample in right + wrong:
        assert sample.status == Status.COMPLETED, sample.metadata
        prompt = chat_tokens().prompt_ids(_upstream("generic/math").fill(dict(task.metadata)), None)
        assert sample.token_array()[: len(prompt)].tolist() == prompt  # the prompt is NeMo-Skills' rendering
    rewards_right = [s.reward for s in right]
    rewards_wrong = [s.reward for s in wrong]
    assert rewards_wrong == [0.0, 0.0]
    assert all(s.reward_components["gold"] == "72" for s in right + wrong)
    assert rewards_right == [1.0, 1.0], [s.response for s in right]


def test_config_errors_name_the_key():
    require_nemo_skills("nemo_skills.prompt.utils")
    with pytest.raises(ConfigError, match=r"environments\.skills\.options\.prompt_config"):
        _env({"prompt_config": "generic/no-such-prompt"})
    with pytest.raises(ConfigError, match=r"environments\.skills\.options\.promptconfig"):
        _env({"promptconfig": "generic/math"})


async def test_a_row_without_a_template_field_fails_the_episode_not_the_worker():
    require_nemo_skills("nemo_skills.prompt.utils")
    env = _env({"prompt_config": {"user": "{problem} ({difficulty})"}})
    from workers.envs.base import EnvError

    with pytest.raises(EnvError, match="difficulty"):
        await env.start(_task())


def test_without_nemo_skills_the_error_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nemo_skills(name, *args, **kwargs):
        if name.startswith("nemo_skills"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nemo_skills)
    with pytest.raises(ConfigError, match="nemo_skills package is not importable.*PYTHONPATH"):
        _env({"prompt_config": "generic/math"})


def test_prepare_reads_nemo_skills_rows(tmp_path):
    require_nemo_skills("nemo_skills.prompt.utils")
    rows = [
        {"problem": "What is 2 + 3?", "expected_answer": 5, "subset": "easy"},
        {"problem": "What is 7 * 6?", "expected_answer": "42", "id": "q2"},
    ]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config({"environments": {"skills": {
        "kind": "nemo_skills", "options": {"prompt_config": "generic/math"},
        "dataset": {"source": "nemo_skills", "files": ["math.jsonl"]},
    }}})
    out = tmp_path / "tasks.jsonl"
    report = prepare_tasks(config, out, base_dir=tmp_path)
    assert report.written == 2
    tasks = [decode_task_json(line) for line in out.read_bytes().splitlines()]
    assert [t.prompt for t in tasks] == ["What is 2 + 3?", "What is 7 * 6?"]
    assert [t.label for t in tasks] == ["5", "42"]
    assert tasks[0].metadata == rows[0]  # the whole row: any field a template formats
    assert tasks[1].id == "q2" and tasks[0].id.startswith("skills/")

    # a row without text `problem`, and one without a gold answer, are named by file:line
    bad = [{"question": "no problem field", "expected_answer": "1"}, {"problem": "No answer here"}]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(PrepareError) as info:
        prepare_tasks(config, out, base_dir=tmp_path)
    text = str(info.value)
    assert "math.jsonl:1: field 'problem' must be non-empty text" in text
    assert "math.jsonl:2:" in text and "expected_answer" in text
