"""The group buffer: a Redis stream of scored SampleGroups with one consumer group.

Delivery rules (docs/architecture.md "Delivery"):
- push is one optimistic transaction: WATCH the dedup marker, MULTI{SET marker, XADD,
  counters}EXEC, so a job re-run after a crash never stores a second copy (concurrent
  pushes of one process share one transaction). The marker's value is the push's
  operation id, written with an operation key in the same EXEC: a retry after a lost
  EXEC reply sees the key and knows which groups *it* stored (not duplicates);
- every other write (requeue, dead letters, acks with counters) runs through
  `redis_conn.run_once`, so a lost reply never applies it twice;
- readers get their own pending entries first, then new ones (XREADGROUP); a consumer
  with more pending entries than the caller accounts for (an XREADGROUP reply lost on
  the wire) scans its pending list again;
- ack = XACK + XDEL: the stream holds only entries not yet acknowledged, so nothing
  unconsumed is ever trimmed and memory is bounded by admission control instead;
- an entry that does not decode is moved to the dead-letter stream with the reason
  and acknowledged; reading goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError, WatchError

from pipeline.keys import TRAINER_GROUP, Counter, Keys
from pipeline.schema import SampleGroup, SchemaError, decode_group, encode
from pipeline.store.redis_conn import ALREADY, OP_TTL_S, confirm_replicated, new_op_id, run_once

log = logging.getLogger(__name__)

# A group's dedup marker refuses a second push of it (a re-run, a zombie's late push) for
# DEDUP_TTL_S: longer than any job can still run (a week by default). Environment:
# ROLLOUT_DEDUP_TTL_S. One marker per group, ~90 B (docs/reliability.md "Memory").
DEDUP_TTL_S = int(os.environ.get("ROLLOUT_DEDUP_TTL_S", str(7 * 24 * 3600)))
RECENT_KEEP = int(os.environ.get("ROLLOUT_RECENT_KEEP", "2000"))  # group summaries kept for the monitor
# `{ns}:dead` is bounded: about the newest DEAD_MAXLEN letters are kept (XADD MAXLEN ~; the
# `dead` counter keeps the total), each payload capped at DEAD_PAYLOAD_MAX bytes (the letter
# says how long it was). Environment: ROLLOUT_DEAD_MAXLEN, ROLLOUT_DEAD_PAYLOAD_MAX.
DEAD_MAXLEN = int(os.environ.get("ROLLOUT_DEAD_MAXLEN", "10000"))
DEAD_PAYLOAD_MAX = int(os.environ.get("ROLLOUT_DEAD_PAYLOAD_MAX", str(64 * 1024)))
ID_UNKNOWN = "0-0"  # push/requeue stored the group, but the reply with its stream id was lost
HANDED_BACK = b"handed-back"  # dedup marker value of a group whose task was handed back (a tombstone)

class GroupSummary(msgspec.Struct, kw_only=True, array_like=True):
    """A few numbers per pushed group, kept in `{ns}:recent` for the monitor."""

    env: str
    admission_version: int
    reward_mean: float
    failed: int  # episodes with status failed
    tokens: int  # response tokens
    pushed_at: float
    episodes: int = 0  # samples in the group (0 in summaries written before this field existed)


_summary_encoder = msgspec.msgpack.Encoder()
summary_decoder = msgspec.msgpack.Decoder(GroupSummary)


def summarize(group: SampleGroup) -> GroupSummary:
    rewards = group.rewards()
    return GroupSummary(
        env=group.env,
        admission_version=group.admission_version,
        reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
        failed=sum(1 for s in group.samples if s.status.value == "failed"),
        tokens=sum(s.response_length for s in group.samples),
        pushed_at=time.time(),
        episodes=len(group.samples),
    )


@dataclass
class _Push:
    marker: str
    fields: dict[Any, Any]  # stream entry fields (redis-py's xadd wants its own key/value union)
    deltas: dict[str, int]
    summary: bytes
    future: asyncio.Future


@dataclass(frozen=True)
class Entry:
    stream_id: str
    group: SampleGroup


class GroupBuffer:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, dedup_ttl_s: int = DEDUP_TTL_S):
        self.redis = redis
        self.keys = keys
        self.dedup_ttl_s = dedup_ttl_s
        self._outbox: list[_Push] = []
        self._flusher: asyncio.Future | None = None
        self._pending_cursor: dict[str, str] = {}  # consumer -> last pending id handed out

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.groups, TRAINER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ------------------------------------------------------------ write side
    async def push(self, group: SampleGroup, **counter_deltas: int) -> str | None:
        """Store `group` once. Returns its stream id, or None when it was already pushed.

        `counter_deltas` (e.g. running=-1) are applied atomically with the push, and
        only when the group was actually stored.
        """
        item = _Push(
            marker=self.keys.dedup(group.group_id),
            fields={"g": encode(group), "id": group.group_id},
            deltas=counter_deltas,
            summary=_summary_encoder.encode(summarize(group)),
            future=asyncio.get_running_loop().create_future(),
        )
        self._outbox.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await item.future

    async def _flush(self) -> None:
        """Store every queued push in one transaction; repeat while pushes keep arriving.

        Coalescing concurrent pushes of one process saves round trips; the payload
        stays out of Lua (Redis copies script arguments into Lua at ~1.6 us per KB,
        on its only thread).
        """
        while self._outbox:
            batch, self._outbox = self._outbox, []
            try:
                results: Sequence[str | BaseException | None] = await self._store(batch)
            except Exception as exc:  # connection lost: every caller of this batch sees it
                results = [exc] * len(batch)
            for item, result in zip(batch, results):
                if item.future.done():
                    continue
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)

    async def _store(self, batch: list[_Push]) -> list[str | None]:
        """WATCH the dedup markers, then MULTI{SET marker, XADD, counters}EXEC for the
        absent ones. A concurrent push of the same group elsewhere changes a watched
        marker, aborts the EXEC, and the retry sees the marker: stored exactly once.

        The markers this EXEC writes hold its operation id, and the EXEC also sets the
        operation key: when the reply is lost (WatchError on the retry), the next look
        finds the key and reports the groups whose marker holds our id as stored
        (`ID_UNKNOWN`) and nothing is counted again."""
        markers = [item.marker for item in batch]
        op_id = new_op_id()
        op_key = self.keys.op(op_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(op_key, *markers)
                    applied, *present = await pipe.mget(op_key, *markers)
                    if applied is not None:  # our EXEC went through; its reply was lost
                        await pipe.unwatch()
                        if not await confirm_replicated(self.redis, witness=op_key):
                            continue  # a failover lost it after all: store it again
                        return self._recovered(batch, present, op_id.encode())
                    pipe.multi()
                    xadd_at: list[int | None] = []  # position of each stored item's XADD reply
                    stored: dict[str, _Push] = {}
                    for item, seen in zip(batch, present):
                        if seen is None and item.marker not in stored:
                            stored[item.marker] = item
                            xadd_at.append(len(pipe))
                            pipe.xadd(self.keys.groups, item.fields)
                            pipe.set(item.marker, op_id, ex=self.dedup_ttl_s)
                        else:
                            xadd_at.append(None)
                    self._queue_totals(pipe, list(stored.values()), duplicates=len(batch) - len(stored))
                    pipe.set(op_key, b"1", ex=OP_TTL_S)
                    replies = await pipe.execute()
                    if not await confirm_replicated(self.redis, witness=op_key):
                        continue  # a failover lost the EXEC before a replica had it: store it again
                    return [None if at is None else replies[at].decode() for at in xadd_at]
                except WatchError:
                    await pipe.reset()
                    continue

    @staticmethod
    def _recovered(batch: list[_Push], present: list[bytes | None], mine: bytes) -> list[str | None]:
        seen: set[str] = set()
        out: list[str | None] = []
        for item, value in zip(batch, present):
            out.append(ID_UNKNOWN if value == mine and item.marker not in seen else None)
            seen.add(item.marker)
        log.info("push: a lost reply; %d of %d group(s) were stored by it", sum(o is not None for o in out), len(out))
        return out

    def _queue_totals(self, pipe: Any, stored: list[_Push], *, duplicates: int) -> None:
        """Counters and monitor summaries of a whole batch in a few commands, not a few per
        group: per-command client cost is what a push batch spends most of its time on."""
        totals: dict[str, int] = {Counter.BUFFERED: len(stored), Counter.DUPLICATES: duplicates}
        for item in stored:
            for name, delta in item.deltas.items():
                totals[name] = totals.get(name, 0) + int(delta)
        for name, total in totals.items():
            if total:
                pipe.hincrby(self.keys.counters, name, total)
        if stored:
            pipe.lpush(self.keys.recent, *(item.summary for item in stored))
            pipe.ltrim(self.keys.recent, 0, RECENT_KEEP - 1)

    async def requeue(self, group: SampleGroup, *, op_id: str | None = None) -> str:
        """Put back a group the trainer handed back (slime's add_samples): no dedup check, but
        once per call (`op_id`), whatever replies are lost. It is open again at its admission
        clock (due-first takes it as the oldest it is)."""
        fields: dict[Any, Any] = {"g": encode(group), "id": group.group_id}

        def stage(pipe: Pipeline) -> None:
            pipe.xadd(self.keys.groups, fields)
            pipe.zadd(self.keys.open, {group.group_id: group.admission_version})

        replies = await run_once(self.redis, self.keys.op(op_id or new_op_id()), stage)
        return ID_UNKNOWN if replies is ALREADY else replies[0].decode()

    async def dead_letter(
        self, *, source: str, reason: str, payload: bytes = b"", ref: str = "", op_id: str | None = None
    ) -> None:
        """One dead letter, written once per call (`op_id`: once per logical operation)."""
        await run_once(
            self.redis, self.keys.op(op_id or new_op_id()),
            lambda pipe: self.stage_dead_letter(pipe, source=source, reason=reason, payload=payload, ref=ref),
        )

    def stage_tombstone(self, pipe: Pipeline, group_id: str) -> None:
        """Mark `group_id` as handed back: a late push of it (a zombie worker's) is refused."""
        pipe.set(self.keys.dedup(group_id), HANDED_BACK, ex=self.dedup_ttl_s)

    def stage_dead_letter(self, pipe: Pipeline, *, source: str, reason: str, payload: bytes = b"", ref: str = "") -> None:
        """Add the dead letter to the caller's transaction (it applies with the caller's other writes)."""
        fields: dict[Any, Any] = {"source": source, "reason": reason[:2000], "ref": ref, "payload": payload[:DEAD_PAYLOAD_MAX],
                  "at": f"{time.time():.3f}"}
        if len(payload) > DEAD_PAYLOAD_MAX:
            fields["payload_bytes"] = str(len(payload))  # cut: the whole payload was this long
        pipe.xadd(self.keys.dead, fields, maxlen=DEAD_MAXLEN, approximate=True)
        pipe.hincrby(self.keys.counters, Counter.DEAD, 1)
        log.warning("dead-lettered %s entry %s: %s", source, ref or "?", reason[:300])

    # ------------------------------------------------------------- read side
    async def read(
        self, consumer: str, count: int, *, block_ms: int | None = None, exclude: frozenset[str] = frozenset()
    ) -> list[Entry]:
        """Up to `count` entries: this consumer's pending ones first, then new ones.

        `exclude` skips pending ids the caller accounts for itself (the slime side's
        recorded rollout steps). Blocks up to `block_ms` for new entries (None = no wait).
        """
        if self._pending_cursor.get(consumer) == "+" and await self._pending_count(consumer) > len(exclude):
            # more pending entries than the caller accounts for: an XREADGROUP delivered entries
            # whose reply was lost (the retry read further). Scan this consumer's list again.
            log.warning("consumer %s has pending entries nobody recorded; scanning its pending list again", consumer)
            self._pending_cursor[consumer] = "-"
        entries = await self._read_pending(consumer, count, exclude)
        if len(entries) < count:
            entries += await self._read_new(consumer, count - len(entries), block_ms)
        return entries

    async def _pending_count(self, consumer: str) -> int:
        try:
            info = await self.redis.xpending(self.keys.groups, TRAINER_GROUP)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return 0
        for row in (info or {}).get("consumers") or []:
            name = row["name"].decode() if isinstance(row["name"], bytes) else str(row["name"])
            if name == consumer:
                return int(row["pending"])
        return 0

    async def _read_pending(self, consumer: str, count: int, exclude: frozenset[str]) -> list[Entry]:
        entries: list[Entry] = []
        cursor: str | None = self._pending_cursor.get(consumer, "-")
        while cursor is not None and len(entries) < count:
            rows = await self.redis.xpending_range(
                self.keys.groups, TRAINER_GROUP, min=cursor, max="+", count=max(count, 64), consumername=consumer
            )
            if not rows:
                cursor = None
                break
            ids = [r["message_id"].decode() for r in rows]
            cursor = "(" + ids[-1]
            wanted = [i for i in ids if i not in exclude][: count - len(entries)]
            if wanted:
                entries += await self.fetch(wanted)
                cursor = "(" + wanted[-1]
        self._pending_cursor[consumer] = cursor if cursor is not None else "+"
        return entries

    async def _read_new(self, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
        try:
            reply = await self.redis.xreadgroup(
                TRAINER_GROUP, consumer, {self.keys.groups: ">"}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.ensure_group()  # Redis lost its data (restart without persistence)
            return []
        if not reply:
            return []
        _stream, rows = reply[0]
        return await self._decode_rows(rows)

    async def fetch(self, ids: Iterable[str]) -> list[Entry]:
        """Entries by id, in the given order; ids no longer in the stream are skipped."""
        pipe = self.redis.pipeline(transaction=False)
        ids = list(ids)
        for entry_id in ids:
            pipe.xrange(self.keys.groups, min=entry_id, max=entry_id, count=1)
        replies = await pipe.execute()
        rows = [reply[0] for reply in replies if reply]
        missing = len(ids) - len(rows)
        if missing:
            log.error("%d requested buffer entries are gone from %s", missing, self.keys.groups)
        return await self._decode_rows(rows)

    async def _decode_rows(self, rows: list) -> list[Entry]:
        entries: list[Entry] = []
        for raw_id, fields in rows:
            entry_id = raw_id.decode()
            payload = fields.get(b"g", b"")
            try:
                entries.append(Entry(entry_id, decode_group(payload)))
            except SchemaError as exc:
                # one transaction, once per entry: neither a crash nor a lost reply dead-letters it twice
                def stage(pipe: Pipeline, reason: str = str(exc), entry_id: str = entry_id, payload: bytes = payload,
                          group_id: bytes | None = fields.get(b"id")) -> None:
                    self.stage_dead_letter(pipe, source="groups", reason=reason, payload=payload, ref=entry_id)
                    self.stage_ack(pipe, [entry_id])
                    if group_id:
                        pipe.zrem(self.keys.open, group_id)

                await run_once(self.redis, self.keys.op(f"dead:{self.keys.groups}:{entry_id}"), stage)
        return entries

    async def ack(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=True)
        self.stage_ack(pipe, ids)
        await pipe.execute()
        # replica acks on: XACK + XDEL again (idempotent) right before WAIT, so that it covers the
        # ack on whichever primary answers (it has no key to witness it)
        await confirm_replicated(self.redis, redo=lambda again: self.stage_ack(again, ids))

    def stage_ack(self, pipe: Pipeline, ids: list[str]) -> None:
        """Queue XACK + XDEL of `ids` on `pipe`, so an ack can share a caller's transaction."""
        pipe.xack(self.keys.groups, TRAINER_GROUP, *ids)
        pipe.xdel(self.keys.groups, *ids)

    async def depth(self) -> tuple[int, int]:
        """(ready, pending): groups not yet handed out, and handed out but not acknowledged."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xlen(self.keys.groups)
        pipe.xpending(self.keys.groups, TRAINER_GROUP)
        try:
            length, pending = await pipe.execute()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return 0, 0
        n_pending = int(pending["pending"]) if pending else 0
        return max(0, int(length) - n_pending), n_pending
