"""The ledger: every trained group, one Parquet file per training step.

When the slime data source acknowledges a step at a checkpoint (`save(rid)`, or `load(rid)`
for steps a crashed trainer had checkpointed but not yet acknowledged), it writes the
step's groups, exactly as it handed them to slime, to `<dir>/step-<rid:08d>.parquet`
*before* their stream entries are deleted. The file is written to a temporary name,
fsync'ed and renamed: a crash leaves either no file or a whole one, and writing the same
step again (a crash between the write and the ack) replaces it with the same content.
So every group trained is in the ledger exactly once, in the step that trained it.

One row per sample (episode); group columns repeat on each of its rows. Arrays are Arrow
lists (int32 tokens, uint8 loss mask, float32 log-probs); dicts (task, metadata, reward
components, timings) and the prompt are JSON text. Layout: docs/architecture.md "Ledger".

    rollout ledger list|summary|export|rescore --dir D

This module is storage every side reads (the data source writes it, `rollout show` renders it):
it imports nothing of workers/. `rescore` verifies stored episodes again with the environments,
so it lives with them (workers/rescore.py) and joins `rollout ledger` as an added action.

pyarrow is optional (`pip install ".[parquet]"`); it is imported when a ledger is used.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pipeline.schema import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, Sample, SampleGroup, Status, Task
from pipeline.staleness import staleness

log = logging.getLogger(__name__)

LEDGER_FORMAT = "1"
FILE_PATTERN = re.compile(r"^step-(\d+)\.parquet$")
COMPRESSION = "zstd"

# columns without the per-token arrays: what list/summary read (fast, small)
LIGHT_COLUMNS = [
    "rollout_id", "position", "group_id", "task_id", "env", "epoch", "attempt", "admission_version",
    "oldest_version", "staleness", "worker_id", "sample_index", "status", "remove_sample", "reward",
    "response_length", "num_tokens",
]
JSON_COLUMNS = ("task", "timings", "prompt", "reward_components", "metadata")


class LedgerError(RuntimeError):
    """The ledger cannot be used (pyarrow missing, no such step, a bad directory)."""


def _arrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise LedgerError(
            "the ledger needs pyarrow, which is not installed: pip install 'rollout-pipeline[parquet]' "
            f"(or pip install pyarrow) ({exc})"
        ) from None
    return pa, pq


def require_pyarrow() -> None:
    """Raise LedgerError now (at start-up) rather than at the first checkpoint."""
    _arrow()


def schema() -> Any:
    pa, _ = _arrow()
    fields = [
        ("rollout_id", pa.int64()),  # the step that trained the group
        ("position", pa.int32()),  # the group's place in the step's batch
        ("group_index", pa.int64()),  # slime's Sample.group_index (rollout_id * batch + position)
        ("stream_id", pa.string()),
        ("group_id", pa.string()),
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("epoch", pa.int64()),
        ("attempt", pa.int64()),
        ("admission_version", pa.int64()),
        ("oldest_version", pa.int64()),  # the oldest policy version of any token of the group
        ("staleness", pa.int64()),  # rollout_id - oldest_version
        ("worker_id", pa.string()),
        ("timings", pa.string()),  # JSON
        ("task", pa.string()),  # JSON: the whole Task (prompt, label, metadata)
        ("sample_index", pa.int32()),
        ("index", pa.int64()),  # slime's Sample.index (group_index * n + sample_index)
        ("status", pa.string()),
        ("remove_sample", pa.bool_()),  # a failed episode: handed to slime with its loss removed
        ("reward", pa.float64()),
        ("reward_components", pa.string()),  # JSON
        ("prompt", pa.string()),  # JSON: text or chat messages
        ("response", pa.string()),
        ("label", pa.string()),
        ("response_length", pa.int32()),
        ("num_tokens", pa.int32()),
        ("tokens", pa.list_(pa.int32())),  # prompt + response
        ("loss_mask", pa.list_(pa.uint8())),  # one per response token
        ("rollout_log_probs", pa.list_(pa.float32())),  # one per response token
        ("weight_versions", pa.list_(pa.string())),  # the engine's labels, per generate call
        ("policy_versions", pa.list_(pa.int64())),  # policy version per generate call
        ("policy_run", pa.int64()),
        ("metadata", pa.string()),  # JSON: turns, turn_log, messages, step_rewards, ...
    ]
    return pa.schema(fields, metadata={"rollout_ledger_format": LEDGER_FORMAT})


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _list_array(pa: Any, arrays: Sequence[np.ndarray], value_type: Any, dtype: np.dtype) -> Any:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(dtype, copy=False), type=value_type))


def step_table(
    rollout_id: int, entries: Sequence[Any], *, oldest: Callable[[SampleGroup], int] | None = None,
    ids: Sequence[str] | None = None,
) -> Any:
    """The Arrow table of one step: `entries` are `buffer.Entry`s (stream id + group) in the
    order the step handed them to slime; `ids`, the step's recorded stream ids, give each
    entry its place (default: the order of `entries`)."""
    pa, _ = _arrow()
    cols: dict[str, list[Any]] = {name: [] for name in schema().names}
    tokens, masks, log_probs = [], [], []
    place = {i: k for k, i in enumerate(ids)} if ids is not None else {}
    batch = len(ids) if ids is not None else len(entries)
    for k, entry in enumerate(entries):
        position = place.get(entry.stream_id, k)
        group: SampleGroup = entry.group
        old = oldest(group) if oldest is not None else group.oldest_version()
        group_index = rollout_id * batch + position
        group_cols = {
            "rollout_id": rollout_id, "position": position, "group_index": group_index,
            "stream_id": entry.stream_id, "group_id": group.group_id, "task_id": group.task_id, "env": group.env,
            "epoch": group.epoch, "attempt": group.attempt, "admission_version": group.admission_version,
            "oldest_version": old, "staleness": staleness(rollout_id, old), "worker_id": group.worker_id,
            "timings": _json(group.timings), "task": _json(group.task),
        }
        for j, s in enumerate(group.samples):
            for name, value in group_cols.items():
                cols[name].append(value)
            cols["sample_index"].append(j)
            cols["index"].append(group_index * group.n_samples + j)
            cols["status"].append(s.status.value)
            cols["remove_sample"].append(s.status is Status.FAILED)
            cols["reward"].append(s.reward)
            cols["reward_components"].append(_json(s.reward_components))
            cols["prompt"].append(_json(s.prompt))
            cols["response"].append(s.response)
            cols["label"].append(s.label)
            cols["response_length"].append(s.response_length)
            cols["num_tokens"].append(s.num_tokens)
            cols["weight_versions"].append(list(s.weight_versions))
            cols["policy_versions"].append(list(s.policy_versions))
            cols["policy_run"].append(s.policy_run)
            cols["metadata"].append(_json(s.metadata))
            tokens.append(s.token_array())
            masks.append(s.loss_mask_array())
            log_probs.append(s.log_prob_array())
    sch = schema()
    arrays = []
    for f in sch:
        if f.name == "tokens":
            arrays.append(_list_array(pa, tokens, pa.int32(), TOKEN_DTYPE))
        elif f.name == "loss_mask":
            arrays.append(_list_array(pa, masks, pa.uint8(), MASK_DTYPE))
        elif f.name == "rollout_log_probs":
            arrays.append(_list_array(pa, log_probs, pa.float32(), LOGPROB_DTYPE))
        else:
            arrays.append(pa.array(cols[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=sch)


def _write_atomic(table: Any, path: Path) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory."""
    _, pq = _arrow()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, compression=COMPRESSION)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class LedgerGroup:
    """One group read back: where it was trained, and the wire group as the trainer got it."""

    rollout_id: int
    position: int
    stream_id: str
    oldest_version: int
    group: SampleGroup


