"""Evaluation in the background (`pipeline_eval_mode: background`): a round never holds a step.

slime's `evaluation=True` call (`pipeline.eval.evaluation.evaluate`) then only starts a round: its
record goes into `{ns}:eval_rounds` (Redis, so a restarted trainer finds it), its jobs into the
arq queue behind the jobs of earlier rounds, and the call returns at once. Rounds are collected
without waiting at every later rollout call (`report_finished`, from `generate_rollout`) and at
every eval call; the eval call of the run's last rollout (`num_rollout - 1`), after which no
step is left to hold, waits for every round in flight and for its own.

The rule for a round due while others are in flight: at most `pipeline_eval_max_rounds` rounds
are in flight (default 1); a round due beyond that is skipped, counted (`skipped`), and the next
due round starts once one has ended. With a limit above 1, a later round's jobs queue behind
the earlier round's (queue scores follow each other). The run's last eval call is never
skipped: it waits for the rounds in flight, then runs its own to the end.

One version per result: the weights move while a background round runs (train_async.py pushes
after every `--update-weights-interval` steps), so a round's groups are split by the policy
versions of their tokens (`Sample.token_version_runs`, from the engines' labels): a group whose
every token came from version v is reported under v, at slime's rollout step `v - 1` (the step
whose training produced v, where slime's own blocking eval after that step logs it; v = 0 at
step 0); a group with tokens of several versions is "mixed": reported under the version most
of its tokens came from (`reported_version`), counted there (`eval/<name>/groups_mixed`) and
named (the round's summary and log), so that every task with a result is in one version's
figure (left out, the slow tasks, whose answers span a push, would be in none). Each
version's slice is logged with slime's own `log_eval_rollout_data` (so `eval/<name>`, its
pass rate and response lengths are slime's, and `--custom-eval-rollout-log-function-path` is
honoured), with the pipeline's `eval/<name>/pass@k` beside them.

Reporting a round, in order: the ledger (`<ledger>/eval/step-<rollout>.parquet`, the round's
groups, and `round-<rollout>.json`, its summary: both rewritten identically after a crash), the
mark `<rollout id>:logged` in `{ns}:eval_calls`, the log (wandb/tensorboard through slime), then
one transaction that retires the record into `{ns}:eval_done`, writes each dataset's result for
the monitor (`{ns}:eval_results`) and deletes the stream. A crash after the mark retires the round
unlogged on the next report: at most once to wandb. A round starts once per rollout id (the
`<rollout id>` field of `{ns}:eval_calls`, written with its record): a resumed trainer that
replays an eval call starts no second round; no job is ever enqueued twice. A round whose every group failed (its
engines died: episodes fail, workers report errors) or that passed `pipeline_eval_timeout_s`
(its queued jobs withdrawn, the missing tasks named) is reported failed.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from pipeline.eval.evaluation import (
    SHOW,
    DatasetResult,
    EvalDataset,
    _enqueue,
    _withdraw,
    dataset_metrics,
    dataset_result,
    eval_group_id,
    sample_versions,
    stage_results,
)
from pipeline.schema import SampleGroup, Status, Task, decode_group
from pipeline.store.buffer import Entry

log = logging.getLogger(__name__)

WAIT_POLL_S = 1.0  # the last rollout's eval call: how often it looks at the rounds in flight
STREAM_READ = 1000  # entries per XRANGE while collecting a round
MIXED_NAMED = 200  # mixed groups named in a round's summary (all are counted)


class RoundRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One background round in flight, as `{ns}:eval_rounds` holds it."""

    round_id: str
    rollout_id: int  # slime's eval call that started it
    version: int  # the version `{ns}:policy` held then (the jobs' admission version)
    started_at: float  # Redis's clock (TIME), as the stream ids: a restarted trainer measures the timeout from it
    names: list[str]  # dataset keys, in the datasets file's order
    wanted: list[tuple[str, str, int, str]]  # (eval group id, dataset, position, task id)


class RoundSummary(msgspec.Struct, kw_only=True, frozen=True):
    """A reported round (`{ns}:eval_done`, the ledger's `round-<rollout>.json`)."""

    round_id: str
    rollout_id: int
    state: str  # "finished" or "failed"
    versions: dict[int, int]  # version -> groups reported under it
    groups: int
    groups_failed: int
    groups_mixed: int
    mixed: list[str]  # the mixed groups' task ids, "<dataset>/<task>" (the first MIXED_NAMED)
    started_at: float  # Redis's clock (TIME)
    round_s: float  # from its start to its last group (or its timeout)
    reported_after_s: float  # from its start to its report
    reason: str = ""
    results: dict[str, DatasetResult] = {}  # per dataset: the round's figures over every task (the monitor)


