"""NeMo-Skills' NeMo-RL math environment (`nemo_skills/training/nemo_rl/environments/
math_environment.py`, the pinned snapshot, unmodified) run through `kind: nemo_rl`: the class
loaded by its dotted path, its Ray verify workers started by it on a local Ray (started here by
the environment, `start_ray`), in-process and as a Ray actor (`ray: true`). Episodes of the
episode runner answer right and wrong; the rewards are its own (1 / 0), the answers it
extracted land in the components, and its `global_post_process_and_metrics` runs once per
group (accuracy, pass@samples_per_prompt, ...). The `nemo_skills` kind's in-process grader
gives the same rewards on the same answers.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import EnvConfig, PipelineConfig
from pipeline.schema import SamplingParams, Status, Task
from tests.support.conformance_support import require_nemo_rl, require_nemo_skills
from tests.support.env_helpers import ScriptedEngine, chat_tokens
from workers.engine import Generation
from workers.envs.nemo_skills import NemoSkillsEnvironment
from workers.envs.plugins import NemoRLEnvironment
from workers.episode import EpisodeRunner, EpisodeSettings

pytestmark = pytest.mark.conformance

MODULE = "nemo_skills.training.nemo_rl.environments.math_environment"
ANSWERS = {0: "So 6 * 7 = 42, and the answer is \\boxed{42}.", 1: "I think it is \\boxed{41}."}


class Answerer(ScriptedEngine):
    """The model: episode i of a group answers ANSWERS[i] (right, then wrong), ending with EOS."""

    async def generate(self, tokens, sampling, *, rid, routing_key, due_order=None):
        chat = chat_tokens()
        ids = chat.encode(ANSWERS[int(routing_key.rsplit("/", 1)[1]) % 2]) + [chat.eos_id]
        return Generation(output_ids=ids, log_probs=[-0.5] * len(ids), finish="stop", finish_message="",
                          weight_version="1", text="", cached_tokens=0, latency_s=0.0)


@pytest.fixture(scope="module")
def math_env_module():
    require_nemo_rl("nemo_rl.environments.utils")  # needs hydra-core (the conformance extra)
    module = require_nemo_skills(MODULE).modules[MODULE]
    ray = pytest.importorskip("ray")
    started = ray.is_initialized()
    yield module
    if not started and ray.is_initialized():
        ray.shutdown()


def _task(label: str | None = "42") -> Task:
    return Task(id="q1", env="skills_math", prompt="What is 6 * 7? Put the answer in \\boxed{}.", label=label)


def _env(**options) -> NemoRLEnvironment:
    base = {"cls": f"{MODULE}:MathEnvironment", "config": {"num_workers": 1, "stop_strings": None},
            "label_key": "expected_answer", "start_ray": True, "ray_init": {"num_cpus": 2}}
    return NemoRLEnvironment("skills_math", EnvConfig(kind="nemo_rl", options={**base, **options}))


async def _group(env, n: int = 2, task: Task | None = None):
    settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=64))
    runner = EpisodeRunner(Answerer(), chat_tokens(), env, settings)
    task = task or _task()  # one Task object for the group's episodes, as a worker's job runs them
    return await asyncio.gather(*(runner.run(task, f"q1:0/{i}", sample_index=i) for i in range(n)))


def _check(samples):
    right, wrong = samples
    assert right.status is Status.COMPLETED and wrong.status is Status.COMPLETED
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.reward_components["answer"] == "42" and wrong.reward_components["answer"] == "41"
    assert right.reward_components["observation"] == "Environment: correct"
    assert wrong.reward_components["observation"] == "Environment: incorrect"
    for sample in samples:  # the group's metrics, from the environment's own method
        c = sample.reward_components
        assert c["nemo_rl/group_size"] == 2 and c["nemo_rl/num_problems_in_batch"] == 2
        assert c["nemo_rl/accuracy"] == 0.5
        assert c["nemo_rl/pass@samples_per_prompt"] == 1.0
        assert c["nemo_rl/fraction_of_samples_properly_ended"] == 1.0
        assert "nemo_rl/generation_lengths" not in c  # token lengths are not the environment's to see


async def test_math_environment_in_process_scores_right_and_wrong(math_env_module):
    env = _env()
    try:
        _check(await _group(env))
        assert env.metrics.groups == 1 and env.metrics.failures == 0
    finally:
        await env.aclose()


async def test_math_environment_as_a_ray_actor(math_env_module):
    env = _env(ray=True, start_ray=False)
    try:
        _check(await _group(env))
    finally:
        await env.aclose()


async def test_nemo_skills_kind_grades_the_same_answers(math_env_module):
    env = NemoSkillsEnvironment("skills_math", EnvConfig(kind="nemo_skills", options={"check_in": "inline"}))
    settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=64))
    runner = EpisodeRunner(Answerer(), chat_tokens(), env, settings)
    task = _task()
    samples = await asyncio.gather(*(runner.run(task, f"q1:0/{i}", sample_index=i) for i in range(2)))
    await env.aclose()
    assert [s.reward for s in samples] == [1.0, 0.0]


async def test_a_task_without_the_answer_fails_its_episode_with_the_reason(math_env_module):
    env = _env()
    try:
        [sample] = await _group(env, n=1, task=_task(label=None))
    finally:
        await env.aclose()
    assert sample.status is Status.FAILED and sample.reward == 0.0
    assert "task 'q1' has no label and no metadata.expected_answer" in sample.metadata["error"]
