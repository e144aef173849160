"""The oracle of the training signal: a real policy learns through the whole path, and the
controls that break the signal do not (docs/architecture.md "The tiny policy").

producer -> arq -> workers (math env: \\boxed{} + math-verify) -> smg -> SGLang's front -> the
simulator's scheduler serving the tiny LM (workers/sim/tinylm.py) -> redis-server buffer ->
slime's own train.py (tests/slime_loop_helpers.py) -> slime's RolloutManager conversion -> the
CPU actor running slime's advantage and loss code (tests/cpu_actor.py) -> weights pushed with
/update_weights_from_disk -> held-out accuracy through the pipeline's own eval.

Learning is counted in trainer steps, never in seconds, so a loaded machine is slower, not
flakier. The margin: the run that learns must gain `MARGIN` held-out accuracy over its own
start within `STEPS` steps. One eval round (40 held-out tasks x 4 samples) has a standard error
of about 0.035; the learning run gains ~0.3 in 10 steps (sync in `rollout bench --sections learn`:
+0.34 to +0.39 in 12 steps over 3 seeds, docs/benchmarks.md "Learning"), and controls (a) and
(b) fall to ~0, so `MARGIN` (0.15) is about four noise widths from either side. Each control runs
the same steps and must stay below it: one that learned would fail this test. The warm start is
built once per machine (~60 s of one core; tests/learning.py `warm_checkpoint`).
"""

from __future__ import annotations

import pytest
from engine_stack import START_TIMEOUT_S
from test_conformance_slime import slime  # noqa: F401  (slime's classes under pipeline.slime)

pytestmark = pytest.mark.conformance

STEPS = 10
MARGIN = 0.15


@pytest.fixture(scope="module")
def learn_setup(tmp_path_factory):
    """The task set (`rollout prepare`) and the warm-started tiny LM, once for the module."""
    pytest.importorskip("torch")
    import json

    from learning import prepare_tasks, warm_checkpoint

    root = tmp_path_factory.mktemp("learn")
    tasks, heldout = prepare_tasks(root / "tasks")
    warm = warm_checkpoint()
    info = json.loads((warm / "warm_start.json").read_text())
    assert 0.10 <= info["accuracy"] <= 0.50, info  # at temperature 1, before RL
    return warm, tasks, heldout


async def _learn(slime, monkeypatch, tmp_path, redis_url, namespace, learn_setup, **controls):  # noqa: F811
    import asyncio

    from cpu_actor import Controls
    from engine_stack import shared_stack
    from learning import LearnRun, run_learning

    warm, tasks, heldout = learn_setup
    stack = await asyncio.to_thread(shared_stack)
    await asyncio.to_thread(stack.configure, policy_path=str(warm))
    try:
        run = LearnRun(steps=STEPS, eval_interval=STEPS, controls=Controls(**controls))
        result = await run_learning(run, slime=slime, monkeypatch=monkeypatch, workdir=tmp_path, redis_url=redis_url,
                                    ns=namespace, engine_url=stack.router_url, engine_urls=stack.engine_urls,
                                    warm=warm, tasks=tasks, heldout=heldout)
    finally:
        await asyncio.to_thread(stack.configure)  # the scripted policy back for the next test
    print(f"\nheld-out accuracy {result.accuracy} ({controls or 'no control'}; {result.wall_s:.1f}s)")
    return result.accuracy[STEPS] - result.accuracy[0], result


@pytest.mark.timeout(START_TIMEOUT_S + 180)
@pytest.mark.parametrize("control", [None, "wrong_sign", "mask_shift"])
async def test_a_real_policy_learns_through_the_pipeline_and_broken_signals_do_not(
        slime, monkeypatch, tmp_path, redis_url, namespace, learn_setup, control):  # noqa: F811
    """The run that learns gains at least MARGIN held-out accuracy in STEPS steps; (a)
    advantages of the wrong sign and (b) the loss window one token off (each trained position
    scores the token before it) gain less than MARGIN: a control that passed would fail here."""
    controls = {control: True} if control else {}
    gain, result = await _learn(slime, monkeypatch, tmp_path, redis_url, namespace, learn_setup, **controls)
    assert all(m["loss"] == m["loss"] for m in result.metrics), "a NaN loss"  # noqa: PLR0124
    assert result.two_turn_samples > 0, "no two-turn episode was trained (masks across turns not exercised)"
    if control is None:
        assert gain >= MARGIN, f"the policy did not learn: {result.accuracy}"
    else:
        assert gain < MARGIN, f"control {control} learned as the real signal does: {result.accuracy}"
