"""Whether the sandbox's probes (tests/workers/test_sandbox.py, tests/workers/test_env_code.py) may skip.

A probe that needs a namespace this host does not give skips locally, with the level in effect
as its reason. With `ROLLOUT_REQUIRE_SANDBOX=1` (set by `.ci/run`) nothing skips: the probes
run and fail where the sandbox cannot hold, and `test_env_code.py::
test_the_sandbox_has_its_full_isolation_where_required` names what is missing, so CI is
never green without them.
"""

from __future__ import annotations

import os

import pytest

from workers.envs.sandbox import probe_isolation

REQUIRE_ENV = "ROLLOUT_REQUIRE_SANDBOX"
ISOLATION = probe_isolation()


def sandbox_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() in ("1", "true", "yes")


def needs(available: bool, what: str) -> pytest.MarkDecorator:
    """Skip when `what` is not `available` here, unless the sandbox is required (then it runs)."""
    return pytest.mark.skipif(
        not available and not sandbox_required(), reason=f"{what} (isolation: {ISOLATION.summary}; {REQUIRE_ENV} unset)"
    )