class Ledger:
    """A ledger directory: write steps (the slime side), read them (`rollout ledger`, `rollout show`)."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = Path(directory)

    # ------------------------------------------------------------------ write
    def path(self, rollout_id: int) -> Path:
        return self.dir / f"step-{rollout_id:08d}.parquet"

    def write_step(
        self, rollout_id: int, entries: Sequence[Any], *, oldest: Callable[[SampleGroup], int] | None = None,
        ids: Sequence[str] | None = None,
    ) -> Path:
        """Write (or identically rewrite) the file of step `rollout_id`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(rollout_id)
        _write_atomic(step_table(rollout_id, entries, oldest=oldest, ids=ids), path)
        return path

    def record_step(
        self, rollout_id: int, ids: Sequence[str], entries: Sequence[Any],
        *, oldest: Callable[[SampleGroup], int] | None = None,
    ) -> Path | None:
        """What the data source calls before it acknowledges step `rollout_id` (stream `ids`,
        of which `entries` are those still in the stream). Fewer entries than ids with the
        step's file present: the step was written and acknowledged before a crash that left
        its record behind; the file is whole and is kept (rewriting would lose groups)."""
        path = self.path(rollout_id)
        if len(entries) < len(ids):
            if path.exists():
                log.info("ledger: step %d already written; %d of its %d groups are acknowledged", rollout_id,
                         len(ids) - len(entries), len(ids))
                return None
            log.error("ledger: step %d: only %d of its %d groups are still in the stream; writing those",
                      rollout_id, len(entries), len(ids))
        if not entries and not ids:
            return None
        return self.write_step(rollout_id, entries, oldest=oldest, ids=ids)

    # ------------------------------------------------------------------- read
    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = FILE_PATTERN.match(p.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def select(self, start: int | None = None, end: int | None = None) -> list[int]:
        """Steps within [start, end] (inclusive; None = open)."""
        return [r for r in self.steps() if (start is None or r >= start) and (end is None or r <= end)]

    def read(self, rollout_id: int, columns: list[str] | None = None) -> Any:
        _, pq = _arrow()
        path = self.path(rollout_id)
        if not path.exists():
            raise LedgerError(f"ledger {self.dir}: no step {rollout_id} (steps: {_span(self.steps())})")
        return pq.read_table(path, columns=columns)

    def read_range(self, start: int | None = None, end: int | None = None, columns: list[str] | None = None) -> Any:
        pa, _ = _arrow()
        tables = [self.read(r, columns) for r in self.select(start, end)]
        if not tables:
            return schema().empty_table() if columns is None else pa.table({c: [] for c in columns})
        return pa.concat_tables(tables)

    def groups(self, rollout_id: int) -> list[LedgerGroup]:
        return groups_of(self.read(rollout_id))

    def iter_groups(self, start: int | None = None, end: int | None = None) -> Iterator[LedgerGroup]:
        for rid in self.select(start, end):
            yield from self.groups(rid)

    def find(self, group_id: str, rollout_id: int | None = None) -> LedgerGroup:
        """A group by id (the newest step holding it; or in `rollout_id`)."""
        steps = [rollout_id] if rollout_id is not None else list(reversed(self.steps()))
        for rid in steps:
            ids = self.read(rid, ["group_id"]).column("group_id").to_pylist()
            if group_id in ids:
                for g in self.groups(rid):
                    if g.group.group_id == group_id:
                        return g
        raise LedgerError(f"ledger {self.dir}: no group {group_id!r}" + (f" in step {rollout_id}" if rollout_id is not None else ""))


def groups_of(table: Any) -> list[LedgerGroup]:
    """Rows of one or more steps -> the wire groups, in (step, position, sample) order."""
    rows = table.to_pylist()
    rows.sort(key=lambda r: (r["rollout_id"], r["position"], r["sample_index"]))
    out: list[LedgerGroup] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and (rows[j]["rollout_id"], rows[j]["position"]) == (rows[i]["rollout_id"], rows[i]["position"]):
            j += 1
        out.append(_group_of(rows[i:j]))
        i = j
    return out


def _group_of(rows: list[dict[str, Any]]) -> LedgerGroup:
    first = rows[0]
    samples = [
        Sample.build(
            tokens=np.asarray(r["tokens"], dtype=TOKEN_DTYPE),
            response_length=r["response_length"],
            loss_mask=np.asarray(r["loss_mask"], dtype=MASK_DTYPE),
            rollout_log_probs=np.asarray(r["rollout_log_probs"], dtype=LOGPROB_DTYPE),
            reward=r["reward"],
            status=r["status"],
            reward_components=msgspec.json.decode(r["reward_components"]),
            weight_versions=list(r["weight_versions"]),
            policy_versions=list(r["policy_versions"]),
            policy_run=r["policy_run"],
            prompt=msgspec.json.decode(r["prompt"]),
            response=r["response"],
            label=r["label"],
            metadata=msgspec.json.decode(r["metadata"]),
        )
        for r in rows
    ]
    group = SampleGroup(
        group_id=first["group_id"], task=msgspec.json.decode(first["task"], type=Task),
        admission_version=first["admission_version"], n_samples=len(samples), samples=samples,
        worker_id=first["worker_id"], timings=msgspec.json.decode(first["timings"]),
        epoch=first["epoch"], attempt=first["attempt"],
    )
    return LedgerGroup(first["rollout_id"], first["position"], first["stream_id"], first["oldest_version"], group)


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]} ({len(steps)} files)"


