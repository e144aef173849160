"""The signal checks catch the signal bugs where they live (docs/signal-bugs.md).

Each planted bug (tests/support/signal_bugs.py) replaces one function of the pipeline's own code (the
samples' conversion, the episode's token bookkeeping) by a variant with the bug, then runs two
sync steps of the learning oracle's whole path (scripts/oracle/run.py `run_learning`: producer,
arq workers, SGLang's front over the simulator serving the warm tiny LM, slime's train.py and
conversion, the CPU actor) and asserts the fast checks of pipeline/learning/signal_check.py FAIL on it:
the check detects the bug within a step, no learning run needed. The clean run passes every
check, so a check that failed everywhere would fail here too.
"""

from __future__ import annotations

import pytest

from tests.conformance.test_conformance_slime import slime  # noqa: F401  (slime's classes under pipeline.slime.data_source)
from tests.support.engine_stack import START_TIMEOUT_S

pytestmark = pytest.mark.conformance

STEPS = 2  # a weight push between them: step 1's samples come from the pushed policy
FAIL_DIVISOR = 2  # the two-turn environment fails on even labels: failed samples in every step


@pytest.fixture(scope="module")
def signal_setup(tmp_path_factory):
    pytest.importorskip("torch")
    from scripts.oracle.run import prepare_tasks, warm_checkpoint

    tasks, heldout = prepare_tasks(tmp_path_factory.mktemp("signal") / "tasks")
    return warm_checkpoint(), tasks, heldout


async def _checked_run(slime, monkeypatch, tmp_path, redis_url, namespace, setup, **run_options):  # noqa: F811
    import asyncio

    from scripts.oracle.run import LearnRun, run_learning
    from tests.support.engine_stack import shared_stack

    warm, tasks, heldout = setup
    stack = await asyncio.to_thread(shared_stack)
    await asyncio.to_thread(stack.configure, policy_path=str(warm))
    rollout = slime.modules["slime.ray.rollout"]
    manager_class = rollout.RolloutManager
    try:
        run = LearnRun(steps=STEPS, batch=8, n=4, eval_interval=None, **run_options)
        # no monkeypatch: the run installs and undoes slime's stand-ins itself (slime_loop.Patches),
        # as the bench and `rollout check-signal` run it without pytest
        result = await run_learning(run, slime=slime, workdir=tmp_path, redis_url=redis_url, ns=namespace,
                                    engine_url=stack.router_url, engine_urls=stack.engine_urls, warm=warm,
                                    tasks=tasks, heldout=heldout)
    finally:
        await asyncio.to_thread(stack.configure)
    assert rollout.RolloutManager is manager_class, "the run left its stand-in for slime's RolloutManager installed"
    return result


def _report(result) -> str:
    return "\n".join(f"step {rid}: abs_diff {s.tokens.abs_diff:.3g} single {s.tokens.abs_diff_single} multi "
                     f"{s.tokens.abs_diff_multi} by turn {s.tokens.abs_diff_by_turn} turns {s.turns} "
                     f"failures {s.failures()}" for rid, s in result.signal.items())


@pytest.mark.timeout(START_TIMEOUT_S + 120)
@pytest.mark.parametrize("fail_divisor", [0, FAIL_DIVISOR], ids=["clean", "with-failed-episodes"])
async def test_the_clean_pipeline_passes_every_signal_check(
        slime, monkeypatch, tmp_path, redis_url, namespace, signal_setup, fail_divisor):  # noqa: F811
    """No bug: every step passes every check, on single- and two-turn samples and per turn (the
    failed episodes of the second case are removed from the loss, as they must be)."""
    result = await _checked_run(slime, monkeypatch, tmp_path, redis_url, namespace, signal_setup,
                                env_fail_divisor=fail_divisor)
    print("\n" + _report(result))
    assert sorted(result.signal) == list(range(STEPS))
    for rid, step in result.signal.items():
        assert not step.failures(), f"step {rid}: {step.failures()}"
        assert step.tokens.abs_diff_single is not None, _report(result)
        if not fail_divisor:  # (with failures, a step's two-turn groups may all have failed)
            assert step.tokens.abs_diff_multi is not None and 2 in step.tokens.abs_diff_by_turn, _report(result)
    if fail_divisor:
        assert any(s.status.value == "failed" for b in result.samples.values() for s in _flat(b)), "no failed sample"


def _flat(batch):
    from scripts.oracle.run import flat_samples

    return flat_samples(batch)


def _bug_ids():
    from tests.support.signal_bugs import BUGS

    return [bug.name for bug in BUGS]


@pytest.mark.timeout(START_TIMEOUT_S + 120)
@pytest.mark.parametrize("name", _bug_ids())
async def test_a_signal_bug_planted_in_the_pipeline_fails_its_check(
        slime, monkeypatch, tmp_path, redis_url, namespace, signal_setup, name):  # noqa: F811
    """The planted bug trips every check its row names, within the first steps."""
    from tests.support.signal_bugs import BUGS

    bug = next(b for b in BUGS if b.name == name)
    bug.plant(monkeypatch)
    result = await _checked_run(slime, monkeypatch, tmp_path, redis_url, namespace, signal_setup,
                                env_fail_divisor=FAIL_DIVISOR if bug.needs_failures else 0)
    print(f"\n{bug.name}:\n" + _report(result))
    tripped = {check for step in result.signal.values() for check in step.failures()}
    missed = [check for check in bug.caught_by if check not in tripped]
    assert not missed, f"{bug.name} ({bug.what}, {bug.layer}) passed {missed}: {_report(result)}"


def test_the_docs_table_lists_every_planted_bug_and_its_checks():
    """docs/signal-bugs.md's tables are the registry: one row per PlantedBug (those the signal checks
    catch and those only learning catches), its layer, and every check it must trip named in the
    row's last column."""
    import re
    from pathlib import Path

    from tests.support.signal_bugs import BUGS, LEARNING_BUGS

    text = (Path(__file__).resolve().parents[2] / "docs" / "signal-bugs.md").read_text()
    rows = {m.group(1): line for line in text.splitlines() if (m := re.match(r"\| `([a-z-]+)` \|", line))}
    assert sorted(rows) == sorted(b.name for b in BUGS + LEARNING_BUGS)
    for bug in BUGS + LEARNING_BUGS:
        cells = [c.strip() for c in rows[bug.name].strip("|").split("|")]
        assert cells[1] == bug.layer, (bug.name, cells[1])
        assert all(check in cells[3] for check in bug.caught_by), (bug.name, cells[3])
