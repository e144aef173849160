"""NeMo-RL's real SlidingPuzzleEnv played through the real pipeline, every part a real process:
a redis-server (tests/conftest.py), the simulated SGLang engine (`rollout engine --puzzle`,
HTTP on loopback: it plays a shortest solution of the board in its context, one
`<action>move</action>` a turn, cut at the request's stop strings), `rollout workers`
(`kind: nemo_rl`, multi_turn) and `rollout enqueue`. The stored groups are read back from
Redis and checked against NeMo-RL's own game logic: the moves solve the puzzle in the fewest
moves, each observation is the one SlidingPuzzleEnv gives, its content tokens follow the
turn with loss mask 0 and log-prob 0, every turn ends at `</action>` (the stop string went to
the engine), rewards are NeMo-RL's (0 per move, 1 on the win, summed), and the group's
`global_post_process_and_metrics` reached the samples' components.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path

import pytest

from pipeline.schema import Status, decode_group
from pipeline.store.local_redis import free_port
from tests.support.conformance_support import require_nemo_rl
from tests.support.env_helpers import chat_tokens
from tests.support.policy_helpers import trainer_started

pytestmark = pytest.mark.conformance

REPO = Path(__file__).resolve().parents[2]
MODULE = "nemo_rl.environments.games.sliding_puzzle"


def _shortest(logic, game) -> int:
    """Moves of a shortest solution (NeMo-RL's own step as the rules)."""
    seen, queue = {str(game["grid"])}, deque([(game, 0)])
    while queue:
        state, depth = queue.popleft()
        if state["grid"] == state["solution"]:
            return depth
        for move in ("up", "down", "left", "right"):
            nxt = logic.step(move, state)[3]
            if str(nxt["grid"]) not in seen:
                seen.add(str(nxt["grid"]))
                queue.append((nxt, depth + 1))
    raise AssertionError("unsolvable")


def _tasks(sp, count: int) -> list[dict]:
    rows, seed = [], 100
    while len(rows) < count:
        random.seed(seed)
        game = sp.SlidingPuzzleGameLogic.generate({"size": 3, "shuffle_moves": 8})
        seed += 1
        if game["grid"] == game["solution"]:
            continue
        prompt = (sp.SlidingPuzzleGameLogic.init(game) + "\n\n" + sp.SlidingPuzzleGameLogic.render(game)
                  + "\nAnswer with one move as <action>your_action</action>.")
        metadata = {"game_state": game, "num_moves": 0, "max_moves": 30}
        rows.append({"id": f"puzzle-{seed}", "env": "puzzle", "prompt": prompt, "metadata": metadata})
    return json.loads(json.dumps(rows))  # as tasks.jsonl carries them (tuples become lists)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url}: process exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"{url} did not come up: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def test_sliding_puzzle_through_redis_engine_and_worker_processes(tmp_path, redis, redis_url, keys, namespace):
    nr = require_nemo_rl(MODULE)
    sp = nr.modules[MODULE]
    rows = _tasks(sp, 2)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    port = free_port()
    config = {
        "redis": {"url": redis_url, "namespace": namespace},
        "engine": {"url": f"http://127.0.0.1:{port}"},
        "rollout": {"n_samples_per_prompt": 2, "rollout_batch_size": 4, "eta": 0, "max_response_tokens": 4096},
        "workers": {"concurrency": 4, "max_tries": 1},
        "environments": {"puzzle": {"kind": "nemo_rl", "max_turns": 40, "options": {
            "cls": f"{MODULE}:SlidingPuzzleEnv", "config": {"game_config": {}},
            "multi_turn": True, "stop_strings": ["</action>"]}}},
    }
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(json.dumps(config))  # YAML is a superset of JSON
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(nr.path), str(REPO), env.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", ROLLOUT_REDIS_OUTAGE_S="1")
    cli = [sys.executable, "-m", "scripts.cli"]
    engine_log, workers_log = tmp_path / "engine.log", tmp_path / "workers.log"
    procs: list[subprocess.Popen] = []
    await trainer_started(redis, keys)  # what a trainer's first rollout publishes (the policy version)
    try:
        with engine_log.open("w") as fh:
            procs.append(subprocess.Popen([*cli, "engine", "--port", str(port), "--puzzle"], env=env, cwd=REPO,
                                          stdout=fh, stderr=subprocess.STDOUT))
        _wait_http(f"http://127.0.0.1:{port}/health", procs[0], engine_log)
        with workers_log.open("w") as fh:
            procs.append(subprocess.Popen([*cli, "workers", "--config", str(cfg)], env=env, cwd=REPO,
                                          stdout=fh, stderr=subprocess.STDOUT))
        enqueued = subprocess.run([*cli, "enqueue", "--tasks", str(tasks), "--config", str(cfg), "--without-trainer",
                                   "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert enqueued.returncode == 0, enqueued.stderr
        assert json.loads(enqueued.stdout)["admitted"] == 2
        deadline = time.monotonic() + 40
        while await redis.xlen(keys.groups) < 2:
            if time.monotonic() > deadline or procs[1].poll() is not None:
                pytest.fail(f"no 2 groups in Redis: {workers_log.read_text()[-3000:]}")
            await asyncio.sleep(0.2)
        entries = await redis.xrange(keys.groups)
    finally:
        for proc in reversed(procs):
            _stop(proc)

    chat = chat_tokens()  # the engine's tokenizer (the shared test tokenizer), the workers' too
    by_id = {r["id"]: r for r in rows}
    groups = [decode_group(fields[b"g"]) for _, fields in entries]
    assert sorted(g.task.id for g in groups) == sorted(by_id)
    for group in groups:
        row = by_id[group.task.id]
        shortest = _shortest(sp.SlidingPuzzleGameLogic, row["metadata"]["game_state"])
        assert len(group.samples) == 2
        for sample in group.samples:
            assert sample.status is Status.COMPLETED, sample.metadata
            messages = sample.metadata["messages"]
            turns = [m["content"] for m in messages if m["role"] == "assistant"]
            observations = [m["content"] for m in messages if m["role"] == "environment"]
            moves = [re.fullmatch(r"I slide (\w+)\. <action>\1</action>", t).group(1) for t in turns]
            assert len(moves) == shortest and len(observations) == shortest
            # NeMo-RL's game on the same moves gives the same observations and rewards
            state, rewards = row["metadata"]["game_state"], []
            for move, observation in zip(moves, observations):
                response, reward, _done, state = sp.SlidingPuzzleGameLogic.step(move, state)
                assert observation == f"<environment>\n{response}\n</environment>\n"
                rewards.append(reward)
            assert state["grid"] == state["solution"] and "Congratulations" in observations[-1]
            assert sample.metadata["step_rewards"] == rewards == [0.0] * (shortest - 1) + [1.0]
            assert sample.reward == 1.0 and sample.reward_components["terminal"] is True
            # tokens: prompt, then each turn (mask 1, the engine's log-probs) and the observation's
            # own content tokens (mask 0, log-prob 0), no observation after the winning move
            prompt_ids = chat.prompt_ids([{"role": "user", "content": row["prompt"]}], None)
            tokens = sample.token_array().tolist()
            assert tokens[: len(prompt_ids)] == prompt_ids
            want_ids, want_mask = [], []
            for i, (turn, observation) in enumerate(zip(turns, observations)):
                ids = chat.encode(turn)
                want_ids += ids
                want_mask += [1] * len(ids)
                if i < len(turns) - 1:
                    obs = chat.encode(observation)
                    want_ids += obs
                    want_mask += [0] * len(obs)
            assert tokens[len(prompt_ids):] == want_ids
            mask = sample.loss_mask_array().tolist()
            assert mask == want_mask
            assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(sample.log_prob_array().tolist(), mask))
            # the group's global_post_process_and_metrics (SlidingPuzzleEnv: success rate)
            assert sample.reward_components["nemo_rl/sliding_puzzle_success_rate"] == 1.0
            assert sample.reward_components["nemo_rl/group_size"] == 2