# ------------------------------------------------------------------- analysis

def summarize(ledger: Ledger, start: int | None = None, end: int | None = None) -> list[dict[str, Any]]:
    """Per step: groups, samples, failed, reward mean per env, staleness mean/max,
    response length mean/max."""
    out = []
    for rid in ledger.select(start, end):
        rows = ledger.read(rid, LIGHT_COLUMNS).to_pylist()
        if not rows:
            continue
        by_env: dict[str, list[float]] = {}
        for r in rows:
            by_env.setdefault(r["env"], []).append(r["reward"])
        groups = {r["position"]: r["staleness"] for r in rows}
        lengths = [r["response_length"] for r in rows]
        out.append({
            "step": rid,
            "groups": len(groups),
            "samples": len(rows),
            "failed": sum(r["status"] == Status.FAILED.value for r in rows),
            "reward_mean": {env: sum(v) / len(v) for env, v in sorted(by_env.items())},
            "staleness_mean": sum(groups.values()) / len(groups),
            "staleness_max": max(groups.values()),
            "response_length_mean": sum(lengths) / len(lengths),
            "response_length_max": max(lengths),
        })
    return out


def list_steps(ledger: Ledger) -> list[dict[str, Any]]:
    _, pq = _arrow()
    out = []
    for rid in ledger.steps():
        path = ledger.path(rid)
        groups = len(set(pq.read_table(path, columns=["position"]).column("position").to_pylist()))
        envs = sorted(set(pq.read_table(path, columns=["env"]).column("env").to_pylist()))
        out.append({"step": rid, "file": path.name, "bytes": path.stat().st_size, "groups": groups,
                    "samples": pq.ParquetFile(path).metadata.num_rows, "envs": envs})
    return out