class Finished(msgspec.Struct, kw_only=True):
    record: RoundRecord
    got: dict[str, tuple[str, SampleGroup]]  # group id -> (stream id, group)
    failed: dict[str, str]  # group id -> error
    missing: list[str]  # group ids neither got nor failed (timed out)
    ended_at: float  # Redis's clock: the last entry's time, or now when timed out
    now: float  # Redis's clock when collected


# ------------------------------------------------------------------ the eval call

def evaluate_in_background(args: Any, rollout_id: int, ds: Any, datasets: list[tuple[EvalDataset, list[Task]]]
                           ) -> dict[str, float]:
    """Report what earlier rounds finished, start this one (or skip it), and return the
    bookkeeping metrics slime logs at this eval call's step. At the run's last rollout, wait
    for every round in flight first (nothing is left to hold)."""
    started = time.monotonic()
    reported = report_finished(args, ds)
    num_rollout = getattr(args, "num_rollout", None)
    last = num_rollout is not None and rollout_id >= int(num_rollout) - 1
    if last:  # no step left to hold: the rounds in flight end, then this one runs to its end
        reported += _wait_for_rounds(args, ds)
    record = ds._run(start_round(ds, rollout_id, datasets))
    if last:
        reported += _wait_for_rounds(args, ds)
    counts = ds._run(round_counts(ds._redis, ds.keys))
    return {
        "eval/pipeline/round_started": float(record is not None),
        "eval/pipeline/rounds_reported_now": float(reported),
        "eval/pipeline/rounds_running": counts["running"],
        "eval/pipeline/rounds_queued": counts["queued"],
        "eval/pipeline/rounds_skipped": counts["skipped"],
        "eval/pipeline/rounds_reported": counts["reported"],
        "eval/pipeline/rounds_failed": counts["failed"],
        "eval/pipeline/call_s": time.monotonic() - started,
    }


def _wait_for_rounds(args: Any, ds: Any) -> int:
    reported = 0
    while ds._run(ds._redis.hlen(ds.keys.eval_rounds)):
        time.sleep(WAIT_POLL_S)
        reported += report_finished(args, ds)
    return reported


async def start_round(ds: Any, rollout_id: int, datasets: list[tuple[EvalDataset, list[Task]]]
                      ) -> RoundRecord | None:
    """Enqueue the round behind the rounds in flight, or skip it when `eval_max_rounds` are."""
    redis, keys, settings = ds._redis, ds.keys, ds.settings
    if await _started_for(redis, keys, rollout_id):  # a resumed trainer replays the call: neither run nor skipped
        return None
    in_flight = await redis.hlen(keys.eval_rounds)
    if in_flight >= settings.eval_max_rounds:
        skipped = await redis.hincrby(keys.eval_stats, "skipped", 1)
        log.warning("eval at rollout %d skipped: %d round(s) in flight (pipeline_eval_max_rounds %d); %d skipped "
                    "so far", rollout_id, in_flight, settings.eval_max_rounds, skipped)
        return None
    stamp = await ds.state.get_policy()
    version = stamp.version if stamp is not None else await ds.state.get_version()
    round_id = f"{rollout_id}-{uuid.uuid4().hex[:8]}"
    wanted = [(eval_group_id(round_id, d.key, t.id), d.key, i, t.id) for d, tasks in datasets
              for i, t in enumerate(tasks)]
    record = RoundRecord(round_id=round_id, rollout_id=rollout_id, version=version, started_at=await _now(redis),
                         names=[d.key for d, _ in datasets], wanted=wanted)
    seq = await _record_round(redis, keys, record)
    if seq is None:
        return None
    enqueued: dict[str, tuple[str, int, str]] = {}
    try:
        await _enqueue(redis, keys, round_id, datasets, version, settings.eval_timeout_s, enqueued, score_base=seq)
    except BaseException:  # no round: the call, if made again, starts one
        await _withdraw(redis, keys, list(enqueued), unfinished=list(enqueued))
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hdel(keys.eval_rounds, round_id)
            pipe.hdel(keys.eval_calls, str(rollout_id))
            pipe.hincrby(keys.eval_stats, "started", -1)
            await pipe.execute()
        raise
    log.info("eval round %s (rollout %d) in the background: %d jobs behind %d round(s) in flight",
             round_id, rollout_id, len(wanted), in_flight)
    return record


