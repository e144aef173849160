"""slime's loop law in `pipeline/staleness.py`, checked against a replay of the pinned snapshot's
two loops (../shared/third_party/slime/train.py and train_async.py), written out step by step:

    train.py:        update_weights(); for r: generate(r); train(r); update_weights()
    train_async.py:  update_weights(); f = generate(start)
                     for r: get(f); f = generate(r + 1); train(r)
                            if (r + 1) % interval == 0: get(f); f = None; update_weights()

(generate(r + 1) is launched at the top of every iteration, after the previous push). train.py
never reads `--update-weights-interval`. tests/conformance/test_conformance_slime.py executes the files
themselves; this replay covers every start, interval and rollout in milliseconds.
"""

from __future__ import annotations

import pytest

from pipeline.staleness import TrainerLoop, engine_policy_version, label_versions, lag_floor, pushed_versions


def replay(loop: TrainerLoop, *, start: int, interval: int, end: int) -> tuple[dict[int, list[int]], list[int]]:
    """{rollout id: versions pushed before slime called generate(rollout id)}, and every push in order."""
    pushes: list[int] = []
    seen: dict[int, list[int]] = {}

    def push(version: int) -> None:
        pushes.append(version)

    def generate(rid: int) -> None:
        seen[rid] = list(pushes)

    push(start)
    if loop is TrainerLoop.SYNC:
        for r in range(start, end):
            generate(r)
            push(r + 1)  # train(r); update_weights(): every step
        return seen, pushes
    generate(start)
    for r in range(start, end):
        if r + 1 < end:
            generate(r + 1)  # at the top of iteration r: after the push of iteration r - 1, before train(r)
        if (r + 1) % interval == 0:
            push(r + 1)  # train(r), then wait for generate(r + 1), then update_weights()
    return seen, pushes


@pytest.mark.parametrize("loop", list(TrainerLoop))
@pytest.mark.parametrize("interval", [1, 2, 3])
@pytest.mark.parametrize("start", [0, 1, 4])
def test_pushed_versions_and_labels_follow_slimes_loops(loop, interval, start):
    seen, pushes = replay(loop, start=start, interval=interval, end=start + 9)
    for rid, before in seen.items():
        assert pushed_versions(rid, start=start, interval=interval, loop=loop) == before, rid
        assert engine_policy_version(rid, start=start, interval=interval, loop=loop) == before[-1]
        labels = label_versions(rid, start=start, interval=interval, loop=loop, first_label=3)
        # slime's updater labels the k-th push of the process str(first_label + k): the map is the truth
        truth = {str(3 + k): version for k, version in enumerate(pushes)}
        assert all(truth[label] == version for label, version in labels.items() if label in truth), (rid, labels)


def test_train_py_pushes_every_step_whatever_the_interval():
    assert pushed_versions(3, start=0, interval=2, loop=TrainerLoop.SYNC) == [0, 1, 2, 3]
    assert label_versions(1, start=0, interval=2, loop=TrainerLoop.SYNC) == {"1": 0, "2": 1, "3": 2}
    assert pushed_versions(3, start=0, interval=2, loop=TrainerLoop.ASYNC) == [0, 2]


def test_lag_floor_of_each_loop():
    assert [lag_floor(interval=k, loop=TrainerLoop.SYNC) for k in (1, 2, 4)] == [0, 0, 0]
    assert [lag_floor(interval=k, loop=TrainerLoop.ASYNC) for k in (1, 2, 4)] == [1, 2, 4]
