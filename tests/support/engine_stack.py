"""The suite's engine stack: smg (or sglang-router) -> SGLang's own HTTP front -> the project's
simulator as the scheduler, started by the product's launcher (workers/sim/stack.py; the front
process is workers/sim/sglang_front.py, which says what of SGLang runs), which the learning
oracle's bench and `rollout check-signal` run too.

Here: the test session's shared stack (`shared_stack()`, reconfigured per test with
`stack.configure(...)`; one stack start per session keeps CI fast) and `require_stack_parts`
(skip, or fail under ROLLOUT_REQUIRE_CONFORMANCE=1, when SGLang or a router is missing). A test
that kills or restarts engines starts its own with `engines_per_process=1`.
"""

from __future__ import annotations

import atexit
import shutil
from pathlib import Path

from workers.sim.sglang_front import model_dir as _model_dir  # noqa: F401  (tests import it from here)
from workers.sim.stack import (  # noqa: F401  (the tests import them from here)
    START_TIMEOUT_S,
    EngineStack,
    async_engine_stack,
    engine_stack,
    free_port,
    missing_parts,
    start_engine_stack,
    start_router,
)

_SHARED: list[EngineStack] = []
SHARED_MODEL_CONTEXT = 4096  # a Qwen2.5-Math-sized model; the engines get no --context-length, as slime's
SPARE_CONTEXT = 2048  # the shared stack's spare engine's --context-length


def shared_stack() -> EngineStack:
    """The test session's stack, started on first use and stopped at exit: two engines (SGLang
    fronts over simulators, seeds 0 and 1) at a 4096-token model context without
    --context-length, with --enable-priority-scheduling (larger values first, SGLang's default), behind smg (`router_url`) and sglang-router 0.3.2
    (`router_urls["sglang-router"]`), and a spare engine at --context-length SPARE_CONTEXT behind
    neither (`spare_urls[0]`, in the same process). A test starts with `configure(...)` (the simulator's
    behaviour, a clean slate of counters); one stack start per session keeps CI fast."""
    if _SHARED and all(p.poll() is None for p in _SHARED[0].processes):
        return _SHARED[0]
    require_stack_parts("smg")
    require_stack_parts("sglang-router")
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="engine-stack-"))
    stack = start_engine_stack(tmp, 2, model_context=SHARED_MODEL_CONTEXT, router=("smg", "sglang-router"),
                               sim={"priority_scheduling": True}, spares=(SPARE_CONTEXT,))
    print(f"\nengine stack (2 SGLang fronts, smg, sglang-router) started in {stack.startup_s:.1f}s ({tmp})")
    _SHARED[:] = [stack]
    atexit.register(_stop_and_remove, stack, tmp)
    return stack


def _stop_and_remove(stack: EngineStack, tmp: Path) -> None:
    stack.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def require_stack_parts(router: str = "smg") -> None:
    """Skip (or fail under ROLLOUT_REQUIRE_CONFORMANCE=1) when SGLang or the router is missing."""
    from tests.support.conformance_support import unavailable

    reason = missing_parts(router)
    if reason is not None:
        unavailable(reason)