async def _record_round(redis: Any, keys: Any, record: RoundRecord) -> int | None:
    """One transaction: the round's rollout id marked started (`{ns}:eval_calls`), its record,
    and its first queue position (`seq`); None, and nothing written, when that rollout id's
    call started a round already (a resumed trainer replaying the call). The record first, the
    jobs after: a crash between them leaves a round that times out, never a second one."""
    from redis.exceptions import WatchError

    while True:
        async with redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(keys.eval_calls, keys.eval_stats)
                if await _started_for(pipe, keys, record.rollout_id):
                    return None
                seq = int(await pipe.hget(keys.eval_stats, "seq") or 0)
                pipe.multi()
                pipe.hset(keys.eval_calls, str(record.rollout_id), record.round_id)
                pipe.hset(keys.eval_rounds, record.round_id, msgspec.json.encode(record))
                pipe.hincrby(keys.eval_stats, "seq", len(record.wanted))
                pipe.hincrby(keys.eval_stats, "started", 1)
                await pipe.execute()
                return seq
            except WatchError:
                continue  # a worker never writes these: another trainer (or a monitor test) did; read again


async def _started_for(redis: Any, keys: Any, rollout_id: int) -> bool:
    earlier = await redis.hget(keys.eval_calls, str(rollout_id))
    if earlier is not None:
        log.warning("eval at rollout %d: round %s was started for it already (a resumed trainer replays the "
                    "call); no second round", rollout_id, earlier.decode())
    return earlier is not None


async def _now(redis: Any) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def round_counts(redis: Any, keys: Any) -> dict[str, int]:
    """Rounds running (the oldest in flight), queued (behind it), and the counts so far."""
    in_flight = int(await redis.hlen(keys.eval_rounds))
    stats = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.eval_stats)).items()}
    return {"running": min(1, in_flight), "queued": max(0, in_flight - 1), "skipped": stats.get("skipped", 0),
            "reported": stats.get("reported", 0), "failed": stats.get("failed", 0), "started": stats.get("started", 0)}


# ------------------------------------------------------------------ collecting

def report_finished(args: Any, ds: Any) -> int:
    """Report every round in flight that has ended (all groups back, or past its timeout);
    never waits for one. Returns how many were reported."""
    done = ds._run(collect_ended(ds))
    for fin in done:
        summary, logs = split_round(fin)
        _write_ledger(ds, fin, summary)
        if ds._run(_claim_log(ds, summary)):
            for step, data, metrics in logs:
                log_eval(args, step, data, metrics)
        else:
            log.warning("eval round %s (rollout %d) was handed to the logger before a restart: not logged again",
                        summary.round_id, summary.rollout_id)
        ds._run(_retire(ds, summary))
    return len(done)


async def _claim_log(ds: Any, summary: RoundSummary) -> bool:
    """Mark the round's rollout id logged (`{ns}:eval_calls`), before the log: False when an
    earlier trainer marked it and crashed before the retire. Marked first, a crash inside the log
    call itself loses that round's log lines (the ledger and `{ns}:eval_done` keep the round);
    marked after, every crash between the log and the retire would log it twice."""
    return bool(await ds._redis.hsetnx(ds.keys.eval_calls, f"{summary.rollout_id}:logged", summary.round_id))


async def collect_ended(ds: Any) -> list[Finished]:
    redis, keys = ds._redis, ds.keys
    ended: list[Finished] = []
    records = sorted((msgspec.json.decode(raw, type=RoundRecord) for raw in (await redis.hvals(keys.eval_rounds))),
                     key=lambda r: r.started_at)
    now = await _now(redis) if records else 0.0
    for record in records:
        stream = keys.eval_stream(record.round_id)
        if await redis.xlen(stream) < len(record.wanted) and now - record.started_at <= ds.settings.eval_timeout_s:
            continue  # still running (an entry per group, at least)
        fin = Finished(record=record, got={}, failed={}, missing=[], ended_at=now, now=now)
        last_ms = 0
        wanted = {gid for gid, *_ in record.wanted}
        last = "-"
        while entries := await redis.xrange(stream, min=last, count=STREAM_READ):
            for raw_id, fields in entries:
                stream_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                gid = fields[b"id"].decode()
                last_ms = int(stream_id.split("-")[0])
                if gid in wanted and gid not in fin.got and gid not in fin.failed:
                    if b"error" in fields:
                        fin.failed[gid] = fields[b"error"].decode()
                    else:
                        fin.got[gid] = (stream_id, decode_group(fields[b"g"]))
            last = "(" + stream_id
            if len(entries) < STREAM_READ:
                break
        fin.missing = [gid for gid in wanted if gid not in fin.got and gid not in fin.failed]
        if not fin.missing and last_ms:
            fin.ended_at = last_ms / 1000
        # ended (every group back, or past its timeout): every job leaves the queue, not only the
        # missing ones: a job whose group is back is handed back to the queue if its worker stops
        # before arq's finish (pipeline/eval/evaluation.py `run_round`)
        await _withdraw(redis, keys, list(wanted), unfinished=fin.missing)
        ended.append(fin)
    return ended


