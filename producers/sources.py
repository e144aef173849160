"""Where tasks come from: per-environment dataset settings and the row readers.

Each configured environment may carry a `dataset` section (validated here; errors
name `environments.<name>.dataset.<key>`):

    environments:
      gsm8k:
        kind: math
        dataset:
          source: jsonl                   # jsonl | parquet | nemo_gym | nemo_skills | openreward
          files: [data/gsm8k/*.jsonl]     # globs, relative to the config file
          fields: {id: id, prompt: question, label: answer, metadata: [level]}
      tau:
        kind: openreward
        splits: [train]
        num_samples: 500
        options: {environment: owner/tau, base_url: null}   # the kind's own options
        dataset: {source: openreward}     # lists tasks of options.environment

It is a section of its own, not a key of `options`, because each environment kind
validates its `options` strictly. An OpenReward source reuses the kind's connection
options (`environment`, `base_url`, `variant`, `api_key_env`), so they are set once.

A reader yields `Row`s: the raw mapping plus where it came from (file:line), so every
error can say exactly which row is bad. Mapping rows to Tasks lives in prepare_tasks.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import msgspec

from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import SchemaError
from workers.envs.convert import input_problems, prompt_messages

Source = Literal["jsonl", "parquet", "nemo_gym", "nemo_skills", "openreward"]
PARQUET_BATCH_ROWS = 1024
_AT_PATH = re.compile(r" - at `\$(.*)`$")


class _Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class FieldMap(_Options, frozen=True):
    """Which row fields make a Task. Names may be dotted paths into nested objects."""

    id: Union[str, None] = "id"  # a row without it gets a content-hash id; None = always hash
    prompt: str = "prompt"  # text, or a list of chat messages (e.g. "messages")
    label: Union[str, None] = "label"  # numbers become strings; None = no label
    metadata: Union[list[str], Literal["*"], None] = None  # None = every field not used above; "*" = the whole row


# NeMo Gym rows: the prompt is the Responses input; the whole row travels as metadata
# because /seed_session and /verify take it back verbatim.
NEMO_GYM_FIELDS = FieldMap(id="id", prompt="responses_create_params.input", label="expected_answer", metadata="*")
# NeMo-Skills rows (JSONL as its datasets' prepare scripts write them): `problem` is the prompt,
# `expected_answer` the gold; the whole row travels as metadata, because NeMo-Skills' prompt
# templates may format any of its fields (`kind: nemo_skills` renders them with `Prompt.fill`).
NEMO_SKILLS_FIELDS = FieldMap(id="id", prompt="problem", label="expected_answer", metadata="*")
# OpenReward: the real prompt comes from the environment's session at episode start;
# `prompt` holds the task spec as text (for logs and the content hash).
OPENREWARD_FIELDS = FieldMap(id="task_spec.id", prompt="prompt", label=None, metadata=["task_spec", "split", "index", "environment"])


class DatasetOptions(_Options, frozen=True):
    source: Source
    files: list[str] = []  # jsonl / parquet / nemo_gym / nemo_skills: paths or globs, relative to the config file
    fields: Union[FieldMap, None] = None  # None = the source's default mapping

    def __post_init__(self) -> None:
        if self.source != "openreward" and not self.files:
            raise ValueError(f"source {self.source} needs `files`")

    def field_map(self) -> FieldMap:
        if self.fields is not None:
            return self.fields
        defaults = {"nemo_gym": NEMO_GYM_FIELDS, "nemo_skills": NEMO_SKILLS_FIELDS, "openreward": OPENREWARD_FIELDS}
        return defaults.get(self.source, FieldMap())


@dataclass(frozen=True)
class Row:
    where: str  # "file:line" (1-based) or "openreward:<env>/<split>#<index>"
    data: Any  # a mapping when well formed; anything else is reported by the mapper
    size: int = 0  # bytes of the raw row, when known


class RowError(ValueError):
    """A row that cannot be read at all (malformed JSON, bad UTF-8); `where` names it."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class OpenRewardTarget(msgspec.Struct, kw_only=True, frozen=True):
    """The connection part of an openreward environment's `options` (other keys ignored here)."""

    environment: str  # "owner/name" on the platform, or the name a local Server hosts
    base_url: Union[str, None] = None  # e.g. http://127.0.0.1:8080 for a self-hosted Server
    variant: Union[str, None] = None
    api_key_env: str = "OPENREWARD_API_KEY"  # name of the env var holding the key (never the key)


def _convert(raw: Any, cls: type, where: str) -> Any:
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = _AT_PATH.search(text)
        if at:  # "... - at `$.fields.prompt`" -> "environments.x.dataset.fields.prompt: ..."
            where, text = where + at.group(1), text[: at.start()]
        unknown = re.match(r"Object contains unknown field `(.+)`", text)
        if unknown:
            where += f".{unknown.group(1)}"
        raise ConfigError(f"{where}: {text}") from exc


