"""slime in-process mode (workers/inslime.py): `workers.inslime.generate` and
`workers.inslime.reward` driven through slime's REAL `generate_and_rm` / `generate_and_rm_group`
(the pinned snapshot, tests/support/conformance_support.py) against the engine path slime runs: smg as
slime's router -> SGLang 0.5.23's own HTTP front -> the simulator as scheduler
(tests/support/engine_stack.py, one stack for the module, reconfigured per test), with the test tokenizer
as `--hf-checkpoint`. Every /generate body of these episodes is admitted or refused by SGLang's
own server.

What is checked on every sample slime gets back: prompt tokens = the chat template's rendering
of the environment's messages and tools; every model token and its log-prob bit-exact what the
engine produced for that context (the simulator's plan is deterministic per routing key and
context); template tokens (tool output, turn markers) masked with log-prob 0.0; status; reward
= the environment's check of the final answer; metadata (turns, tool calls, conversation);
slime's own length validation. Plus: `--group-rm` calls the reward function once per group with
the list; slime's own generate scored by our environments; a failed episode is FAILED, removed,
reward 0 and still well-formed; how samples name environments, where the config comes from,
and how slime's sampling params are translated (no slime needed for those).
"""

from __future__ import annotations

import asyncio
import uuid
from argparse import Namespace
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.schema import SamplingParams
from tests.support.conformance_support import require_slime
from tests.support.engine_stack import START_TIMEOUT_S, shared_stack

N = 4
QUESTIONS = [("What is 12 * 7?", "84"), ("What is 345 + 678?", "1023"), ("What is 81 / 9?", "9")]
CALLS: list[object] = []  # what `recording_reward` was called with (the --group-rm test)


# a test's timeout includes the module's stack start (engine_stack.START_TIMEOUT_S at most)
STACK_TIMEOUT = pytest.mark.timeout(START_TIMEOUT_S + 120)


# ------------------------------------------------------------------ helpers

@pytest.fixture
def stack():
    """smg -> two SGLang fronts -> simulators (the session's stack); each test configures the
    simulators first (`twin`)."""
    return shared_stack()


def twin(stack, **fields):
    """A simulator configured as the stack's engine now is (`stack.configure(**fields)`), for
    recomputing the engine's plan of a context in the test (`.plan(input_ids, routing_key)`)."""
    import functools

    from workers.sim.config import SimConfig
    from workers.sim.scripted import ScriptedPolicy
    from workers.sim.tokenizer import load_test_tokenizer

    stack.configure(**fields)
    script = ScriptedPolicy(load_test_tokenizer())
    return SimpleNamespace(plan=functools.partial(script.plan, config=SimConfig(**fields)))


@pytest.fixture
def slime():
    ns = require_slime("slime.rollout.sglang_rollout", "slime.utils.http_utils")
    rollout = ns.modules["slime.rollout.sglang_rollout"]
    rollout.GenerateState.clear_instances()  # slime's singleton: one per test, on its own loop
    yield ns
    rollout.GenerateState.clear_instances()


def _config(tmp_path, environments=None, **sections) -> str:
    data = {
        "rollout": {"max_turns": 4, "sampling": {"temperature": 1.0, "top_p": 1.0}},
        "environments": environments or {"calc": {"kind": "calculator"}, "arith": {"kind": "arithmetic"}},
        **sections,
    }
    path = tmp_path / f"pipeline-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _args(sim_url: str, config_path: str, **extra) -> Namespace:
    """What slime's argument parser hands generate_and_rm (the attributes it and GenerateState read)."""
    from workers.sim.tokenizer import default_tokenizer_path

    url = urlsplit(sim_url)
    base = dict(
        hf_checkpoint=default_tokenizer_path(), sglang_router_ip=url.hostname, sglang_router_port=url.port,
        sglang_server_concurrency=8, rollout_num_engines=1, sglang_dp_size=1, use_distributed_post=False,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=512,
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        rollout_max_context_len=None, n_samples_per_prompt=N, partial_rollout=False,
        mask_offpolicy_in_partial_rollout=False, group_rm=False, ci_test=False, rm_type=None,
        custom_generate_function_path="workers.inslime.generate", custom_rm_path="workers.inslime.reward",
        rollout_sample_hook_path=None, use_rollout_routing_replay=False, apply_chat_template=False,
        sglang_enable_deterministic_inference=False, router_policy=None, custom_config_path=config_path,
    )
    base.update(extra)
    return Namespace(**base)