def version_tokens(group: SampleGroup) -> dict[int, float]:
    """The generated tokens of a group's measured (not failed) samples, by the policy version
    that made them: per token where the engines said (`token_version_runs`), else a sample's
    tokens shared evenly by its per-call stamps."""
    counts: dict[int, float] = {}
    for sample in group.samples:
        if sample.status is Status.FAILED:
            continue
        runs = [(v, float(n)) for v, n in sample.token_version_runs if v >= 0 and n > 0]
        if not runs:
            stamps = set(sample.policy_versions)
            runs = [(v, sample.response_length / len(stamps)) for v in stamps]
        for version, tokens in runs:
            counts[version] = counts.get(version, 0.0) + tokens
    return counts


def reported_version(group: SampleGroup) -> tuple[int | None, bool]:
    """The version a group's result is reported under, and whether it is mixed (tokens of several
    versions): the version most of its tokens came from, the newer on a tie; None when every
    episode failed (no result)."""
    counts = version_tokens(group)
    if not counts:
        return None, False
    return max(counts, key=lambda v: (counts[v], v)), len(counts) > 1


def step_of_version(version: int) -> int:
    """slime's rollout step a version's results are logged at: the step whose training made it."""
    return max(0, version - 1)


def split_round(fin: Finished) -> tuple[RoundSummary, list[tuple[int, dict, dict]]]:
    """The round's summary and what to log: (rollout step, slime eval data, metrics) per version,
    then the round's own line at its eval call's step."""
    record = fin.record
    by_version: dict[int, dict[str, list[Entry]]] = {}
    mixed: dict[str, list[str]] = {}
    mixed_under: dict[tuple[int, str], int] = {}  # (version, dataset) -> mixed groups reported under it
    failed_groups: dict[str, int] = {name: 0 for name in record.names}
    for gid, name, _pos, task_id in record.wanted:  # task order
        if gid not in fin.got:
            failed_groups[name] += 1
            continue
        stream_id, group = fin.got[gid]
        version, is_mixed = reported_version(group)
        if version is None:
            failed_groups[name] += 1  # every episode failed (an engine down, say): no result at all
            continue
        if is_mixed:  # in a figure all the same: left out, the slow tasks would be missing from every one
            mixed.setdefault(name, []).append(task_id)
            mixed_under[version, name] = mixed_under.get((version, name), 0) + 1
        by_version.setdefault(version, {}).setdefault(name, []).append(Entry(stream_id, group))
    logs: list[tuple[int, dict, dict]] = []
    for version in sorted(by_version):
        data: dict[str, dict[str, Any]] = {}
        metrics: dict[str, Any] = {"eval/pipeline/policy_version": version,
                                   "eval/pipeline/round_rollout_id": record.rollout_id}
        for name in record.names:
            entries = by_version[version].get(name, [])
            if not entries:
                continue
            metrics.update(dataset_metrics(name, [e.group for e in entries]))
            metrics.pop(f"eval/{name}/groups_failed", None)  # the round's line counts those
            metrics[f"eval/{name}/groups"] = len(entries)
            metrics[f"eval/{name}/groups_mixed"] = mixed_under.get((version, name), 0)  # of those groups
            wire = [s for e in entries for s in e.group.samples]
            data[name] = {"rewards": [s.reward for s in wire], "truncated": [s.status is Status.TRUNCATED for s in wire],
                          "samples": trainer_samples(entries)}
        logs.append((step_of_version(version), data, metrics))
    groups_failed = sum(failed_groups.values())
    results = {name: dataset_result(
        record.rollout_id, record.round_id, sum(w[1] == name for w in record.wanted),
        [e.group for by_name in by_version.values() for e in by_name.get(name, [])],
        {v for v, by_name in by_version.items() if by_name.get(name)}, len(mixed.get(name, [])))
        for name in record.names}
    reason = ""
    if fin.missing:
        reason = (f"{len(fin.missing)} of {len(record.wanted)} groups missing after pipeline_eval_timeout_s; "
                  f"their queued jobs were withdrawn")
    state = "failed" if not by_version else "finished"  # failed: no group has a result
    if state == "failed" and not reason:
        errors = list(fin.failed.values())[:1]
        reason = f"every group failed ({errors[0] if errors else 'every episode failed'})"
    summary = RoundSummary(
        round_id=record.round_id, rollout_id=record.rollout_id, state=state,
        versions={v: sum(len(e) for e in by_name.values()) for v, by_name in sorted(by_version.items())},
        groups=len(record.wanted), groups_failed=groups_failed, groups_mixed=sum(len(t) for t in mixed.values()),
        mixed=[f"{name}/{t}" for name, tasks in mixed.items() for t in tasks][:MIXED_NAMED],
        started_at=record.started_at, round_s=fin.ended_at - record.started_at, reported_after_s=fin.now - record.started_at, reason=reason,
        results=results)
    line: dict[str, Any] = {"eval/pipeline/round_failed": float(state == "failed"),
                            "eval/pipeline/round_s": summary.round_s, "eval/pipeline/round_versions": len(by_version)}
    for name in record.names:
        line[f"eval/{name}/groups_failed"] = failed_groups[name]
        line[f"eval/{name}/groups_mixed"] = len(mixed.get(name, []))
    logs.append((record.rollout_id, {}, line))
    if mixed:
        log.info("eval round %s: %d mixed group(s) (tokens of several versions), each reported under the version "
                 "most of its tokens came from: %s", record.round_id, summary.groups_mixed,
                 ", ".join(summary.mixed[:SHOW]))
    (log.error if state == "failed" else log.info)(
        "eval round %s (rollout %d) %s after %.1fs: versions %s, %d failed, %d mixed%s", record.round_id,
        record.rollout_id, state, summary.round_s, summary.versions, groups_failed, summary.groups_mixed,
        f": {reason}" if reason else "")
    return summary, logs


