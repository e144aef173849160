"""Build tasks.jsonl: one validated Task per line, from every configured environment.

    python producers/prepare_tasks.py --config train_config.yaml --output tasks.jsonl
    rollout prepare --config train_config.yaml --output tasks.jsonl [--skip-invalid]

Each environment with a `dataset` section (see producers/sources.py) contributes its
rows. Every row is validated; a bad one is reported as `file:line: reason`. Without
`--skip-invalid` any bad row fails the run and nothing is written (the output is
built in a temp file beside the target and renamed only at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # `python producers/prepare_tasks.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.config import ConfigError, EnvConfig, PipelineConfig, load_config
from pipeline.schema import SchemaError, Task, encode_task_json
from pipeline.usage import usage_error
from producers.sources import (
    NEMO_GYM_FIELDS,
    NEMO_SKILLS_FIELDS,
    DatasetOptions,
    FieldMap,
    Row,
    RowError,
    check_nemo_skills_row,
    dataset_options,
    nemo_gym_prompt,
    openreward_target,
    read_files,
    read_openreward,
    resolve_files,
)
from workers.validate import check_environments, task_problem

DEFAULT_MAX_ROW_BYTES = 16 * 1024 * 1024
MAX_ERRORS_SHOWN = 20
_MISSING = object()


class PrepareError(ValueError):
    """The run failed; nothing was written. `errors` are the `where: reason` lines."""

    def __init__(self, errors: list[str], total: int):
        shown = "\n  ".join(errors[:MAX_ERRORS_SHOWN])
        more = f"\n  ... and {total - MAX_ERRORS_SHOWN} more" if total > MAX_ERRORS_SHOWN else ""
        super().__init__(f"{total} invalid row(s); nothing written (use --skip-invalid to skip them):\n  {shown}{more}")
        self.errors = errors
        self.total = total


@dataclass
class EnvSummary:
    rows: int = 0
    written: int = 0
    invalid: int = 0
    reasons: Tally = field(default_factory=Tally)


@dataclass
class PrepareReport:
    output: Path
    envs: dict[str, EnvSummary]
    errors: list[str]  # the first few invalid rows, `where: reason`

    @property
    def written(self) -> int:
        return sum(s.written for s in self.envs.values())

    @property
    def invalid(self) -> int:
        return sum(s.invalid for s in self.envs.values())


# ------------------------------------------------------------------ row -> Task

def lookup(row: dict[str, Any], path: str) -> Any:
    """`a.b.c` in nested mappings; _MISSING when any step is absent."""
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def content_id(env: str, prompt: Any, label: Any, metadata: dict[str, Any]) -> str:
    digest = hashlib.sha256(msgspec.json.encode([env, prompt, label, metadata], order="sorted")).hexdigest()
    return f"{env}/{digest[:20]}"


def _given_id(row: dict[str, Any], fields: FieldMap) -> str | None:
    if fields.id is None:
        return None
    value = lookup(row, fields.id)
    if value is _MISSING or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SchemaError(f"field {fields.id!r} (id) must be a string or integer, got {type(value).__name__}")
    return str(value)


def _label(row: dict[str, Any], fields: FieldMap) -> str | None:
    value = _MISSING if fields.label is None else lookup(row, fields.label)
    if value is _MISSING or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise SchemaError(f"field {fields.label!r} (label) must be a string or number, got {type(value).__name__}")
    return str(value)


def _metadata(row: dict[str, Any], fields: FieldMap) -> dict[str, Any]:
    if fields.metadata == "*":
        return dict(row)
    if fields.metadata is not None:
        return {name: row[name] for name in fields.metadata if name in row}
    used = {p.split(".")[0] for p in (fields.id, fields.prompt, fields.label) if p}
    return {k: v for k, v in row.items() if k not in used}


def row_to_task(row: Any, env: str, fields: FieldMap, prompt: Any = _MISSING) -> Task:
    """One validated Task, or SchemaError saying what is wrong with the row. `prompt`, when
    given, replaces the row's prompt field (a NeMo Gym row's rendered chat prompt)."""
    if not isinstance(row, dict):
        raise SchemaError(f"row must be a JSON object, got {type(row).__name__}")
    if prompt is _MISSING:
        prompt = lookup(row, fields.prompt)
    if prompt is _MISSING or prompt is None:
        raise SchemaError(f"missing field {fields.prompt!r} (prompt)")
    label, metadata = _label(row, fields), _metadata(row, fields)
    task_id = _given_id(row, fields) or content_id(env, prompt, label, metadata)
    try:
        return msgspec.convert({"id": task_id, "env": env, "prompt": prompt, "label": label, "metadata": metadata}, Task)
    except msgspec.ValidationError as exc:
        raise SchemaError(str(exc).replace("`$.prompt", f"`{fields.prompt}")) from exc


def encode_line(task: Task, max_bytes: int) -> bytes:
    try:
        line = encode_task_json(task)
    except (UnicodeEncodeError, msgspec.EncodeError) as exc:  # lone surrogates and the like
        raise SchemaError(f"text cannot be written as UTF-8 JSON: {exc}") from exc
    if len(line) > max_bytes:
        raise SchemaError(f"row is {len(line)} bytes as a task, over the limit of {max_bytes} (--max-row-bytes)")
    return line + b"\n"


# ------------------------------------------------------------------ the run

@dataclass(frozen=True)
class EnvSource:
    name: str
    env: EnvConfig
    options: DatasetOptions
    files: list[Path]

    def rows(self) -> Iterable[Row | RowError]:
        if self.options.source == "openreward":
            return read_openreward(openreward_target(self.name, self.env), self.env)
        return read_files(self.options, self.files)


def env_sources(config: PipelineConfig, base_dir: Path, output: Path) -> list[EnvSource]:
    """The configured sources; a glob never picks up the output itself (a re-run would read it)."""
    sources = []
    for name, env in config.environments.items():
        options = dataset_options(name, env)
        if options is None:
            continue
        where = f"environments.{name}.dataset.files"
        files = resolve_files(options.files, base_dir, where) if options.files else []
        files = [f for f in files if f.resolve() != output.resolve()]
        if options.source == "openreward":
            openreward_target(name, env)  # a bad connection setting fails before anything is read
        sources.append(EnvSource(name, env, options, files))
    if not sources:
        raise ConfigError("no environment has a `dataset` section: nothing to prepare")
    return sources


class _Writer:
    """Validates, de-duplicates and writes rows; records what happened per environment."""

    def __init__(self, out: IO[bytes], *, max_row_bytes: int, skip_invalid: bool, config: PipelineConfig | None = None):
        self.out = out
        self.config = config
        self.checks: dict[str, Any] = {}  # env name -> its kind's per-task check (workers/validate.py)
        self.max_row_bytes = max_row_bytes
        self.skip_invalid = skip_invalid
        self.seen: dict[str, tuple[str, str]] = {}  # task id -> (environment, where) it first appeared
        self.errors: list[str] = []
        self.n_errors = 0

    def take(self, item: Row | RowError, source: EnvSource, summary: EnvSummary) -> None:
        summary.rows += 1
        try:
            if isinstance(item, RowError):
                raise SchemaError(item.reason)
            fields = source.options.field_map()
            prompt: Any = _MISSING
            if source.options.source == "nemo_gym":  # checked as /verify would, after a whole episode
                prompt = nemo_gym_prompt(item.data)
                if fields.prompt != NEMO_GYM_FIELDS.prompt:
                    prompt = _MISSING  # a mapping of the user's own picks the prompt
            elif source.options.source == "nemo_skills" and fields.prompt == NEMO_SKILLS_FIELDS.prompt:
                check_nemo_skills_row(item.data)  # `problem` is text the prompt templates format
            task = row_to_task(item.data, source.name, fields, prompt)
            if self.config is not None:  # what the environment's `start` requires (a math row's label)
                problem = task_problem(task, self.config, self.checks)
                if problem:
                    raise SchemaError(problem)
            # Keyed by environment too: two environments may read rows with the same `where`
            # (two OpenReward environments of one name on different servers or variants).
            first = self.seen.setdefault(task.id, (source.name, item.where))
            if first != (source.name, item.where):
                raise SchemaError(f"duplicate task id {task.id!r} (first at {first[1]}) of environment {first[0]!r}")
            line = encode_line(task, self.max_row_bytes)
        except SchemaError as exc:
            self._reject(item.where, str(exc), summary)
            return
        if not self.n_errors or self.skip_invalid:  # after a failure there is no point writing
            self.out.write(line)
        summary.written += 1

    def _reject(self, where: str, reason: str, summary: EnvSummary) -> None:
        summary.invalid += 1
        summary.reasons[reason.split(" (", 1)[0][:60]] += 1
        self.n_errors += 1
        if len(self.errors) < MAX_ERRORS_SHOWN:
            self.errors.append(f"{where}: {reason}")


def prepare_tasks(
    config: PipelineConfig,
    output: str | Path,
    *,
    base_dir: str | Path = ".",
    skip_invalid: bool = False,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    console: Console | None = None,
) -> PrepareReport:
    """Write tasks.jsonl atomically. Raises PrepareError (nothing written) on bad rows
    unless `skip_invalid`; ConfigError on a bad dataset configuration."""
    output = Path(output)
    sources = env_sources(config, Path(base_dir), output)
    check_environments(config)  # kinds, options: a typo fails before any row is read
    console = console or Console(stderr=True)
    report = PrepareReport(output, {s.name: EnvSummary() for s in sources}, [])
    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent or ".")
    try:
        with os.fdopen(fd, "wb") as out:
            writer = _Writer(out, max_row_bytes=max_row_bytes, skip_invalid=skip_invalid, config=config)
            for source, item in _with_progress(sources, console):
                writer.take(item, source, report.envs[source.name])
            report.errors = writer.errors
            if writer.n_errors and not skip_invalid:
                raise PrepareError(writer.errors, writer.n_errors)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, output)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return report


def _with_progress(sources: list[EnvSource], console: Console) -> Iterator[tuple[EnvSource, Row | RowError]]:
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} rows"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as progress:
        for source in sources:
            bar = progress.add_task(f"{source.name} ({source.options.source})", total=None)
            for item in source.rows():
                yield source, item
                progress.advance(bar)


def summary_table(report: PrepareReport) -> Table:
    table = Table(title=f"tasks -> {report.output}")
    for column in ("environment", "rows", "written", "invalid", "top reasons"):
        table.add_column(column, justify="left" if column in ("environment", "top reasons") else "right")
    for name, s in report.envs.items():
        reasons = "; ".join(f"{r} x{n}" for r, n in s.reasons.most_common(3))
        table.add_row(name, str(s.rows), str(s.written), str(s.invalid), reasons)
    return table


# ------------------------------------------------------------------ CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="pipeline YAML with environments.<name>.dataset")
    parser.add_argument("--output", default="tasks.jsonl", help="tasks.jsonl to write (replaced atomically)")
    parser.add_argument("--skip-invalid", action="store_true", help="skip and count bad rows instead of failing")
    parser.add_argument("--max-row-bytes", type=int, default=DEFAULT_MAX_ROW_BYTES, help="largest task line accepted")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        config = load_config(args.config)
        report = prepare_tasks(
            config, args.output, base_dir=Path(args.config).resolve().parent,
            skip_invalid=args.skip_invalid, max_row_bytes=args.max_row_bytes, console=console,
        )
    except (ConfigError, PrepareError) as exc:  # exit 2: usage/config (scripts/cli.py); a traceback under --debug
        return usage_error("prepare", exc, say=lambda line: console.print(line, style="red", markup=False, highlight=False,
                                                                       soft_wrap=True))
    console.print(summary_table(report))
    for line in report.errors:
        console.print(f"skipped {line}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"wrote {report.written} tasks to {report.output} ({report.invalid} invalid rows skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