def _samples(slime, question: str, label: str, n: int = N, env: str | None = "calc", index0: int = 0) -> list:
    meta = {"env": env} if env else {}
    return [
        slime.Sample(index=index0 + j, group_index=index0 // n, prompt=question, label=label,
                     metadata=dict(meta), session_id=str(uuid.uuid4()))
        for j in range(n)
    ]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def _check_sample(slime, sample, sim, stats: dict, *, label: str, tools: list) -> None:
    """The contract slime relies on, checked against what the engine actually produced."""
    from workers.chat import ChatTokens
    from workers.envs.local import extract_answer, numbers_match
    from workers.sim.tokenizer import load_test_tokenizer

    chat = ChatTokens(load_test_tokenizer())
    Status = slime.Sample.Status
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.metadata.get("error")
    assert sample.remove_sample is False
    prompt_ids = chat.prompt_ids([{"role": "user", "content": sample.prompt}], tools)
    P = len(prompt_ids)
    assert sample.tokens[:P] == prompt_ids
    assert len(sample.tokens) == P + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
    sample._validate_response_metadata_lengths()  # slime's own check
    # model tokens and log-probs: bit-exact what the engine planned for that context and routing key
    keys = [k for k in stats["routing_keys"] if k.startswith(f"slime-{sample.session_id}-")]
    assert len(keys) == 1, keys
    model_runs = 0
    for value, start, end in _runs(sample.loss_mask):
        if value == 1:
            model_runs += 1
            ids, lps, done = sim.plan(sample.tokens[: P + start], keys[0])
            assert done == 0
            assert sample.tokens[P + start : P + end] == ids[: end - start]
            assert sample.rollout_log_probs[start:end] == lps[: end - start]
        else:  # the template's tokens around an observation: never trained, no log-prob
            assert all(lp == 0.0 for lp in sample.rollout_log_probs[start:end])
            text = chat.tokenizer.decode(sample.tokens[P + start : P + end], skip_special_tokens=False)
            assert "<tool_response>" in text and text.rstrip().endswith("<|im_start|>assistant")
    meta = sample.metadata
    assert model_runs == meta["turns"]
    assert meta["env"] == meta["source_name"] == "calc"
    assert meta["pipeline_scored"] is True
    assert meta["tool_calls"] == model_runs - 1
    assert sample.weight_versions == ["default"] * meta["turns"]
    # the reward is the environment's check of the final answer
    final = [m for m in meta["messages"] if m["role"] == "assistant"][-1]["content"] \
        if isinstance(meta["messages"], list) else sample.response
    correct = numbers_match(extract_answer(final), label)
    assert sample.reward == (1.0 if correct else 0.0)
    assert meta["reward_components"]["correct"] is correct
    assert sample.response == chat.decode(sample.tokens[P:])


# ------------------------------------------------------------------ through slime's generate_and_rm

