"""What a weight push does to the requests running on the engines: SGLang's pause modes.

slime's updaters push weights to every engine as pause -> flush -> update -> continue
(`slime/backends/megatron_utils/update_weight/update_weight_from_{distributed,tensor}.py`,
`slime/ray/actor_group.py` for the disk path), and slime's `SGLangEngine.pause_generation` posts
`{}`: SGLang's default mode, `abort`. The mode is a `PauseGenerationReqInput.mode` of SGLang 0.5.23
(`io_struct.py`; `TokenizerManager.pause_generation`, `Scheduler.pause_generation`):

- `abort`: every running request is answered at once (finish `abort`, its partial output); the
  pipeline's episode runner sends it again from those tokens, which re-prefills prompt + output.
- `retract`: the running requests go back to SGLang's waiting queue with their output and their KV
  is freed; a paused engine counts as idle with a waiting queue (`is_fully_idle(ignore_waiting=
  paused)`), so slime's flush succeeds, and after `continue_generation` they re-prefill on the new
  weights and go on. The client sees one answer, without a round trip.
- `in_place`: nothing moves; the requests keep their KV and go on after `continue_generation`.
  SGLang refuses a flush while requests hold KV (`flush_cache` answers 400 and slime's
  `SGLangEngine.flush_cache` retries it 60 times, then raises), so under `in_place` the flush is
  skipped: the KV the earlier weights computed (the running requests' and the radix cache's
  prefixes) is attended by tokens the new weights generate. Their log-probs are what the engine
  computed (slime's TIS weighs by them); the pipeline's staleness check counts every token of a
  call at the call's stamp, the oldest weights any of its tokens could depend on
  (docs/architecture.md, "Off-policy control"). slime's disk updater sends SGLang's default
  `flush_cache: true` with the update, which SGLang refuses under `in_place`: use `retract` there.

Under `retract` and `in_place` a request that lives through a push answers with weight-version
spans (`meta_info.weight_versions`); workers record them per token (`Sample.token_version_runs`).

How it is set: `ROLLOUT_PUSH_MODE` = abort | retract | in_place in the environment of slime's Ray
job, with `worker_process_setup_hook` = `pipeline.slime.weight_push.ray_worker_setup` in its runtime env
(scripts/run_slime_grpo.sh does both): Ray runs the hook in every worker process before any actor,
and it makes slime's `SGLangEngine` send the mode (`install`). The test harness's stand-in of
slime's updater and the benchmarks push through `push_weights` with the same modes.
"""

from __future__ import annotations

import enum
import json
import os
import urllib.request
from collections.abc import Iterable
from typing import Any

PUSH_MODE_ENV = "ROLLOUT_PUSH_MODE"
_HTTP_TIMEOUT_S = 60.0


class PushMode(str, enum.Enum):
    ABORT = "abort"  # SGLang's default and slime's: running requests are answered, workers resume them
    RETRACT = "retract"  # running requests wait in the engine, KV freed, re-prefilled on the new weights
    IN_PLACE = "in_place"  # running requests keep their KV and go on; no flush

    @property
    def keeps_requests(self) -> bool:
        return self is not PushMode.ABORT


def parse_push_mode(text: str | PushMode, where: str = PUSH_MODE_ENV) -> PushMode:
    """`text` as a PushMode, or a ValueError naming `where` and the choices."""
    try:
        return PushMode(text)
    except ValueError:
        choices = ", ".join(m.value for m in PushMode)
        raise ValueError(f"{where}: unknown weight-push mode {text!r}; one of {choices}") from None


def pause_body(mode: PushMode) -> dict[str, str]:
    """The `/pause_generation` body: `{}` for abort (what slime sends), else the mode."""
    return {} if mode is PushMode.ABORT else {"mode": mode.value}


def post_json(url: str, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as reply:
        reply.read()


def push_weights(engine_urls: Iterable[str], label: str, mode: PushMode | str = PushMode.ABORT) -> None:
    """slime's weight push as the engines see it, the weights stood in for by a label: on each
    engine pause (in `mode`), `/update_weight_version` (the new label; `abort_all_requests` false,
    as slime's update calls send it: the pause decided what happens to running requests),
    continue. For the test harness and the benchmarks; a real trainer pushes through slime."""
    mode = parse_push_mode(mode, "push_weights mode")
    for url in engine_urls:
        post_json(url, "/pause_generation", pause_body(mode))
        post_json(url, "/update_weight_version", {"new_version": label, "abort_all_requests": False})
        post_json(url, "/continue_generation", {})


def install(mode: PushMode | str, engine_cls: Any = None) -> None:
    """Make slime's `SGLangEngine` (or `engine_cls`) pause in `mode`, and skip the flush that
    SGLang refuses while requests keep their KV (`in_place`). Idempotent; `abort` restores
    slime's own methods."""
    mode = parse_push_mode(mode)
    if engine_cls is None:
        from slime.backends.sglang_utils.sglang_engine import SGLangEngine

        engine_cls = SGLangEngine
    originals = engine_cls.__dict__.get("_rollout_push_originals")
    if originals is None:
        originals = {name: engine_cls.__dict__[name] for name in ("pause_generation", "flush_cache")}
        engine_cls._rollout_push_originals = originals
    for name, method in originals.items():
        setattr(engine_cls, name, method)
    if mode is PushMode.ABORT:
        return
    body = pause_body(mode)

    def pause_generation(self: Any) -> None:
        if self.node_rank != 0:  # as slime's: only the engine's first node serves HTTP
            return
        post_json(f"http://{self.server_host}:{self.server_port}", "/pause_generation", body)

    pause_generation.__doc__ = f"slime's pause, in SGLang's {mode.value} mode (pipeline.slime.weight_push)."
    engine_cls.pause_generation = pause_generation
    if mode is PushMode.IN_PLACE:
        flush = originals["flush_cache"]

        def flush_cache(self: Any) -> None:
            if getattr(self, "_rollout_paused_in_place", False):
                return  # SGLang refuses it while the paused requests hold KV
            flush(self)

        def paused_in_place(self: Any) -> None:
            pause_generation(self)
            self._rollout_paused_in_place = True

        original_continue = engine_cls.continue_generation

        def continue_generation(self: Any) -> Any:
            self._rollout_paused_in_place = False
            return original_continue(self)

        engine_cls.pause_generation = paused_in_place
        engine_cls.flush_cache = flush_cache
        if "continue_generation" not in originals:
            originals["continue_generation"] = original_continue
        engine_cls.continue_generation = continue_generation


def ray_worker_setup() -> None:
    """Ray's `worker_process_setup_hook`: install `ROLLOUT_PUSH_MODE` (unset or abort: nothing)
    where slime is importable (every worker process of the job runs it, trainers too)."""
    mode = parse_push_mode(os.environ.get(PUSH_MODE_ENV) or PushMode.ABORT)
    if mode is PushMode.ABORT:
        return
    try:
        import slime.backends.sglang_utils.sglang_engine  # noqa: F401
    except ImportError:
        return  # a process without slime's engine code has no weight push to shape
    install(mode)
