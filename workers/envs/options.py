"""Kind-specific settings (`environments.<name>.options`) and secrets of one environment.

Each kind declares its options as an `Options` subclass (msgspec, unknown keys
forbidden); `parse_options` turns a bad value into a `ConfigError` that names
`environments.<name>.options.<key>`. Secrets are names of environment variables in
`EnvConfig.secrets`; `read_secrets` reads their values at start and never logs them.
"""

from __future__ import annotations

import os
import re
from typing import TypeVar

import msgspec

from pipeline.config import ConfigError, EnvConfig


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Base of every kind's options."""


O = TypeVar("O", bound=Options)

_AT_PATH = re.compile(r" - at `\$(.*)`$")


def parse_options(name: str, config: EnvConfig, cls: type[O]) -> O:
    where = f"environments.{name}.options"
    try:
        return msgspec.convert(config.options, cls)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_PATH.search(text)
        if match:  # "... - at `$.timeout`" -> "environments.x.options.timeout: ..."
            where += match.group(1)
            text = text[: match.start()]
        unknown = re.match(r"Object contains unknown field `(.+)`", text)
        if unknown:
            where += f".{unknown.group(1)}"
        raise ConfigError(f"{where}: {text}") from exc


def read_secrets(name: str, config: EnvConfig) -> dict[str, str]:
    """{env var name: value} for every name in `config.secrets`; a missing one is a ConfigError."""
    missing = [var for var in config.secrets if var not in os.environ]
    if missing:
        raise ConfigError(f"environments.{name}.secrets: environment variable(s) not set: {', '.join(missing)}")
    return {var: os.environ[var] for var in config.secrets}