@pytest.mark.conformance
@STACK_TIMEOUT
async def test_generate_and_rm_runs_our_episodes(slime, stack, tmp_path):
    """slime's generate_and_rm with --custom-generate-function-path workers.inslime.generate:
    multi-turn calculator episodes through smg and SGLang's front, with slime's own sampling
    params (spaces_between_special_tokens, stop=None, stop_token_ids=None: a key SGLang would not
    take fails the episode)."""
    from workers.envs.local import CALCULATOR_TOOL

    rollout = slime.modules["slime.rollout.sglang_rollout"]
    sim = twin(stack, seed=3, tool_use=0.7, accuracy=0.6)
    args = _args(stack.router_url, _config(tmp_path))
    state = rollout.GenerateState(args)
    params = state.sampling_params
    assert params["spaces_between_special_tokens"] is False and params["stop"] is None
    groups = [_samples(slime, q, a, index0=i * N) for i, (q, a) in enumerate(QUESTIONS)]
    done = await asyncio.gather(*(
        rollout.generate_and_rm(args, s, sampling_params=params.copy()) for g in groups for s in g
    ))
    stats = stack.total_stats()
    assert [s.index for s in done] == list(range(len(QUESTIONS) * N))
    for sample in done:
        label = dict(QUESTIONS)[sample.prompt]
        _check_sample(slime, sample, sim, stats, label=label, tools=[CALCULATOR_TOOL])
    turns = [s.metadata["turns"] for s in done]
    assert max(turns) >= 2 and min(turns) >= 1  # multi-turn episodes with masked tool output among them
    rewards = {s.reward for s in done}
    assert rewards == {0.0, 1.0}  # the simulator is right 60 % of the time
    assert stats["errors"] == 0
    assert stats["max_running"] <= args.sglang_server_concurrency  # slime's semaphore: one slot per episode


@pytest.mark.conformance
@STACK_TIMEOUT
async def test_an_abort_ends_the_episode_aborted_at_once(slime, stack, tmp_path):
    """slime aborts the engines' requests once its batch is full, with its own `abort`: the
    engines from the router's GET /workers, each sent /abort_request {"abort_all": true} until its
    /v1/loads says idle. The episode ends ABORTED with what it had (no resume, as slime's own
    generate), well-formed, and slime takes no reward call."""
    rollout = slime.modules["slime.rollout.sglang_rollout"]
    http_utils = slime.modules["slime.utils.http_utils"]
    twin(stack, seed=1, token_latency_s=0.01, length_mu=5.0, length_sigma=0.01, tool_use=0.0)
    args = _args(stack.router_url, _config(tmp_path))
    http_utils._http_client = None
    http_utils.init_http_client(args)
    try:
        params = rollout.GenerateState(args).sampling_params
        task = asyncio.ensure_future(
            rollout.generate_and_rm(args, _samples(slime, *QUESTIONS[0], n=1)[0], sampling_params=params.copy()))
        while not (await asyncio.to_thread(stack.total_stats))["running"]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        control = require_slime("slime.backends.sglang_utils.server_control").modules[
            "slime.backends.sglang_utils.server_control"]
        loads = [await control._get_server_num_requests(url) for url in stack.engine_urls]
        assert sorted(loads) == [0, 1]  # SGLang's /v1/loads, from the scheduler's load snapshots
        aborted_at = asyncio.get_running_loop().time()
        await rollout.abort(args, rollout_id=0)  # returns once every engine's /v1/loads is idle
        sample = await task
        assert asyncio.get_running_loop().time() - aborted_at < 2.0
    finally:
        await http_utils._http_client.aclose()
        http_utils._http_client = None
    assert sample.status is slime.Sample.Status.ABORTED
    assert sample.metadata["turn_log"][-1]["finish"] == "abort" and sample.metadata["turns"] == 1
    assert 0 < sample.response_length < 148  # part of the ~148-token answer
    assert sample.loss_mask == [1] * sample.response_length
    assert len(sample.rollout_log_probs) == sample.response_length
    stats = stack.total_stats()
    assert stats["requests"] == 1 and stats["running"] == 0  # not resumed; the engines are idle


