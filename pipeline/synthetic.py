"""Synthetic, contract-valid groups for smoke runs, benchmarks and tests."""

from __future__ import annotations

import numpy as np

from pipeline.schema import Sample, SampleGroup, Status, Task


def make_group(
    group_id: str,
    *,
    n: int = 4,
    prompt_len: int = 64,
    response_len: int = 256,
    admission_version: int = 0,
    env: str = "synthetic",
    rewards: list[float] | None = None,
    seed: int = 0,
) -> SampleGroup:
    rng = np.random.default_rng(seed)
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(n)]
    samples = []
    for i in range(n):
        tokens = rng.integers(0, 150_000, size=prompt_len + response_len, dtype=np.int32)
        mask = np.ones(response_len, dtype=np.uint8)
        log_probs = -rng.random(response_len, dtype=np.float32)
        samples.append(
            Sample.build(
                tokens=tokens, response_length=response_len, loss_mask=mask, rollout_log_probs=log_probs,
                reward=rewards[i], status=Status.COMPLETED, weight_versions=[str(admission_version)],
                prompt="synthetic prompt", response="synthetic response", label="1",
                metadata={"turns": 1},
            )
        )
    task = Task(id=group_id.rsplit(":", 1)[0], env=env, prompt="synthetic prompt", label="1")
    return SampleGroup(
        group_id=group_id, task=task, admission_version=admission_version, n_samples=n, samples=samples,
        worker_id="synthetic",
    )