def export(ledger: Ledger, output: str | os.PathLike[str], *, start: int | None = None, end: int | None = None,
           fmt: str | None = None) -> int:
    """Steps [start, end] to JSONL (one sample a line, JSON columns decoded) or Parquet; returns rows."""
    out = Path(output)
    fmt = fmt or ("parquet" if out.suffix == ".parquet" else "jsonl")
    steps = ledger.select(start, end)
    if not steps:
        raise LedgerError(f"ledger {ledger.dir}: no steps in [{start}, {end}] (steps: {_span(ledger.steps())})")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = 0
    if fmt == "parquet":
        table = ledger.read_range(start, end)
        _write_atomic(table, out)
        return table.num_rows
    if fmt != "jsonl":
        raise LedgerError(f"export format {fmt!r}: use jsonl or parquet")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    encoder = msgspec.json.Encoder()
    try:
        with open(tmp, "wb") as f:
            for rid in steps:
                for row in ledger.read(rid).to_pylist():
                    for name in JSON_COLUMNS:
                        row[name] = msgspec.json.decode(row[name])
                    f.write(encoder.encode(row) + b"\n")
                    rows += 1
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return rows


# ------------------------------------------------------------------------ CLI

@dataclass(frozen=True)
class LedgerAction:
    """An action a higher layer adds to `rollout ledger` (workers/rescore.py: `rescore`): a
    subcommand with the common arguments and its own, run when chosen; a LedgerError it raises
    is reported as the others' are."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_common_args(sp: argparse.ArgumentParser, ranged: bool = True) -> None:
    sp.add_argument("--dir", required=True, help="the ledger directory (pipeline_ledger_dir)")
    if ranged:
        sp.add_argument("--from", dest="start", type=int, default=None, help="first step (inclusive)")
        sp.add_argument("--to", dest="end", type=int, default=None, help="last step (inclusive)")
    sp.add_argument("--json", action="store_true", help="JSON instead of a table")


def build_parser(extra: Sequence[LedgerAction] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout ledger", description="Read the ledger of trained groups.")
    sub = p.add_subparsers(dest="action", required=True)
    add_common_args(sub.add_parser("list", help="steps, files, sizes, groups"), ranged=False)
    add_common_args(sub.add_parser("summary", help="reward per env, staleness, response lengths per step"))
    ex = sub.add_parser("export", help="export steps to JSONL or Parquet")
    add_common_args(ex)
    ex.add_argument("--output", "-o", required=True, help="out.jsonl or out.parquet")
    ex.add_argument("--format", choices=["jsonl", "parquet"], default=None, help="default: from the suffix")
    for action in extra:
        sp = sub.add_parser(action.name, help=action.help)
        add_common_args(sp)
        action.add_arguments(sp)
    return p


def main(argv: list[str] | None = None, extra: Sequence[LedgerAction] = ()) -> int:
    args = build_parser(extra).parse_args(argv)
    chosen = {action.name: action.run for action in extra}.get(args.action, _dispatch)
    try:
        return chosen(args)
    except LedgerError as exc:
        print(f"rollout ledger: {exc}", file=sys.stderr)
        return 2


def open_ledger(args: argparse.Namespace) -> Ledger:
    """The ledger at `--dir`, or LedgerError (pyarrow missing, not a directory)."""
    ledger = Ledger(args.dir)
    require_pyarrow()
    if not ledger.dir.is_dir():
        raise LedgerError(f"{ledger.dir} is not a directory")
    return ledger


def _dispatch(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    ledger = open_ledger(args)
    if args.action == "list":
        rows = list_steps(ledger)
        if args.json:
            print(_json(rows))
            return 0
        table = Table("step", "file", "bytes", "groups", "samples", "envs", title=f"ledger {ledger.dir}")
        for r in rows:
            table.add_row(str(r["step"]), r["file"], f"{r['bytes']:,}", str(r["groups"]), str(r["samples"]), ", ".join(r["envs"]))
        console.print(table)
        return 0
    if args.action == "summary":
        rows = summarize(ledger, args.start, args.end)
        if args.json:
            print(_json(rows))
            return 0
        envs = sorted({e for r in rows for e in r["reward_mean"]})
        table = Table("step", "groups", "failed", *[f"reward {e}" for e in envs], "stale mean", "stale max",
                      "len mean", "len max", title=f"ledger {ledger.dir}")
        for r in rows:
            table.add_row(
                str(r["step"]), str(r["groups"]), str(r["failed"]),
                *[f"{r['reward_mean'][e]:.3f}" if e in r["reward_mean"] else "" for e in envs],
                f"{r['staleness_mean']:.2f}", str(r["staleness_max"]),
                f"{r['response_length_mean']:.0f}", str(r["response_length_max"]),
            )
        console.print(table)
        return 0
    if args.action == "export":
        n = export(ledger, args.output, start=args.start, end=args.end, fmt=args.format)
        print(_json({"output": str(args.output), "rows": n}) if args.json else f"wrote {n} samples to {args.output}")
        return 0
    raise LedgerError(f"unknown action {args.action!r}")