@pytest.mark.conformance
@STACK_TIMEOUT
async def test_what_generate_sends_is_what_sglang_admits(slime, stack, tmp_path):
    """Issue 18 item 11: slime's sampling params (spaces_between_special_tokens, no_stop_trim,
    skip_special_tokens, stop=None, stop_token_ids=None; an eval dataset's repetition_penalty and
    min_new_tokens; a deterministic-inference seed) reach the engine as bodies SGLang's own server
    admits (the front keeps each body it received: `EngineStack.bodies`). slime is pointed at the
    engine itself here: both routers re-serialize the body and drop `spaces_between_special_tokens`
    (tests/conformance/test_conformance_sglang.py), and this test is about what our generate sends."""
    rollout = slime.modules["slime.rollout.sglang_rollout"]
    twin(stack, seed=2)
    args = _args(stack.engine_urls[0], _config(tmp_path))
    train = rollout.GenerateState(args).sampling_params
    evaluation = {**train, "repetition_penalty": 1.05, "min_new_tokens": 2, "sampling_seed": 1234}
    done = await asyncio.gather(*(
        rollout.generate_and_rm(args, s, sampling_params=p.copy(), evaluation=p is evaluation)
        for p, s in zip((train, evaluation), _samples(slime, *QUESTIONS[1], n=2))
    ))
    assert all(s.status is not slime.Sample.Status.FAILED for s in done)  # SGLang's front refused none
    bodies = stack.bodies(0)
    assert bodies and len(bodies) == stack.stats(0)["requests"]
    assert {b["sampling_params"].get("spaces_between_special_tokens") for b in bodies} == {False}
    assert any(b["sampling_params"].get("sampling_seed") == 1234 for b in bodies)
    for body in bodies:
        assert "stop" not in body["sampling_params"] and "stop_token_ids" not in body["sampling_params"]


@pytest.mark.conformance
@STACK_TIMEOUT
async def test_no_turn_is_sent_once_slime_has_aborted(slime, stack, tmp_path, monkeypatch):
    """slime's abort sets GenerateState.aborted and waits for every pending episode: an episode
    in its tool call at that moment ends ABORTED before its next turn, sending nothing more."""
    from workers.envs.local import CalculatorSession

    rollout = slime.modules["slime.rollout.sglang_rollout"]
    step = CalculatorSession.step

    async def step_then_abort(self, calls):
        rollout.GenerateState(args).aborted = True  # what slime's abort() does first
        return await step(self, calls)

    monkeypatch.setattr(CalculatorSession, "step", step_then_abort)
    twin(stack, seed=4, tool_use=1.0)
    args = _args(stack.router_url, _config(tmp_path))
    params = rollout.GenerateState(args).sampling_params
    sample = (await asyncio.gather(
        rollout.generate_and_rm(args, _samples(slime, *QUESTIONS[0], n=1)[0], sampling_params=params.copy())
    ))[0]
    requests = stack.total_stats()["requests"]
    assert requests == 1
    assert sample.status is slime.Sample.Status.ABORTED
    assert sample.metadata["turns"] == 2 and sample.metadata["turn_log"][-1]["finish"] == "abort"
    assert sample.metadata["tool_calls"] == 1
    assert sample.loss_mask[-1] == 0 and 1 in sample.loss_mask  # turn 1, then the tool output; no turn 2 tokens
    assert len(sample.rollout_log_probs) == sample.response_length


async def recording_reward(args, samples, **kwargs):
    """--custom-rm-path tests.workers.test_inprocess.recording_reward: records slime's call, then ours."""
    from workers.inslime import reward

    CALLS.append(samples)
    return await reward(args, samples, **kwargs)


@pytest.mark.conformance
@STACK_TIMEOUT
async def test_group_rm_calls_reward_once_per_group_with_the_list(slime, stack, tmp_path):
    rollout = slime.modules["slime.rollout.sglang_rollout"]
    CALLS.clear()
    twin(stack, seed=5)
    args = _args(stack.router_url, _config(tmp_path), group_rm=True, custom_rm_path="tests.workers.test_inprocess.recording_reward")
    params = rollout.GenerateState(args).sampling_params
    group = _samples(slime, *QUESTIONS[0])
    for s in group:
        s.session_id = None  # generate_and_rm_group gives each its own
    stored = await rollout.generate_and_rm_group(args, group, sampling_params=params.copy())
    assert len(CALLS) == 1 and isinstance(CALLS[0], list) and len(CALLS[0]) == N
    assert all(s.session_id for s in stored)
    for s in stored:  # the reward generate verified, returned as is
        assert s.reward in (0.0, 1.0) and s.reward == float(s.metadata["reward_components"]["correct"])