def trainer_samples(entries: list[Entry]) -> list[Any]:
    """slime Samples of the groups, in order (`to_trainer_group`'s conversion, one GC pause for all)."""
    from pipeline.slime.samples import _gc_paused, _to_trainer_group

    with _gc_paused():
        return [s for i, e in enumerate(entries) for s in _to_trainer_group(e, i)]


def log_eval(args: Any, step: int, data: dict, metrics: dict) -> dict:
    """slime's own eval logger at rollout step `step` (its `eval/step` axis); without slime, or
    called with args slime's parser did not make (no `use_wandb`: outside slime's loop), the log."""
    try:
        from slime.observability.rollout_metrics import log_eval_rollout_data
    except ImportError:
        log_eval_rollout_data = None
    if log_eval_rollout_data is None or not hasattr(args, "use_wandb"):
        log.info("eval %d: %s", step, metrics)
        return metrics
    return log_eval_rollout_data(step, args, data, metrics)


def _write_ledger(ds: Any, fin: Finished, summary: RoundSummary) -> None:
    if getattr(ds, "ledger", None) is None:
        return
    from pipeline.ops.ledger import Ledger

    ledger = Ledger(Path(ds.ledger.dir) / "eval")
    entries = [Entry(*fin.got[gid]) for gid, *_ in fin.record.wanted if gid in fin.got]
    if entries:  # oldest_version: the group's oldest token (staleness: against the eval call's rollout id)
        ledger.write_step(fin.record.rollout_id, entries, oldest=lambda g: min(
            (v for s in g.samples for v in sample_versions(s)), default=fin.record.version))
    path = ledger.dir / f"round-{fin.record.rollout_id:08d}.json"
    ledger.dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(msgspec.to_builtins(summary), indent=1))
    tmp.replace(path)


async def _retire(ds: Any, summary: RoundSummary) -> None:
    redis, keys = ds._redis, ds.keys
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hdel(keys.eval_rounds, summary.round_id)
        pipe.hset(keys.eval_done, summary.round_id, msgspec.json.encode(summary))
        pipe.hincrby(keys.eval_stats, "failed" if summary.state == "failed" else "reported", 1)
        pipe.delete(keys.eval_stream(summary.round_id))
        stage_results(pipe, keys, summary.results)
        await pipe.execute()
