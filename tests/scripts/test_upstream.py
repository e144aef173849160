"""Where the conformance tests look for the pinned upstream snapshots (scripts/upstream.py): the
variables, then ../shared/third_party beside the checkout; never one machine's absolute path."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import upstream
from tests.support import conformance_support


@pytest.fixture
def no_locations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for pinned in upstream.PINNED:
        monkeypatch.delenv(pinned.env_var, raising=False)
    monkeypatch.setenv(upstream.THIRD_PARTY_ENV, str(tmp_path))
    monkeypatch.delenv(conformance_support.REQUIRE_ENV, raising=False)
    return tmp_path


def test_the_folder_variable_and_each_snapshots_own_variable(no_locations: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (no_locations / "slime" / "slime").mkdir(parents=True)
    assert upstream.snapshot_path("slime") == (no_locations / "slime").resolve()
    assert upstream.is_present("slime") and not upstream.is_present("nemo_rl")
    elsewhere = no_locations / "elsewhere"
    (elsewhere / "nemo_rl").mkdir(parents=True)
    monkeypatch.setenv("NEMO_RL_PATH", str(elsewhere))
    assert upstream.is_present("nemo_rl")
    assert upstream.main(["where"]) == 1  # nemo_skills is missing


def test_without_variables_only_the_sibling_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    for pinned in upstream.PINNED:
        monkeypatch.delenv(pinned.env_var, raising=False)
    monkeypatch.delenv(upstream.THIRD_PARTY_ENV, raising=False)
    sibling = upstream.REPO.parent / "shared" / "third_party"
    for pinned in upstream.PINNED:
        assert upstream.snapshot_path(pinned.name) == (sibling / pinned.name).resolve()


def test_a_missing_snapshot_skips_with_the_pinned_commit_and_the_command(no_locations: Path) -> None:
    with pytest.raises(pytest.skip.Exception) as skipped:
        conformance_support.require_slime()
    reason = str(skipped.value)
    assert str(no_locations / "slime") in reason
    assert upstream.BY_NAME["slime"].commit[:12] in reason
    assert "scripts/run_conformance.sh" in reason and "SLIME_PATH" in reason


def test_a_missing_snapshot_fails_when_conformance_is_required(no_locations: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(conformance_support.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no nemo_skills snapshot"):
        conformance_support.require_nemo_skills()
