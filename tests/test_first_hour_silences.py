"""Issue 27 item 2: the silences and misleading figures a new user meets in the first hour.
Each test here fails on fe89cd3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from tests.conformance_support import require_nemo_skills
from workers.envs.base import EpisodeRecord
from workers.envs.math import MathEnvironment, last_boxed

REPO = Path(__file__).resolve().parent.parent


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


# ------------------------------------------------------------------ rollout --debug: a traceback for a config error


def _rollout(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    full.update({"COLUMNS": "200", "PYTHONUNBUFFERED": "1", "ROLLOUT_REDIS_OUTAGE_S": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "scripts.cli", *argv], env=full, text=True, capture_output=True,
                          timeout=timeout, cwd=cwd or REPO, check=False)


@pytest.mark.parametrize("command,config,extra", [
    ("workers", "rollout:\n  rollout_batch_size: 0\n", ()),
    ("enqueue", "environments:\n  gsm:\n    kind: maths\n", ("--tasks", "t.jsonl", "--without-trainer")),
    ("prepare", "environments:\n  gsm:\n    kind: maths\n    dataset: {source: jsonl, files: [d.jsonl]}\n",
     ("--output", "out.jsonl")),
])
def test_debug_prints_the_traceback_of_a_configuration_error(tmp_path, command, config, extra):
    (tmp_path / "p.yaml").write_text(config)
    (tmp_path / "t.jsonl").write_text('{"id": "a", "env": "gsm", "prompt": "1+1?", "label": "2"}\n')
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?"}\n')  # no label
    plain = _rollout(command, "--config", str(tmp_path / "p.yaml"), *extra, cwd=tmp_path)
    debug = _rollout("--debug", command, "--config", str(tmp_path / "p.yaml"), *extra, cwd=tmp_path)
    assert plain.returncode == debug.returncode == 2, (plain.stderr, debug.stderr)
    assert "Traceback" not in plain.stderr
    assert plain.stderr.lstrip().startswith(f"rollout {command}: "), plain.stderr
    assert "Traceback (most recent call last)" in debug.stderr, debug.stderr
    assert debug.stderr.rstrip().endswith(plain.stderr.strip())  # the same message, after the traceback
