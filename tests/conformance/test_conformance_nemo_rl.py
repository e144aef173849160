"""`kind: nemo_rl` multi-turn: NeMo-RL's real SlidingPuzzleEnv (the pinned snapshot,
tests/support/conformance_support.py) played through whole episodes of the episode runner.

The "model" is an engine stand-in that solves the puzzle (a breadth-first plan on its own copy of
the board) and answers one `<action>move</action>` per turn, and that honours SGLang's `stop`
as SGLang does (the output ends with the stop string's tokens). What is checked: NeMo-RL's loop
(`step` after every assistant turn with the whole message log and the game state it returned
last), its observations appended as NeMo-RL appends them (the content's own tokens, no chat
template) with loss mask 0 and log-prob 0, `next_stop_strings` passed as the next turn's `stop`,
rewards summed as NeMo-RL's `total_rewards`, `terminateds` ending the episode.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from pipeline.config import EnvConfig, PipelineConfig
from pipeline.schema import SamplingParams, Status, Task
from tests.support.conformance_support import require_nemo_rl
from tests.support.env_helpers import ScriptedEngine, chat_tokens
from workers.engine import Generation
from workers.envs.plugins import NemoRLEnvironment
from workers.episode import EpisodeRunner, EpisodeSettings

pytestmark = pytest.mark.conformance

MOVES = ("up", "down", "left", "right")


def _sliding():
    return require_nemo_rl("nemo_rl.environments.games.sliding_puzzle").modules["nemo_rl.environments.games.sliding_puzzle"]


def _plan(logic, game) -> list[str]:
    """Shortest list of direction moves that solves `game` (upstream's own step as the rules)."""
    start = game
    seen = {str(start["grid"])}
    queue = deque([(start, [])])
    while queue:
        state, path = queue.popleft()
        if state["grid"] == state["solution"]:
            return path
        for move in MOVES:
            _text, _reward, _done, nxt = logic.step(move, state)
            key = str(nxt["grid"])
            if key not in seen:
                seen.add(key)
                queue.append((nxt, path + [move]))
    raise AssertionError("unsolvable")


@dataclass
class PuzzlePlayer(ScriptedEngine):
    """Engine stand-in: turn 0 asks to `view`, then plays the plan; each answer runs on past the
    action, so only SGLang's `stop` handling ends it right after `</action>`."""

    plan: list[str]
    stops: list = field(default_factory=list)
    calls: dict = field(default_factory=dict)  # episode (routing key) -> turns answered

    async def generate(self, tokens, sampling, *, rid, routing_key, due_order=None):
        chat = chat_tokens()
        self.stops.append(sampling.stop)
        turn = self.calls.get(routing_key, 0)
        move = "view" if turn == 0 else self.plan[turn - 1]
        self.calls[routing_key] = turn + 1
        text = f"I will play {move}. <action>{move}</action> and then I keep talking"
        finish = "length"
        if sampling.stop:
            for stop in sampling.stop:
                at = text.find(stop)
                if at != -1:
                    text, finish = text[: at + len(stop)], "stop"
        ids = chat.encode(text)[: sampling.max_new_tokens]
        return Generation(output_ids=ids, log_probs=[-0.5] * len(ids), finish=finish, finish_message="",
                          weight_version="1", text=text, cached_tokens=0, latency_s=0.0, weight_versions=("1",))


def _task(sp, seed: int = 3, max_moves: int = 30):
    random.seed(seed)
    game = sp.SlidingPuzzleGameLogic.generate({"size": 3, "shuffle_moves": 8})
    if game["grid"] == game["solution"]:
        return _task(sp, seed + 1, max_moves)
    prompt = (sp.SlidingPuzzleGameLogic.init(game) + "\n\n" + sp.SlidingPuzzleGameLogic.render(game)
              + "\nAnswer with one move as <action>your_action</action>.")
    metadata = {"game_state": copy.deepcopy(game), "num_moves": 0, "max_moves": max_moves}
    return Task(id=f"puzzle-{seed}", env="puzzle", prompt=prompt, metadata=metadata), game


def _env(**config) -> NemoRLEnvironment:
    options = {"cls": "nemo_rl.environments.games.sliding_puzzle:SlidingPuzzleEnv", "config": {"game_config": {}},
               "multi_turn": True, "stop_strings": ["</action>"]}
    return NemoRLEnvironment("puzzle", EnvConfig(kind="nemo_rl", options=options, **config))


async def _play(env, task, player):
    settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=64))
    return await EpisodeRunner(player, chat_tokens(), env, settings).run(task, f"{task.id}/0")


