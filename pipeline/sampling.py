"""SGLang 0.5.23's rules for `sampling_params`, so a bad value fails at config load.

Read from `sglang/srt/sampling/sampling_params.py` (`SamplingParams.__post_init__`,
`verify`, `normalize`): SGLang answers HTTP 400 to a request that breaks one, and every
episode of a run would fail. `sampling_errors` applies them to a plain dict the way the
engine does (None means "SGLang's default"), so it serves both the client's config check
(`pipeline.schema.SamplingParams`) and the simulated engine's request check
(workers/sim/http_front.py). tests/conformance/test_conformance_sglang.py compares its verdicts with
SGLang's own class.

One rule is the pipeline's, not SGLang's: `n` must be 1. With n > 1 SGLang answers a JSON
array of n completions for one request; the pipeline runs each of a group's episodes as
its own request (`n_samples_per_prompt`), so a multi-turn episode never forks.

`wire_errors` adds what the router in front of the engines refuses although SGLang accepts it
(slime launches sglang-router; smg 1.13.0, its successor, parses the body into typed fields and
answers 422 text/plain): a negative `sampling_seed` (u64 there, i64 in SGLang) and a float
where an integer belongs. `pipeline.schema.SamplingParams` checks both on every instance,
the per-turn copies the episode runner makes included, so such a body is never sent.

Seeds (SGLang 0.5.23, `sampling_batch_info.py`, `layers/sampler.py`): `sampling_seed` is read
only when the engine runs `--enable-deterministic-inference`, and then every request is
sampled with its seed (42 when it sends none), hashed with the token position: one seed for
a whole group makes its samples identical. Without that flag the seed does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MAX_STOP_COUNT = 32  # sampling_params.MAX_STOP_COUNT
_EPS = 1e-6  # sampling_params._SAMPLING_EPS: a temperature below it means greedy
_INT64 = 2**63
SEED_MAX = _INT64 - 1  # the largest seed both SGLang (i64) and the router (u64) take
# keys the router parses as integers: a float there (8.0) is a 422, though SGLang casts it
_WIRE_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed")


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key)
    return default if value is None else value


def sampling_errors(params: Mapping[str, Any], *, pipeline: bool = True) -> list[str]:
    """Why SGLang would refuse these sampling params (empty: it accepts them).

    `pipeline=True` adds the pipeline's own rule (n == 1).
    """
    errors: list[str] = []
    temperature = _number(params, "temperature", 1.0)
    if not math.isfinite(temperature) or temperature < 0.0:
        errors.append(f"temperature must be a non-negative finite number, got {temperature}")
    top_p = _number(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        errors.append(f"top_p must be in (0, 1], got {top_p}")
    min_p = _number(params, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        errors.append(f"min_p must be in [0, 1], got {min_p}")
    top_k = int(_number(params, "top_k", -1))
    greedy = 0 <= temperature < _EPS  # SGLang then sets top_k = 1 before verifying
    if not greedy and top_k != -1 and top_k < 1:
        errors.append(f"top_k must be -1 (disable) or at least 1, got {top_k}")
    for key in ("frequency_penalty", "presence_penalty"):
        value = _number(params, key, 0.0)
        if not -2.0 <= value <= 2.0:
            errors.append(f"{key} must be in [-2, 2], got {value}")
    repetition = _number(params, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= 2.0:
        errors.append(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}")
    min_new = int(_number(params, "min_new_tokens", 0))
    max_new = params.get("max_new_tokens", 128)
    if min_new < 0:
        errors.append(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}")
    if max_new is not None:
        if max_new < 0:
            errors.append(f"max_new_tokens must be at least 0, got {max_new}")
        elif min_new > max_new:
            errors.append(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}")
    seed = params.get("sampling_seed")
    if seed is not None and not -_INT64 <= seed <= _INT64 - 1:
        errors.append(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}")
    grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if params.get(k)]
    if len(grammars) > 1:
        errors.append(f"only one of json_schema, regex, ebnf, or structural_tag can be set, got {', '.join(grammars)}")
    stop = params.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_COUNT:
        errors.append(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop)}")
    n = params.get("n")
    if pipeline and n is not None and n != 1:
        errors.append(
            f"n must be 1, got {n}: each episode is its own request; set rollout.n_samples_per_prompt for the group size"
        )
    elif n is not None and n < 1:
        errors.append(f"n must be at least 1, got {n}")
    return errors


def wire_errors(params: Mapping[str, Any]) -> list[str]:
    """Why the router in front of the engines would refuse these params though SGLang takes
    them: an integer key that is not an int, a seed outside [0, 2**63 - 1]."""
    errors = [
        f"{key} must be an integer, got {value!r}"
        for key in _WIRE_INTS
        if (value := params.get(key)) is not None and (isinstance(value, bool) or not isinstance(value, int))
    ]
    seed = params.get("sampling_seed")
    if isinstance(seed, int) and not 0 <= seed <= SEED_MAX:
        errors.append(
            f"sampling_seed must be in [0, 2**63 - 1], got {seed}: slime's router reads it as an unsigned "
            "integer (a negative one is a 422) and SGLang as a signed 64-bit one"
        )
    return errors


def seed_errors(seed: int | None, *, n_samples: int, deterministic: bool, key: str = "rollout.sampling.sampling_seed",
                switch: str = "set engine.deterministic_inference: true") -> list[str]:
    """A configured `sampling_seed` against the engines: whether it can do anything, and room
    for every sample's own seed (`seed + sample index`, slime's `rollout_seed + i`). `key` names
    the seed in the messages, `switch` what says the engines run deterministic inference."""
    if seed is None:
        if deterministic:
            return [
                f"engine.deterministic_inference is true but {key} is not set: SGLang "
                "then seeds every request with 42 and all samples of a group come out identical; set a seed "
                "(each sample adds its index to it)"
            ]
        return []
    if not deterministic:
        return [
            f"{key} {seed} does nothing: SGLang reads it only on engines started with "
            "--enable-deterministic-inference (slime: --sglang-enable-deterministic-inference); if they are, "
            f"{switch}, else remove the seed"
        ]
    if seed > SEED_MAX - (n_samples - 1):
        return [f"{key} {seed} + sample index {n_samples - 1} exceeds 2**63 - 1"]
    return []
    if not deterministic:
        return [
            f"rollout.sampling.sampling_seed {seed} does nothing: SGLang reads it only on engines started with "
            "--enable-deterministic-inference (slime: --sglang-enable-deterministic-inference); if they are, "
            "set engine.deterministic_inference: true, else remove the seed"
        ]
    if seed > SEED_MAX - (n_samples - 1):
        return [f"rollout.sampling.sampling_seed {seed} + sample index {n_samples - 1} exceeds 2**63 - 1"]
    return []