@pytest.mark.conformance
@STACK_TIMEOUT
async def test_reward_scores_slimes_own_generate(slime, stack, tmp_path):
    """slime's stock generate (no custom generate function), scored by --custom-rm-path
    workers.inslime.reward with the arithmetic environment: what evaluation through slime's
    eval_rollout does with our environments. slime's own /generate bodies meet SGLang's front."""
    from workers.chat import ChatTokens
    from workers.envs.local import extract_answer, numbers_match
    from workers.sim.tokenizer import load_test_tokenizer

    rollout = slime.modules["slime.rollout.sglang_rollout"]
    http_utils = slime.modules["slime.utils.http_utils"]
    chat = ChatTokens(load_test_tokenizer())
    twin(stack, seed=7, accuracy=0.5)
    args = _args(stack.router_url, _config(tmp_path), custom_generate_function_path=None)
    http_utils._http_client = None
    http_utils.init_http_client(args)
    try:
        params = rollout.GenerateState(args).sampling_params
        samples = []
        for i, (q, a) in enumerate(QUESTIONS):
            for s in _samples(slime, q, a, env="arith", index0=i * N):
                s.tokens = chat.prompt_ids([{"role": "user", "content": q}], None)  # as --apply-chat-template
                samples.append(s)
        done = await asyncio.gather(*(rollout.generate_and_rm(args, s, sampling_params=params.copy())
                                      for s in samples))
    finally:
        await http_utils._http_client.aclose()
        http_utils._http_client = None
    for s in done:
        assert s.status is slime.Sample.Status.COMPLETED
        assert "pipeline_scored" not in s.metadata  # slime generated it; our reward verified it
        correct = numbers_match(extract_answer(s.response), dict(QUESTIONS)[s.prompt])
        assert s.reward == (1.0 if correct else 0.0)
        assert s.metadata["reward_components"]["correct"] is correct and s.metadata["source_name"] == "arith"
    assert {s.reward for s in done} == {0.0, 1.0}


@pytest.mark.conformance
@STACK_TIMEOUT
async def test_failed_episode_is_failed_removed_and_well_formed(slime, stack, tmp_path):
    """The engine answers 503 to everything (its scheduler aborts each request with that status,
    which SGLang's front answers as an HTTP 503) and the config allows no retry: the episode
    fails; slime gets FAILED, remove_sample=True, reward 0, and prompt + one masked token
    (slime's log-prob target builder needs a response token)."""
    rollout = slime.modules["slime.rollout.sglang_rollout"]
    twin(stack)
    stack.sim("fail_next", {"status": 503, "count": 50, "message": "simulated outage"})
    args = _args(stack.router_url, _config(tmp_path, engine={"max_retries": 0}))
    params = rollout.GenerateState(args).sampling_params
    sample = (await asyncio.gather(
        rollout.generate_and_rm(args, _samples(slime, *QUESTIONS[0], n=1)[0], sampling_params=params.copy())
    ))[0]
    twin(stack)  # no fault left for the next test
    assert sample.status is slime.Sample.Status.FAILED
    assert sample.remove_sample is True and sample.reward == 0.0
    assert sample.response_length == 1 and sample.loss_mask == [0] and sample.rollout_log_probs == [0.0]
    assert len(sample.tokens) > 1
    assert "503" in sample.metadata["error"]
    # the reward function agrees (--group-rm calls it for every sample)
    from workers.inslime import reward

    assert await reward(args, [sample]) == [0.0]


@pytest.mark.conformance
async def test_custom_generate_refuses_a_rendered_prompt(slime, tmp_path):
    rollout = slime.modules["slime.rollout.sglang_rollout"]
    args = _args("http://127.0.0.1:9", _config(tmp_path), apply_chat_template=True)  # refused before any request
    params = rollout.GenerateState(args).sampling_params
    with pytest.raises(ConfigError, match="--apply-chat-template"):
        await rollout.generate_and_rm(args, _samples(slime, *QUESTIONS[0], n=1)[0], sampling_params=params)


# ------------------------------------------------------------------ no slime needed

def _sample(**meta):
    return SimpleNamespace(index=3, prompt="What is 1 + 1?", label=2, metadata=meta, response="Answer: 2",
                           status=SimpleNamespace(value="completed"), reward=None)