async def test_sliding_puzzle_solved_through_the_runner():
    sp = _sliding()
    task, game = _task(sp)
    plan = _plan(sp.SlidingPuzzleGameLogic, game)
    player = PuzzlePlayer(plan)
    env = _env(max_turns=40)
    sample = await _play(env, task, player)

    assert sample.status == Status.COMPLETED, sample.metadata
    assert sample.metadata["finished"] is True
    assert sample.metadata["turns"] == len(plan) + 1  # view, then every move
    # NeMo-RL's rewards: 0 per move, 1.0 when solved; summed
    assert sample.metadata["step_rewards"] == [0.0] * len(plan) + [1.0]
    assert sample.reward == 1.0 and sample.reward_components["terminal"] is True
    # the first turn's stop strings are configured, later ones are next_stop_strings
    assert player.stops == [["</action>"]] * (len(plan) + 1)

    # tokens: each model turn (mask 1, its log-probs) then the observation content's own tokens (mask 0)
    chat = chat_tokens()
    messages = sample.metadata["messages"]
    observations = [m for m in messages if m["role"] == "environment"]
    assert len(observations) == len(plan) + 1
    assert "Viewing the board" in observations[0]["content"]
    assert "Congratulations" in observations[-1]["content"]
    prompt_len = len(chat.prompt_ids([{"role": "user", "content": task.prompt}], None))
    response = sample.token_array()[prompt_len:].tolist()
    mask = sample.loss_mask_array().tolist()
    logps = sample.log_prob_array().tolist()
    expected_tokens, expected_mask = [], []
    for i, obs in enumerate(observations):
        move = "view" if i == 0 else plan[i - 1]
        turn = chat.encode(f"I will play {move}. <action>{move}</action>")
        expected_tokens += turn
        expected_mask += [1] * len(turn)
        if i < len(observations) - 1:  # the episode ends at the terminal step: no observation after it
            obs_ids = chat.encode(obs["content"])
            expected_tokens += obs_ids
            expected_mask += [0] * len(obs_ids)
    assert response == expected_tokens
    assert mask == expected_mask
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(logps, mask))


async def test_max_turns_truncates_without_the_win():
    sp = _sliding()
    task, game = _task(sp, seed=5)
    plan = _plan(sp.SlidingPuzzleGameLogic, game)
    assert len(plan) >= 2
    env = _env(max_turns=2, nonterminal_reward=-0.5)
    sample = await _play(env, task, PuzzlePlayer(plan))
    assert sample.status == Status.TRUNCATED
    assert sample.metadata["step_rewards"] == [0.0, 0.0]
    assert sample.reward == -0.5  # rewards summed, plus the nonterminal reward (never terminated)


async def test_invalid_format_is_an_observation_and_stops_nothing():
    sp = _sliding()
    task, _game = _task(sp, seed=7)

    class Babbler(PuzzlePlayer):
        async def generate(self, tokens, sampling, *, rid, routing_key, due_order=None):
            self.stops.append(sampling.stop)
            ids = chat_tokens().encode("no action here")
            return Generation(output_ids=ids, log_probs=[-1.0] * len(ids), finish="stop", finish_message="",
                              weight_version="1", text="", cached_tokens=0, latency_s=0.0)

    env = _env(max_turns=2)
    player = Babbler([])
    sample = await _play(env, task, player)
    observations = [m for m in sample.metadata["messages"] if m["role"] == "environment"]
    assert "Invalid response format" in observations[0]["content"]
    assert sample.status == Status.TRUNCATED and sample.reward == 0.0


