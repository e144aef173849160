"""slime for a learning run outside the tests (`rollout check-signal`'s learning stage): its
pinned snapshot loaded with the pipeline's data source bound to its classes (`load_slime`), and a
user's loss flags read with slime's own argument parser (`loss_flags`).

The flags are slime's command line as a user writes it (`--use-tis --eps-clip 0.2 ...`). slime's
parser (slime/utils/arguments.py `get_slime_extra_args_provider`, without Megatron's) reads them;
the loss arguments (`LOSS_KEYS`: what slime's loss, advantage and reward post-processing read)
start at slime's own defaults, take the flags given, then the rules slime's `slime_validate_args`
applies to them. The rest of a command line is reported, not used: the batch shape, learning rate,
paths and parallelism are the tiny run's own (scripts/oracle/run.py), Megatron's and SGLang's
flags are not slime's parser's.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NoReturn

from pipeline.config import ConfigError

# The project's launcher's loss flags (scripts/run_slime_grpo.sh, "GRPO with off-policy
# correction"; tests/scripts/test_check_signal.py holds them to it): what a run started the way
# the README says trains with
LAUNCHER_LOSS_FLAGS = (
    "--advantage-estimator grpo "
    "--custom-reward-post-process-path pipeline.slime.data_source.post_process_rewards "
    "--use-tis --tis-clip 2.0 "
    "--use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl "
    "--entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28"
)

# slime's modules that its loops (scripts/oracle/slime_loop.py `install`) and the CPU actor's loss reach
SLIME_MODULES = ("slime.ray.rollout", "slime.backends.megatron_utils.loss", "slime.observability.rollout_data_utils",
                 "slime.ray.placement_group")
# beyond cpu_actor.slime_loss_args' keys: what slime's loss reads for the estimators and losses it
# offers (ppo's value clip, OPSM, on-policy distillation, a custom loss)
EXTRA_LOSS_KEYS = ("gamma", "lambd", "opsm_delta", "value_clip", "opd_kl_coef", "opd_type", "custom_loss_function_path")


class SlimeMissing(RuntimeError):
    """What a learning run needs and this machine lacks (slime's snapshot, torch, megatron-core)."""


def load_slime() -> SimpleNamespace:
    """slime's pinned snapshot (scripts/upstream.py) on sys.path, `SLIME_MODULES` imported, and
    pipeline.slime.data_source imported after them, so that its samples are slime's `Sample`
    (pipeline/slime/samples.py binds slime's classes at its first import). Returns what
    scripts/oracle/run.py `run_learning` takes as `slime`: `path` and `modules`."""
    import importlib

    from scripts import upstream

    path = upstream.snapshot_path("slime")
    if not upstream.is_present("slime"):
        pinned = upstream.BY_NAME["slime"]
        raise SlimeMissing(f"no slime snapshot at {path} ({pinned.repository} @ {pinned.commit[:12]}; set "
                           f"${pinned.env_var} or ${upstream.THIRD_PARTY_ENV}, or `python -m scripts.upstream fetch`)")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    modules = {}
    for name in ("torch", "megatron.core", *SLIME_MODULES):
        try:
            with warnings.catch_warnings():  # megatron-core on a CPU: "Transformer Engine and Apex are not installed"
                warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex", category=UserWarning)
                modules[name] = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - ImportError, or an upstream module failing at import
            raise SlimeMissing(f"cannot import {name}: {type(exc).__name__}: {exc} (the conformance extra: "
                               'pip install torch==2.13.0 && pip install -e ".[conformance]", see .ci/run)') from exc
    from slime.utils.types import Sample

    bound = sys.modules.get("pipeline.slime.samples")
    if bound is not None and bound.SampleClass is not Sample:
        raise RuntimeError("pipeline.slime.samples was imported before slime (its samples are LocalSample): "
                           "load_slime() must run first")
    importlib.import_module("pipeline.slime.data_source")
    return SimpleNamespace(path=path, modules={name: modules[name] for name in SLIME_MODULES})


@dataclass
class LossFlags:
    values: dict[str, Any]  # slime's loss arguments: its defaults, the flags given, its validation's rules
    given: list[str] = field(default_factory=list)  # the loss flags honoured, as written
    ignored: list[str] = field(default_factory=list)  # slime's flags that are not the loss's (the run's own)
    unknown: list[str] = field(default_factory=list)  # what slime's parser does not know (Megatron's, SGLang's)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # a ConfigError (exit 2, one line), not argparse's exit
        raise ConfigError(f"--slime-args: {message}")


def slime_parser() -> argparse.ArgumentParser:
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = _Parser(prog="slime", add_help=False, allow_abbrev=False)
    return get_slime_extra_args_provider()(parser)


def loss_flags(text: str) -> LossFlags:
    """slime's loss arguments for `text` (slime's flags, shell-quoted as on a command line)."""
    from scripts.oracle.cpu_actor import slime_loss_args

    keys = (*slime_loss_args(), *EXTRA_LOSS_KEYS)
    parser = slime_parser()
    defaults = {action.dest: action.default for action in parser._actions}
    flag_of = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    for action in parser._actions:  # only what `text` sets comes back
        action.default, action.required = argparse.SUPPRESS, False
    parsed, unknown = parser.parse_known_args(shlex.split(text))
    given = vars(parsed)
    values = {**slime_loss_args(), **{k: defaults[k] for k in keys if k in defaults},
              **{k: v for k, v in given.items() if k in keys}}
    _validate(values)
    return LossFlags(values=values, given=[f"{flag_of[k]} {v}" if not isinstance(v, bool) else flag_of[k]
                                           for k, v in given.items() if k in keys],
                     ignored=[flag_of[k] for k in given if k not in keys], unknown=unknown)


def _validate(values: dict[str, Any]) -> None:
    """slime_validate_args' rules on the loss arguments (slime/utils/arguments.py), and what a CPU
    run of the tiny policy cannot train."""
    rules = [
        (values["advantage_estimator"] == "ppo", "--advantage-estimator ppo trains a critic, which this check has not"),
        (values["kl_coef"] != 0 and values["kl_loss_coef"] != 0, "only one of kl_coef and kl_loss_coef can be set"),
        (values["advantage_estimator"] in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
         and not values["normalize_advantages"], f"--advantage-estimator {values['advantage_estimator']} requires "
         "--normalize-advantages"),
        (values["use_rollout_logprobs"] and values["use_tis"], "use_rollout_logprobs and use_tis cannot be set at the "
         "same time"),
    ]
    for broken, message in rules:
        if broken:
            raise ConfigError(f"--slime-args: {message}")
    if values["eps_clip_high"] is None:
        values["eps_clip_high"] = values["eps_clip"]
