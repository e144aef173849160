"""The drift per lag (pipeline/learning/drift.py), the per-token versions it reads through slime's
conversion, and the tiny policy's held-out problems (workers/sim/arith.py): disjoint from every
train and warm-start problem, and at least 200 of them."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from pipeline.learning.drift import TIS_CLIP, DriftTally, lag_drift, token_versions
from pipeline.slime.samples import from_trainer_group, to_trainer_group
from pipeline.store.buffer import Entry
from pipeline.synthetic import make_group


def test_each_token_counts_at_its_own_lag_with_slimes_tis_clip():
    """Trainer at version 5: a sample whose tokens are of versions 5, 4 and 3 (a call that lived
    through two pushes) lands at lags 0, 1 and 2; masked and version -1 tokens are not counted."""
    tally = DriftTally()
    rollout = [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
    diffs = [0.0, 0.1, -0.3, 1.0, 5.0, 9.0]  # current - rollout
    recomputed = [r + d for r, d in zip(rollout, diffs)]
    mask = [1, 1, 1, 1, 1, 0]
    versions = [5, 4, 4, 3, -1, 3]
    tally.add_step(5, [recomputed], [rollout], [mask], [versions])
    rows = {r.lag: r for r in tally.table()}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0].tokens == 1 and rows[0].mean_abs_dlogp == 0.0 and rows[0].ess == pytest.approx(1.0)
    one = rows[1]
    assert one.tokens == 2 and one.mean_abs_dlogp == pytest.approx(0.2)
    w = np.exp([0.1, -0.3])
    assert one.share_outside == pytest.approx(0.5)  # exp(0.1) = 1.105 inside 0.2, exp(-0.3) = 0.74 outside
    assert one.ess == pytest.approx(w.sum() ** 2 / (2 * (w**2).sum()))
    assert one.tis_clipped == 0.0
    two = rows[2]  # exp(1.0) = 2.72 > slime's --tis-clip 2: clamped
    assert two.tokens == 1 and two.tis_clipped == 1.0 and math.exp(1.0) > TIS_CLIP


def test_ess_falls_as_one_token_carries_the_weight():
    even = lag_drift(1, np.zeros(100))
    skewed = lag_drift(1, np.array([3.0] + [0.0] * 99))
    assert even.ess == pytest.approx(1.0) and skewed.ess < 0.3


def test_token_versions_from_runs_else_one_per_turn():
    assert token_versions(4, [[3, 1], [4, 3]], ["9"], [1, 1, 1, 1]) == [3, 4, 4, 4]
    # no runs: a two-turn mask takes its calls' versions turn by turn, the observation -1
    assert token_versions(5, None, ["2", "3"], [1, 1, 0, 1, 1]) == [2, 2, -1, 3, 3]
    assert token_versions(3, [], ["2", "3"], [1, 1, 1]) is None  # two calls for one turn: no way to tell
    with pytest.raises(ValueError, match="cover 2 tokens of a 3-token response"):
        token_versions(3, [[1, 2]], None, [1, 1, 1])
    with pytest.raises(ValueError, match="sample 0 has 2 recomputed"):
        DriftTally().add_step(1, [[0.0, 0.0]], [[0.0]], [[1]], [[0]])


def test_per_token_versions_cross_slimes_conversion_and_come_back():
    """The conversion carries each sample's `token_version_runs` (the drift reads them in
    slime's samples) and a sample handed back keeps them."""
    group = make_group("g:1", n=2, response_len=6)
    runs = [(3, 2), (4, 4)]
    group = msgspec.structs.replace(group, samples=[msgspec.structs.replace(s, token_version_runs=runs)
                                                    for s in group.samples])
    samples = to_trainer_group(Entry("1-0", group), 0)
    assert [s.metadata["token_version_runs"] for s in samples] == [[[3, 2], [4, 4]]] * 2
    assert token_versions(6, samples[0].metadata["token_version_runs"], samples[0].weight_versions,
                          samples[0].loss_mask) == [3, 3, 4, 4, 4, 4]
    back = from_trainer_group(samples)
    assert [list(s.token_version_runs) for s in back.samples] == [runs, runs]
    assert all("token_version_runs" not in s.metadata for s in back.samples)


def test_held_out_problems_are_disjoint_from_train_and_warm_start_items(tmp_path):
    """At least 200 held-out problems; no held-out fact (operator and operands, either order) is a
    train problem or in the warm start's data; the task files `rollout prepare` writes agree."""
    import json

    from scripts.tiny_tasks import prepare_tasks
    from workers.sim.arith import HELD_OUT, fact, problems, warm_start_rows

    rows = problems()
    held = {q for q, _, h in rows if h}
    train = {q for q, _, h in rows if not h}
    assert len(held) >= HELD_OUT >= 200
    assert {fact(q) for q in held}.isdisjoint({fact(q) for q in train})
    warm = {q for q, _, _ in warm_start_rows()}
    assert warm == train and {fact(q) for q in warm}.isdisjoint({fact(q) for q in held})
    tasks, heldout = prepare_tasks(tmp_path)

    def questions(path):
        return {json.loads(line)["prompt"] if isinstance(json.loads(line)["prompt"], str)
                else json.loads(line)["prompt"][-1]["content"] for line in path.read_text().splitlines() if line}

    assert len(questions(heldout)) == len(held) and questions(heldout) == held
    assert questions(tasks) == train