async def test_sliding_puzzle_groups_through_the_worker_job_path(redis, redis_url, keys):
    """The real job path: arq job function -> runner -> SlidingPuzzleEnv -> one group pushed to Redis."""
    import msgspec

    from pipeline.config import parse_config
    from pipeline.schema import PromptJob, decode_group, encode
    from pipeline.store.buffer import GroupBuffer
    from workers.jobs import CTX_KEY, WorkerContext, run_group
    from workers.liveness import Liveness

    sp = _sliding()
    task, game = _task(sp, seed=11)
    plan = _plan(sp.SlidingPuzzleGameLogic, game)
    env = {"kind": "nemo_rl", "max_turns": 40, "options": {
        "cls": "nemo_rl.environments.games.sliding_puzzle:SlidingPuzzleEnv", "config": {"game_config": {}},
        "multi_turn": True, "stop_strings": ["</action>"]}}
    config = parse_config({"redis": {"url": redis_url, "namespace": keys.ns}, "workers": {"max_tries": 1},
                           "environments": {"puzzle": env}})
    buffer = GroupBuffer(redis, keys)
    await buffer.ensure_group()
    context = WorkerContext(
        config=config, keys=keys, buffer=buffer, engine=PuzzlePlayer(plan), chat=chat_tokens(),
        liveness=Liveness(redis, keys, "w1", heartbeat_s=1.0, dead_after_s=5.0), worker_id="w1",
    )
    # the task as tasks.jsonl carries it: JSON (the game state's tuples become lists)
    task = msgspec.json.decode(msgspec.json.encode(task), type=Task)
    job = PromptJob(task=task, epoch=0, n_samples=2, sampling=SamplingParams(max_new_tokens=64))
    try:
        result = await run_group({CTX_KEY: context, "job_id": keys.arq_job_id(job.job_id), "job_try": 1}, encode(job))
    finally:
        await context.aclose()
    assert result["status"] == "pushed"
    [(_, fields)] = await redis.xrange(keys.groups)
    group = decode_group(fields[b"g"])
    assert len(group.samples) == 2
    for sample in group.samples:
        assert sample.status is Status.COMPLETED and sample.reward == 1.0, sample.metadata
        assert sample.metadata["turns"] == len(plan) + 1
        mask = sample.loss_mask_array().tolist()
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1  # ends on the model's winning move
        assert sample.reward_components["max_step_batch"] == 2  # the group's two episodes step as one batch
        # SlidingPuzzleEnv.global_post_process_and_metrics on the group, in every sample's components
        assert sample.reward_components["nemo_rl/sliding_puzzle_success_rate"] == 1.0
        assert sample.reward_components["nemo_rl/group_size"] == 2


async def test_concurrent_episodes_step_as_one_batch():
    import asyncio

    sp = _sliding()
    task, game = _task(sp, seed=13)
    plan = _plan(sp.SlidingPuzzleGameLogic, game)
    env = _env(max_turns=40)
    player = PuzzlePlayer(plan)
    settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=64))
    runner = EpisodeRunner(player, chat_tokens(), env, settings)
    samples = await asyncio.gather(*(runner.run(task, f"{task.id}/{i}") for i in range(4)))
    assert all(s.status == Status.COMPLETED and s.reward == 1.0 for s in samples)
    steps = 4 * (len(plan) + 1)
    assert env.batcher.steps == steps
    assert env.batcher.max_size == 4 and env.batcher.batches < steps  # batched, not one call per step


async def test_sliding_puzzle_as_a_ray_actor():
    """`ray: true`: the @ray.remote SlidingPuzzleEnv runs as a Ray actor (a local Ray started here)."""
    ray = pytest.importorskip("ray")
    sp = _sliding()
    task, game = _task(sp, seed=17)
    plan = _plan(sp.SlidingPuzzleGameLogic, game)
    started = ray.is_initialized()
    env = _env(max_turns=40)
    env = NemoRLEnvironment("puzzle", EnvConfig(kind="nemo_rl", max_turns=40, options={
        **env.config.options, "ray": True, "ray_init": {"num_cpus": 1}}))
    try:
        sample = await _play(env, task, PuzzlePlayer(plan))
    finally:
        await env.aclose()
        if not started:
            ray.shutdown()
    assert sample.status == Status.COMPLETED and sample.reward == 1.0, sample.metadata
    assert sample.metadata["turns"] == len(plan) + 1