def test_environment_of_a_sample(tmp_path):
    from pipeline.config import load_config
    from workers.inslime import env_name, task_of

    two = load_config(_config(tmp_path))
    one = load_config(_config(tmp_path, environments={"only": {"kind": "arithmetic"}}))
    args = Namespace()
    assert env_name(args, _sample(env="arith"), two) == "arith"
    assert env_name(args, _sample(), one) == "only"  # the config's only environment
    assert env_name(Namespace(pipeline_env="calc"), _sample(), two) == "calc"
    with pytest.raises(ConfigError, match="names no environment.*arith, calc"):
        env_name(args, _sample(), two)
    with pytest.raises(ConfigError, match="'nope' is not configured"):
        env_name(args, _sample(env="nope"), two)
    task = task_of(_sample(env="arith", task_id="t-1", tests=[1], turns=3, messages=[]), "arith")
    assert (task.id, task.env, task.label) == ("t-1", "arith", "2")  # a numeric label becomes text
    assert task.metadata == {"env": "arith", "task_id": "t-1", "tests": [1]}  # the runner's own keys are not the task's
    assert task_of(_sample(), "arith").id == "slime/3"


def test_config_comes_from_args_env_or_custom_config(tmp_path, monkeypatch):
    from workers.inslime import load_inprocess_config

    monkeypatch.delenv("ROLLOUT_CONFIG", raising=False)
    # slime's custom config holding the pipeline's sections and other keys of slime's
    custom = tmp_path / "custom.yaml"
    custom.write_text(yaml.safe_dump({
        "environments": {"calc": {"kind": "calculator"}}, "rollout": {"max_turns": 3},
        "pipeline_eta": 2, "my_hook_option": 1,
    }))
    config = load_inprocess_config(Namespace(custom_config_path=str(custom)))
    assert list(config.environments) == ["calc"] and config.rollout.max_turns == 3
    other = _config(tmp_path, environments={"math": {"kind": "arithmetic"}})
    monkeypatch.setenv("ROLLOUT_CONFIG", other)
    assert list(load_inprocess_config(Namespace(custom_config_path=str(custom))).environments) == ["math"]
    third = _config(tmp_path, environments={"x": {"kind": "arithmetic"}})
    assert list(load_inprocess_config(Namespace(pipeline_config=third, custom_config_path=str(custom))).environments) \
        == ["x"]
    monkeypatch.delenv("ROLLOUT_CONFIG")
    with pytest.raises(ConfigError, match="--custom-config-path"):
        load_inprocess_config(Namespace())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"environments": {"c": {"kind": "calculator", "wieght": 1}}}))
    with pytest.raises(ConfigError, match="wieght"):  # the pipeline's sections stay strict
        load_inprocess_config(Namespace(custom_config_path=str(bad)))


def test_slime_sampling_params_translate_to_what_sglang_takes(caplog):
    from workers.inslime import translate_sampling

    slime_params = dict(  # slime's GenerateState.sampling_params, as sent with its defaults
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=1024, stop=None, stop_token_ids=None,
        skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False,
    )
    base = SamplingParams(temperature=0.7, min_p=0.05, max_new_tokens=256)
    sampling, budget = translate_sampling(slime_params, base)
    assert budget == 1024  # the episode's budget over all turns
    assert sampling.to_dict() == dict(
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=256, min_p=0.05,  # the YAML's per-turn cap
        skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False,
    )
    sampling, _ = translate_sampling({**slime_params, "logit_bias": {"1": 2.0}, "stop": ["</a>"], "sampling_seed": 7})
    assert "logit_bias" not in sampling.to_dict() and sampling.stop == ["</a>"] and sampling.sampling_seed == 7
    assert "logit_bias" in caplog.text
    sampling, _ = translate_sampling({**slime_params, "custom_params": {"other": 1}})
    assert "custom_params" not in sampling.to_dict() and "custom_params" in caplog.text
    with pytest.raises(ConfigError, match="rollout-top-p"):
        translate_sampling({**slime_params, "top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}})
    with pytest.raises(ConfigError, match="max_new_tokens"):
        translate_sampling({**slime_params, "max_new_tokens": 8.0})
    with pytest.raises(ConfigError, match="top_p"):
        translate_sampling({**slime_params, "top_p": 0.0})
