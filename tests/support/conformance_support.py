"""Conformance tests run upstream code (slime, SGLang, NeMo-RL, NeMo-Skills) against this pipeline.

The upstream packages are test-only: slime, NeMo-RL and NeMo-Skills come from the pinned
snapshots that `scripts/upstream.py` locates (`$SLIME_PATH`, `$NEMO_RL_PATH`, `$NEMO_SKILLS_PATH`,
else `$ROLLOUT_THIRD_PARTY/<name>`, else `<repo>/../shared/third_party/<name>`; it also fetches
them: `scripts/run_conformance.sh`), put on `sys.path` here and nowhere else; SGLang, torch, ray and
megatron-core are installed by `.ci/run` (`pip install torch==2.13.0` then `-e ".[test,conformance]"`).

Each `require_*()` imports what a test needs and skips the test with the reason when it
cannot. With `ROLLOUT_REQUIRE_CONFORMANCE=1` (set by `.ci/run`) a missing upstream FAILS the
test instead: CI must never pass because conformance silently did not run.

One stub, in `require_sglang()` only: `torchvision`, while `sglang.srt.managers.io_struct`
imports (workers/sim/sglang_front.py `import_with_stubs` says why and how; the engine stack's
front process imports SGLang's server with it too).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from typing import NoReturn

import pytest

from scripts import upstream
from workers.sim import stack
from workers.sim.sglang_front import import_with_stubs as _import_with_stubs

REPO = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "ROLLOUT_REQUIRE_CONFORMANCE"


def conformance_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip (locally) or fail (CI, ROLLOUT_REQUIRE_CONFORMANCE=1) with the reason."""
    if conformance_required():
        pytest.fail(f"conformance dependency missing ({REQUIRE_ENV}=1): {reason}", pytrace=False)
    pytest.skip(f"conformance: {reason}")


def _on_path(name: str) -> Path:
    path = upstream.snapshot_path(name)
    if not upstream.is_present(name):
        pinned = upstream.BY_NAME[name]
        unavailable(
            f"no {name} snapshot at {path} ({pinned.repository} @ {pinned.commit[:12]}; set ${pinned.env_var} "
            f"or ${upstream.THIRD_PARTY_ENV}, or {upstream.FETCH_HINT})"
        )
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


def _import_all(what: str, modules: tuple[str, ...], hint: str) -> list[types.ModuleType]:
    out = []
    for name in modules:
        try:
            out.append(importlib.import_module(name))
        except Exception as exc:  # noqa: BLE001 - ImportError, or an upstream module failing at import
            unavailable(f"cannot import {name} ({what}): {exc.__class__.__name__}: {exc}; {hint}")
    return out


_CONFORMANCE_HINT = 'install with: pip install torch==2.13.0 && pip install -e ".[test,conformance]" (see .ci/run)'

SLIME_MODULES = (
    "torch",
    "slime.utils.types",
    "slime.rollout.data_source",
    "slime.rollout.base_types",
)


def require_slime(*modules: str) -> types.SimpleNamespace:
    """The pinned slime snapshot on sys.path; imports `SLIME_MODULES` and `modules`.

    Returns a namespace with the path, `Sample`, `DataSource`, `RolloutFnTrainOutput` and each
    extra module under its dotted name (`ns.modules["slime.ray.rollout"]`).
    """
    path = _on_path("slime")
    _import_all("slime", SLIME_MODULES, _CONFORMANCE_HINT)
    extra = _import_all("slime", modules, _CONFORMANCE_HINT)
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.rollout.data_source import DataSource
    from slime.utils.types import Sample

    return types.SimpleNamespace(
        path=path, Sample=Sample, DataSource=DataSource, RolloutFnTrainOutput=RolloutFnTrainOutput,
        modules=dict(zip(modules, extra)),
    )


def require_nemo_rl(*modules: str) -> types.SimpleNamespace:
    """The pinned NeMo-RL snapshot on sys.path; imports torch, `nemo_rl` and `modules`.

    torch always: a NeMo-RL environment answers `step` with torch tensors (`EnvironmentReturn`),
    and `import nemo_rl` alone succeeds without it, so a test of an environment of its own
    (no NeMo-RL module beyond the package) would otherwise fail, not skip, without torch."""
    path = _on_path("nemo_rl")
    _import_all("nemo_rl", ("torch",), _CONFORMANCE_HINT)
    mods = _import_all("nemo_rl", ("nemo_rl", *modules), _CONFORMANCE_HINT)
    return types.SimpleNamespace(path=path, modules=dict(zip(("nemo_rl", *modules), mods)))


def require_nemo_skills(*modules: str) -> types.SimpleNamespace:
    path = _on_path("nemo_skills")
    mods = _import_all("nemo_skills", ("nemo_skills", *modules), _CONFORMANCE_HINT)
    return types.SimpleNamespace(path=path, modules=dict(zip(("nemo_skills", *modules), mods)))


# ------------------------------------------------------------------------------ SGLang

SGLANG_VERSION = stack.SGLANG_VERSION


_SGLANG: types.SimpleNamespace | None = None


def require_sglang() -> types.SimpleNamespace:
    """SGLang's own request classes: `GenerateReqInput`, `SamplingParams`, the HTTP contract gate
    (`generate_contract_error`) and `TokenizerManager` (for its validation methods)."""
    global _SGLANG
    if _SGLANG is not None:
        return _SGLANG
    try:
        from importlib.metadata import version

        found = version("sglang")
    except Exception:  # noqa: BLE001
        unavailable(f"sglang is not installed; {_CONFORMANCE_HINT}")
    if found != SGLANG_VERSION:
        unavailable(f"sglang {found} is installed, the conformance tests are written against {SGLANG_VERSION}")
    try:
        io_struct = _import_with_stubs("sglang.srt.managers.io_struct", ("torchvision",))
    except Exception as exc:  # noqa: BLE001
        unavailable(f"cannot import sglang.srt.managers.io_struct: {exc.__class__.__name__}: {exc}; {_CONFORMANCE_HINT}")
    sampling, contract = _import_all(
        "sglang", ("sglang.srt.sampling.sampling_params", "sglang.srt.entrypoints.api_contract"), _CONFORMANCE_HINT
    )
    _SGLANG = types.SimpleNamespace(
        version=found,
        io_struct=io_struct,
        GenerateReqInput=io_struct.GenerateReqInput,
        SamplingParams=sampling.SamplingParams,
        generate_contract_error=contract.generate_contract_error,
    )
    return _SGLANG
