"""An index of tasks.jsonl and the deterministic order of each epoch.

tasks.jsonl may hold millions of lines, so the producer never loads the tasks: one
pass records each line's byte offset per environment (8 bytes a task) and a
fingerprint of the file's bytes; a task is read back by seeking to its offset.

Order of epoch `e` (the same on every run, which is what makes resume exact):
- within an environment, a seeded permutation of its lines
  (`numpy.random.default_rng([seed, e, env_number])`);
- across environments, smooth weighted round robin over the environments that still
  have tasks left this epoch: while all have tasks, every prefix of the stream holds
  each environment within one task of its weight share. Each task appears exactly
  once per epoch; an environment with weight 0 is left out (and reported).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import ConfigError
from pipeline.schema import SchemaError, Task, decode_task_json

MAX_INDEX_ERRORS = 20


@dataclass(frozen=True)
class TaskIndex:
    path: Path
    envs: tuple[str, ...]  # sorted names with at least one task
    offsets: Mapping[str, np.ndarray]  # env -> int64 byte offsets of its lines, in file order
    digest: str  # blake2b of the file's bytes

    @classmethod
    def build(cls, path: str | Path, configured: Mapping[str, float]) -> TaskIndex:
        """Scan and validate every line (`configured`: env name -> weight)."""
        path = Path(path)
        per_env: dict[str, list[int]] = {}
        errors: list[str] = []
        digest = hashlib.blake2b(digest_size=16)
        offset = 0
        with open(path, "rb") as fh:
            for number, line in enumerate(fh, start=1):
                digest.update(line)
                if line.strip():
                    env = _check_line(line, configured, f"{path}:{number}", errors)
                    if env is not None:
                        per_env.setdefault(env, []).append(offset)
                offset += len(line)
        if errors:
            shown = "\n  ".join(errors[:MAX_INDEX_ERRORS])
            raise ConfigError(f"{path}: {len(errors)} bad task line(s) (rebuild it with `rollout prepare`):\n  {shown}")
        offsets = {env: np.asarray(per_env[env], dtype=np.int64) for env in sorted(per_env)}
        return cls(path, tuple(offsets), offsets, digest.hexdigest())

    def count(self, env: str | None = None) -> int:
        if env is not None:
            return len(self.offsets.get(env, ()))
        return sum(len(o) for o in self.offsets.values())

    def epoch_order(self, epoch: int, seed: int, weights: Mapping[str, float]) -> Iterator[tuple[str, int]]:
        """(env, byte offset) of every task with weight > 0, in this epoch's order."""
        envs = [e for e in self.envs if weights.get(e, 0.0) > 0]
        orders = {
            env: self.offsets[env][np.random.default_rng([seed, epoch, self.envs.index(env)]).permutation(self.count(env))]
            for env in envs
        }
        taken = dict.fromkeys(envs, 0)
        credit = dict.fromkeys(envs, 0.0)
        live = [e for e in envs if self.count(e)]
        while live:
            total = sum(weights[e] for e in live)
            for env in live:
                credit[env] += weights[env]
            env = max(live, key=lambda e: credit[e])  # ties: first in sorted order
            credit[env] -= total
            yield env, int(orders[env][taken[env]])
            taken[env] += 1
            if taken[env] == len(orders[env]):
                live.remove(env)
                credit.pop(env)

    def epoch_size(self, weights: Mapping[str, float]) -> int:
        return sum(self.count(e) for e in self.envs if weights.get(e, 0.0) > 0)

    def fingerprint(self, seed: int, weights: Mapping[str, float]) -> str:
        """Changes whenever the order of any epoch would change."""
        mix = ",".join(f"{e}={weights.get(e, 0.0)!r}" for e in self.envs)
        return f"{self.digest}:seed={seed}:{mix}"


def _check_line(line: bytes, configured: Mapping[str, float], where: str, errors: list[str]) -> str | None:
    try:
        task = decode_task_json(line)
    except (SchemaError, UnicodeDecodeError) as exc:
        errors.append(f"{where}: {exc}")
        return None
    if task.env not in configured:
        errors.append(f"{where}: task {task.id!r} is for environment {task.env!r}, which is not configured")
        return None
    return task.env


class TaskReader:
    """Reads tasks back by byte offset (one open file, seeks)."""

    def __init__(self, path: Path):
        self._fh = open(path, "rb")

    def read(self, offset: int) -> Task:
        self._fh.seek(offset)
        return decode_task_json(self._fh.readline())

    def close(self) -> None:
        self._fh.close()
