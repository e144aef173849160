"""Kind-specific settings (`environments.<name>.options`) and secrets of one environment.

Each kind declares its options as an `Options` subclass (msgspec, unknown keys
forbidden); `parse_options` turns a bad value into a `ConfigError` that names
`environments.<name>.options.<key>`. Secrets are names of environment variables in
`EnvConfig.secrets`; `read_secrets` reads their values at start and never logs them.

Options every kind shares live on the base class: `tool_parser`, the format of the
model's tool calls (`workers/tools.py` `PARSERS`, or a dotted path to a parser).
`check_tool_parser` / `check_tool_parsers` validate it for any kind, also for kinds that
declare no options struct (`arithmetic`, `calculator`, user classes).
"""

from __future__ import annotations

import os
import re
from typing import TypeVar

import msgspec

from pipeline.config import ConfigError, EnvConfig, PipelineConfig
from workers.tools import DEFAULT_PARSER, get_parser


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Base of every kind's options."""

    tool_parser: str = DEFAULT_PARSER  # tool-call format of the model (workers/tools.py)


def check_tool_parser(name: str, config: EnvConfig) -> None:
    """ConfigError naming `environments.<name>.options.tool_parser` and the valid names when
    the environment's tool parser is unknown (or a dotted path that does not import)."""
    value = config.options.get("tool_parser", DEFAULT_PARSER)
    where = f"environments.{name}.options.tool_parser"
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a parser name (str), got {type(value).__name__}")
    try:
        get_parser(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def check_tool_parsers(config: PipelineConfig) -> None:
    """`check_tool_parser` for every configured environment (call it where the config is loaded)."""
    for name, env in config.environments.items():
        check_tool_parser(name, env)


OptionsT = TypeVar("OptionsT", bound=Options)

_AT_PATH = re.compile(r" - at `\$(.*)`$")


def parse_options(name: str, config: EnvConfig, cls: type[OptionsT]) -> OptionsT:
    where = f"environments.{name}.options"
    check_tool_parser(name, config)
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
