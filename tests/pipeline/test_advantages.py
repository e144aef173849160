"""pipeline.slime.data_source.post_process_rewards: slime's GRPO normalisation over the kept samples."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.slime.data_source import LocalSample, post_process_rewards


def _args(**extra):
    base = dict(advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
                reward_key=None, n_samples_per_prompt=4)
    base.update(extra)
    return SimpleNamespace(**base)


def _samples(rewards, removed=(), group_size=4, with_index=True):
    return [LocalSample(reward=r, remove_sample=i in removed, group_index=i // group_size if with_index else None)
            for i, r in enumerate(rewards)]


def _slime_default(rewards, n, scale=True):
    """slime's RolloutManager._post_process_rewards, in numpy (torch's std is unbiased)."""
    grouped = np.asarray(rewards, dtype=np.float32).reshape(-1, n)
    centred = grouped - grouped.mean(axis=-1, keepdims=True)
    if scale:
        centred = centred / (centred.std(axis=-1, ddof=1, keepdims=True) + 1e-6)
    return centred.flatten().tolist()


def test_without_removed_samples_it_is_slimes_normalisation():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.4, 1.0, 1.0, 1.0, 1.0]
    raw, out = post_process_rewards(_args(), _samples(rewards))
    assert raw == rewards
    assert out == pytest.approx(_slime_default(rewards, 4), abs=1e-5)
    _, unscaled = post_process_rewards(_args(grpo_std_normalization=False), _samples(rewards))
    assert unscaled == pytest.approx(_slime_default(rewards, 4, scale=False), abs=1e-6)
    _, baseline_only = post_process_rewards(_args(advantage_estimator="reinforce_plus_plus_baseline"),
                                            _samples(rewards))
    assert baseline_only == pytest.approx(_slime_default(rewards, 4, scale=False), abs=1e-6)


def test_a_removed_sample_changes_no_siblings_advantage():
    kept = post_process_rewards(_args(n_samples_per_prompt=3), _samples([1.0, 1.0, 0.0], group_size=3))[1]
    assert kept[0] == pytest.approx(0.57735, abs=1e-4)  # slime's default: the failure lifts the others
    for failed_reward in (0.0, 1.0, -5.0):
        _, out = post_process_rewards(_args(n_samples_per_prompt=3),
                                      _samples([1.0, 1.0, failed_reward], removed={2}, group_size=3))
        assert out == [0.0, 0.0, 0.0]  # two equal kept rewards: nothing to learn, whatever the failure got
    _, out = post_process_rewards(_args(), _samples([1.0, 0.0, 7.0, 0.0], removed={2}))
    assert out[2] == 0.0  # the removed sample: no advantage (its loss mask is zero anyway)
    assert [out[0], out[1], out[3]] == pytest.approx(_slime_default([1.0, 0.0, 0.0], 3), abs=1e-5)


def test_edge_groups_give_finite_advantages():
    _, out = post_process_rewards(_args(), _samples([1.0, 0.0, 0.0, 0.0], removed={1, 2, 3}))
    assert out == [0.0, 0.0, 0.0, 0.0]  # one kept sample: no spread, no nan
    _, out = post_process_rewards(_args(), _samples([0.0, 0.0, 0.0, 0.0], removed={0, 1, 2, 3}))
    assert out == [0.0, 0.0, 0.0, 0.0]


def test_groups_follow_group_index_or_fall_back_to_n():
    rewards = [1.0, 0.0, 1.0, 0.5, 0.5, 0.0]
    by_index = [LocalSample(reward=r, group_index=g) for r, g in zip(rewards, [0, 0, 1, 1, 1, 1])]
    _, out = post_process_rewards(_args(), by_index)
    assert out[:2] == pytest.approx(_slime_default([1.0, 0.0], 2), abs=1e-5)
    assert out[2:] == pytest.approx(_slime_default([1.0, 0.5, 0.5, 0.0], 4), abs=1e-5)
    _, out = post_process_rewards(_args(n_samples_per_prompt=3), _samples(rewards, with_index=False))
    assert out == pytest.approx(_slime_default(rewards, 3), abs=1e-5)


def test_dict_rewards_are_read_at_reward_key_and_other_estimators_pass_through():
    samples = [LocalSample(reward={"acc": r, "len": 0.0}, group_index=0) for r in (1.0, 0.0, 0.0, 1.0)]
    raw, out = post_process_rewards(_args(reward_key="acc"), samples)
    assert raw == [1.0, 0.0, 0.0, 1.0] and out == pytest.approx(_slime_default(raw, 4), abs=1e-5)
    raw, out = post_process_rewards(_args(advantage_estimator="ppo"), _samples([1.0, 0.0, 0.0, 1.0]))
    assert out == raw == [1.0, 0.0, 0.0, 1.0]
    raw, out = post_process_rewards(_args(rewards_normalization=False), _samples([1.0, 0.0, 0.0, 1.0]))
    assert out == raw
