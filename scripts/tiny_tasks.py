"""The tiny policy's task files (workers/sim/arith.py's problems), written as a user writes theirs:
raw JSONL turned into tasks.jsonl by `rollout prepare` (producers/prepare_tasks.py), in a process
of its own. Used by `rollout check-signal` and the learn bench; it sits in scripts/ because it
runs a producer, which the worker-side task definitions must not import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from workers.sim import sums
from workers.sim.arith import TWO_TURN_OPERANDS, fact, math_env, problems, two_turn_env

REPO = Path(__file__).resolve().parent.parent  # the checkout (`rollout prepare` runs from it)


def _dataset(raw: str) -> dict[str, Any]:
    return {"source": "jsonl", "files": [raw], "fields": {"id": "id", "prompt": "question", "label": "answer"}}


def prepare_tasks(workdir: Path) -> tuple[Path, Path]:
    """tasks.jsonl (the train split, once as the single-turn `arith` task and once as the
    two-turn `arith2` task) and heldout.jsonl (`arith`), each written by `rollout prepare`."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    for split, held in (("train", False), ("heldout", True)):
        rows = [(i, q, a) for i, (q, a, h) in enumerate(problems()) if h == held]
        raw = workdir / f"{split}-raw.jsonl"
        raw.write_text("".join(json.dumps({"id": f"{split}-{i}", "question": q, "answer": a}) + "\n" for i, q, a in rows))
        envs = {"arith": {**math_env(), "dataset": _dataset(raw.name)}}
        if not held:
            two = workdir / f"{split}2-raw.jsonl"
            two.write_text("".join(json.dumps({"id": f"{split}2-{i}", "question": q, "answer": a}) + "\n"
                                   for i, q, a in rows if max(fact(q)[1]) < TWO_TURN_OPERANDS))
            envs["arith2"] = {**two_turn_env(), "dataset": _dataset(two.name)}
        config = workdir / f"prepare-{split}.yaml"
        config.write_text(yaml.safe_dump({"environments": envs}))
        tasks = workdir / ("tasks.jsonl" if split == "train" else "heldout.jsonl")
        subprocess.run([sys.executable, "-m", "producers.prepare_tasks", "--config", str(config),
                        "--output", str(tasks)], check=True, cwd=REPO, capture_output=True)
        out.append(tasks)
    return out[0], out[1]


def prepare_sums_tasks(workdir: Path) -> tuple[Path, Path]:
    """tasks.jsonl (the `sums` family's train split) and heldout.jsonl (its held-out split),
    each written by `rollout prepare` for the math environment (workers/sim/sums.py)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    for split, held in (("train", False), ("heldout", True)):
        rows = [(i, q, a) for i, (q, a, h) in enumerate(sums.problems()) if h == held]
        raw = workdir / f"{split}-raw.jsonl"
        raw.write_text("".join(json.dumps({"id": f"{split}-{i}", "question": q, "answer": a}) + "\n" for i, q, a in rows))
        config = workdir / f"prepare-{split}.yaml"
        config.write_text(yaml.safe_dump({"environments": {sums.ENV: {**math_env(), "dataset": _dataset(raw.name)}}}))
        tasks = workdir / ("tasks.jsonl" if split == "train" else "heldout.jsonl")
        subprocess.run([sys.executable, "-m", "producers.prepare_tasks", "--config", str(config),
                        "--output", str(tasks)], check=True, cwd=REPO, capture_output=True)
        out.append(tasks)
    return out[0], out[1]