def dataset_options(env_name: str, env: EnvConfig) -> DatasetOptions | None:
    if not env.dataset:
        return None
    return _convert(env.dataset, DatasetOptions, f"environments.{env_name}.dataset")


def openreward_target(env_name: str, env: EnvConfig) -> OpenRewardTarget:
    return _convert(env.options, OpenRewardTarget, f"environments.{env_name}.options")


def resolve_files(patterns: list[str], base_dir: Path, where: str) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        full = pattern if os.path.isabs(pattern) else str(base_dir / pattern)
        matched = sorted(glob.glob(full, recursive=True))
        if not matched:
            raise ConfigError(f"{where}: no file matches {pattern!r} (looked in {base_dir})")
        files += [Path(m) for m in matched]
    return files


# ------------------------------------------------------------------ readers

_json_decoder = msgspec.json.Decoder()


def read_jsonl(path: Path) -> Iterator[Row | RowError]:
    """Rows of a JSON-lines file; blank lines are skipped, bad ones yield a RowError."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"{path}:{number}"
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
            if not raw.strip():
                continue
            # The bytes are decoded here, not by the JSON decoder: how a JSON library reports bad
            # UTF-8 differs between versions (msgspec 0.23: "malformed JSON: Invalid UTF-8 encoded
            # string"), and a row's message must not depend on what else is installed.
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RowError(where, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            try:
                yield Row(where, _json_decoder.decode(text), len(raw))
            except msgspec.DecodeError as exc:
                yield RowError(where, f"malformed JSON: {exc}")


def read_parquet(path: Path) -> Iterator[Row | RowError]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow (pip install 'rollout-pipeline[parquet]')") from exc
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError family
        yield RowError(f"{path}", f"not a readable Parquet file: {exc}")
        return
    number = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            number += 1
            yield Row(f"{path}:row {number}", record)


def read_files(options: DatasetOptions, files: list[Path]) -> Iterator[Row | RowError]:
    reader = read_parquet if options.source == "parquet" else read_jsonl
    for path in files:
        yield from reader(path)


# ------------------------------------------------------------------ NeMo Gym


def nemo_gym_prompt(row: Any) -> list[dict[str, Any]]:
    """The chat prompt of a NeMo Gym row, or SchemaError naming the bad field.

    The row is checked as NeMo Gym's /verify would check it after a whole episode
    (`convert.input_problems`: item types and fields of `input`, `tools`, `tool_choice`
    and `parallel_tool_calls` not null), and rendered as the worker renders it
    (`convert.prompt_messages`: `instructions` as the system message, `function_call` /
    `function_call_output` / `reasoning` history as assistant tool calls and tool messages).
    """
    if not isinstance(row, dict):
        raise SchemaError(f"row must be a JSON object, got {type(row).__name__}")
    params = row.get("responses_create_params")
    problems = input_problems(params)
    if problems:
        raise SchemaError("; ".join(f"field {where}: {reason}" for where, reason in problems[:5]))
    assert isinstance(params, dict)  # input_problems reports anything else
    return prompt_messages(params)


# ------------------------------------------------------------------ NeMo-Skills


def check_nemo_skills_row(row: Any) -> None:
    """SchemaError naming the field when a NeMo-Skills row has no text `problem` (the prompt
    templates format it as text; a missing `expected_answer` is the environment's check)."""
    if not isinstance(row, dict):
        raise SchemaError(f"row must be a JSON object, got {type(row).__name__}")
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        got = "missing" if problem is None else f"{type(problem).__name__} {str(problem)[:40]!r}"
        raise SchemaError(f"field 'problem' must be non-empty text (NeMo-Skills rows), got {got}")


# ------------------------------------------------------------------ OpenReward

def read_openreward(target: OpenRewardTarget, env: EnvConfig) -> list[Row]:
    """Task specs of an OpenReward environment, per configured split (default `train`).

    `num_samples` caps the number of tasks per split (the first ones, in the
    server's order, so the selection is stable across runs).
    """
    return asyncio.run(_list_openreward(target, env))


async def _list_openreward(target: OpenRewardTarget, env: EnvConfig) -> list[Row]:
    try:
        from openreward import AsyncOpenReward
    except ImportError as exc:
        raise ConfigError("source openreward needs the SDK (pip install 'rollout-pipeline[openreward]')") from exc
    client = AsyncOpenReward(api_key=os.environ.get(target.api_key_env) or None)
    rows: list[Row] = []
    try:
        environment = client.environments.get(target.environment, variant=target.variant, base_url=target.base_url)
        for split in env.splits or ["train"]:
            stop = env.num_samples
            specs = await environment.get_task_range(split, 0, stop) if stop else await environment.list_tasks(split)
            for index, spec in enumerate(specs):
                where = f"openreward:{target.environment}/{split}#{index}"
                prompt = msgspec.json.encode(spec.task_spec, order="sorted").decode()
                data = {"prompt": prompt, "task_spec": spec.task_spec, "split": split, "index": index,
                        "environment": spec.environment_name}
                rows.append(Row(where, data))
    finally:
        await client.environments.aclose()
    return rows