async def test_group_metrics_from_global_post_process_and_metrics():
    """NeMo-RL's `global_post_process_and_metrics` runs once per group, on the group's scored
    episodes as one batch (here: one solves the puzzle, one never answers in format and is cut
    by max_turns): SlidingPuzzleEnv's success rate is 0.5 in both samples' components."""
    import asyncio

    sp = _sliding()
    task, game = _task(sp, seed=19)
    plan = _plan(sp.SlidingPuzzleGameLogic, game)

    class HalfBabbler(PuzzlePlayer):
        async def generate(self, tokens, sampling, *, rid, routing_key, due_order=None):
            if routing_key.endswith("/1"):
                ids = chat_tokens().encode("no action here")
                return Generation(output_ids=ids, log_probs=[-1.0] * len(ids), finish="stop", finish_message="",
                                  weight_version="1", text="", cached_tokens=0, latency_s=0.0)
            return await super().generate(tokens, sampling, rid=rid, routing_key=routing_key)

    env = _env(max_turns=len(plan) + 1)
    settings = EpisodeSettings.from_config(PipelineConfig(), env.config, SamplingParams(max_new_tokens=64))
    runner = EpisodeRunner(HalfBabbler(plan), chat_tokens(), env, settings)
    solved, babbled = await asyncio.gather(*(runner.run(task, f"{task.id}/{i}") for i in range(2)))
    assert solved.reward == 1.0 and babbled.status == Status.TRUNCATED
    for sample in (solved, babbled):
        assert sample.reward_components["nemo_rl/sliding_puzzle_success_rate"] == 0.5
        assert sample.reward_components["nemo_rl/group_size"] == 2
    assert env.metrics.groups == 1 and not env.metrics.open
    # a later episode of the same task object is a group of its own
    again = await _play(env, task, PuzzlePlayer(plan))
    assert again.reward_components["nemo_rl/sliding_puzzle_success_rate"] == 1.0
    assert again.reward_components["nemo_rl/group_size"] == 1


class FailingMetricsEnv:
    """A NeMo-RL environment of our own (its interface): every answer right, metrics broken."""

    def __init__(self, cfg=None):
        pass

    def step(self, message_log_batch, metadata):
        import torch

        n = len(message_log_batch)
        return ([{"role": "environment", "content": "ok"}] * n, metadata, [None] * n, torch.ones(n),
                torch.ones(n), [None] * n)

    def global_post_process_and_metrics(self, batch):
        raise RuntimeError("metrics backend down")


class Sayer(PuzzlePlayer):
    async def generate(self, tokens, sampling, *, rid, routing_key, due_order=None):
        ids = chat_tokens().encode("done")
        return Generation(output_ids=ids, log_probs=[-1.0] * len(ids), finish="stop", finish_message="",
                          weight_version="1", text="", cached_tokens=0, latency_s=0.0)


async def test_failing_metrics_never_change_a_reward():
    require_nemo_rl()
    env = NemoRLEnvironment("m", EnvConfig(kind="nemo_rl", options={"cls": f"{__name__}:FailingMetricsEnv"}))
    task = Task(id="m1", env="m", prompt="hi")
    sample = await _play(env, task, Sayer([]))
    assert sample.status == Status.COMPLETED and sample.reward == 1.0
    assert sample.reward_components["nemo_rl/metrics_error"] == "RuntimeError: metrics backend down"
    assert env.metrics.failures == 1
    off = NemoRLEnvironment("m", EnvConfig(kind="nemo_rl", options={"cls": f"{__name__}:FailingMetricsEnv",
                                                                       "metrics": False}))
    sample = await _play(off, task, Sayer([]))
    assert off.metrics is None and not any(k.startswith("nemo_rl/") for k in sample.reward_components)
