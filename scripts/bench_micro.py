"""Benchmark sections that need only pipeline/: codec, buffer, trainer hand-off.

Each section measures our path and its baseline side by side in the same process
and returns `Figure`s (value, baseline, ratio, goal).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
import uuid
from types import SimpleNamespace
from typing import Any

from pipeline.buffer import GroupBuffer
from pipeline.keys import TRAINER_GROUP, Keys
from pipeline.redis_conn import connect
from pipeline.schema import SampleGroup, decode_group, encode
from pipeline.slime import RedisDataSource, to_trainer_group
from pipeline.synthetic import make_group
from scripts.report import Figure
from scripts.timing import best_per_call, ratio

CODEC_GOAL = 100.0  # x faster than pickle-of-lists (DESIGN.md: ~1 us vs ~300 us)
BUFFER_GOAL = 0.5  # x raw redis-py pipelined stream ops
HANDOFF_GOAL_S = 0.5  # get_samples(64 groups x 16 x 4k tokens) incl. conversion
PUSH_CONCURRENCY = 64  # groups finishing at once in one worker process (its arq max_jobs)


# ------------------------------------------------------------------ codec

def _as_lists(group: SampleGroup) -> dict[str, Any]:
    """The same sample as plain Python lists: what a naive pipeline would pickle or JSON-encode."""
    s = group.samples[0]
    return {
        "group_id": group.group_id,
        "admission_version": group.admission_version,
        "tokens": s.token_array().tolist(),
        "response_length": s.response_length,
        "loss_mask": s.loss_mask_array().tolist(),
        "rollout_log_probs": s.log_prob_array().tolist(),
        "reward": s.reward,
        "status": s.status.value,
        "weight_versions": s.weight_versions,
        "prompt": s.prompt,
        "response": s.response,
        "metadata": s.metadata,
    }


def bench_codec(*, quick: bool) -> list[Figure]:
    """Encode+decode of one 8k-token sample (1k prompt + 7k response) vs pickle-of-lists and json."""
    group = make_group("codec:0", n=1, prompt_len=1024, response_len=7168)
    as_lists = _as_lists(group)
    calls = 200  # cheap either way; more calls steady the ratio on a shared machine

    ours = best_per_call(lambda: decode_group(encode(group)), calls=calls)
    pickled = best_per_call(lambda: pickle.loads(pickle.dumps(as_lists, protocol=pickle.HIGHEST_PROTOCOL)), calls=calls)
    jsoned = best_per_call(lambda: json.loads(json.dumps(as_lists)), calls=max(10, calls // 5))
    details = {
        "tokens": 8192, "response_tokens": 7168, "wire_bytes": len(encode(group)),
        "pickle_bytes": len(pickle.dumps(as_lists, protocol=pickle.HIGHEST_PROTOCOL)),
        "json_bytes": len(json.dumps(as_lists)),
    }
    us = 1e6
    return [
        Figure(
            section="codec", name="msgspec encode+decode (8k-token sample, typed, invariants checked)",
            value=ours * us, unit="us", baseline="pickle of lists", baseline_value=pickled * us,
            ratio=ratio(pickled, ours), goal=f"ratio >= {CODEC_GOAL:g}", met=ratio(pickled, ours) >= CODEC_GOAL,
            details=details,
        ),
        Figure(
            section="codec", name="msgspec encode+decode (8k-token sample)", value=ours * us, unit="us",
            baseline="json of lists", baseline_value=jsoned * us, ratio=ratio(jsoned, ours),
        ),
    ]


# ------------------------------------------------------------------ buffer

async def _ours_push_read_ack(client: Any, keys: Keys, groups: list[SampleGroup], writers: int, batch: int) -> float:
    """GroupBuffer.push from `writers` concurrent tasks (like workers), then read+decode+ack in batches."""
    buffer = GroupBuffer(client, keys)
    await buffer.ensure_group()
    gate = asyncio.Semaphore(writers)

    async def push(group: SampleGroup) -> None:
        async with gate:
            await buffer.push(group)

    started = time.perf_counter()
    await asyncio.gather(*(push(g) for g in groups))
    taken = 0
    while taken < len(groups):
        entries = await buffer.read("bench", batch)
        await buffer.ack([e.stream_id for e in entries])
        taken += len(entries)
    return time.perf_counter() - started


async def _raw_pipelined(client: Any, keys: Keys, payloads: list[bytes], batch: int) -> float:
    """The floor: pre-encoded bytes, pipelined XADD, XREADGROUP, pipelined XACK+XDEL; no decode, no checks."""
    stream = keys.groups
    await client.xgroup_create(stream, TRAINER_GROUP, id="0", mkstream=True)
    started = time.perf_counter()
    for i in range(0, len(payloads), batch):
        pipe = client.pipeline(transaction=False)
        for payload in payloads[i:i + batch]:
            pipe.xadd(stream, {"g": payload})
        await pipe.execute()
    taken = 0
    while taken < len(payloads):
        reply = await client.xreadgroup(TRAINER_GROUP, "bench", {stream: ">"}, count=batch)
        ids = [raw_id for raw_id, _fields in reply[0][1]]
        pipe = client.pipeline(transaction=False)
        pipe.xack(stream, TRAINER_GROUP, *ids)
        pipe.xdel(stream, *ids)
        await pipe.execute()
        taken += len(ids)
    return time.perf_counter() - started


async def _buffer_async(redis_url: str, quick: bool) -> list[Figure]:
    n_groups = 400 if quick else 2000
    groups = [make_group(f"buf{i}:0", n=8, prompt_len=256, response_len=768, seed=i) for i in range(n_groups)]
    payloads = [encode(g) for g in groups]
    client = connect(redis_url)
    try:
        await client.config_resetstat()
        ours = min([await _ours_push_read_ack(client, Keys(f"bo{uuid.uuid4().hex[:8]}"), groups, PUSH_CONCURRENCY, 64)
                    for _ in range(2)])
        server_us = await _server_usec_per_call(client, ("evalsha", "xadd", "xreadgroup"))
        raw = min([await _raw_pipelined(client, Keys(f"br{uuid.uuid4().hex[:8]}"), payloads, 64) for _ in range(2)])
    finally:
        await client.aclose()
    ours_rate, raw_rate = n_groups / ours, n_groups / raw
    mb = sum(map(len, payloads)) / 1e6
    return [Figure(
        section="buffer", name="GroupBuffer push+read+ack (encode, dedup transaction push, decode+validate)",
        value=ours_rate, unit="groups/s", baseline="raw redis-py pipelined XADD/XREADGROUP/XACK+XDEL, same bytes",
        baseline_value=raw_rate, ratio=ratio(ours_rate, raw_rate), goal=f"ratio >= {BUFFER_GOAL:g}",
        met=ratio(ours_rate, raw_rate) >= BUFFER_GOAL,
        details={"groups": n_groups, "samples_per_group": 8, "tokens_per_sample": 1024, "payload_mb": round(mb, 2),
                 "server_usec_per_call": server_us, "ours_mb_s": round(mb / ours, 1), "raw_mb_s": round(mb / raw, 1), "push_concurrency": PUSH_CONCURRENCY},
    )]


async def _server_usec_per_call(client: Any, commands: tuple[str, ...]) -> dict[str, float]:
    """Redis-side cost per command (INFO commandstats), to tell server time from client time."""
    stats = await client.info("commandstats")
    return {c: stats.get(f"cmdstat_{c}", {}).get("usec_per_call", 0.0) for c in commands}


def bench_buffer(redis_url: str, *, quick: bool) -> list[Figure]:
    return asyncio.run(_buffer_async(redis_url, quick))


# ------------------------------------------------------------------ trainer hand-off

async def _fill(redis_url: str, keys: Keys, groups: list[SampleGroup]) -> None:
    client = connect(redis_url)
    buffer = GroupBuffer(client, keys)
    await buffer.ensure_group()
    for group in groups:
        await buffer.push(group)
    await client.aclose()


def bench_handoff(redis_url: str, *, quick: bool) -> list[Figure]:
    """get_samples(64) of 16 x 4k-token groups through RedisDataSource, including conversion to Sample."""
    n_groups, n, prompt_len, response_len = 64, 16, 512, 3584
    template = [make_group(f"h{i}:0", n=n, prompt_len=prompt_len, response_len=response_len, seed=i)
                for i in range(4)]
    timings: list[dict[str, float]] = []
    for trial in range(2 if quick else 3):
        keys = Keys(f"ho{uuid.uuid4().hex[:8]}")
        groups = [SampleGroup(**{**_fields(template[i % 4]), "group_id": f"h{trial}-{i}:0"}) for i in range(n_groups)]
        asyncio.run(_fill(redis_url, keys, groups))
        args = SimpleNamespace(pipeline_redis_url=redis_url, pipeline_namespace=keys.ns, rollout_batch_size=n_groups,
                               n_samples_per_prompt=n, pipeline_eta=1000)
        source = RedisDataSource(args)
        try:
            timings.append(_timed_get_samples(source, n_groups))
        finally:
            source.close()
    best = min(timings, key=lambda t: t["total_s"])
    tokens = n_groups * n * (prompt_len + response_len)
    return [Figure(
        section="handoff", name="RedisDataSource.get_samples(64 groups x 16 x 4k tokens) incl. Sample conversion",
        value=best["total_s"], unit="s", goal=f"< {HANDOFF_GOAL_S:g} s", met=best["total_s"] < HANDOFF_GOAL_S,
        baseline="goal", baseline_value=HANDOFF_GOAL_S, ratio=ratio(HANDOFF_GOAL_S, best["total_s"]),
        details={**{k: round(v, 4) for k, v in best.items()}, "tokens": tokens},
    )]


def _fields(group: SampleGroup) -> dict[str, Any]:
    return {f: getattr(group, f) for f in group.__struct_fields__}


def _timed_get_samples(source: RedisDataSource, n_groups: int) -> dict[str, float]:
    """Total get_samples time, split into read+decode+checks and conversion (re-run on the same entries)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    batch = source.get_samples(n_groups)
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    assert len(batch) == n_groups, f"hand-off returned {len(batch)} groups, wanted {n_groups}"
    ids = [group[0].metadata["pipeline"]["stream_id"] for group in batch]
    entries = source._run(source.buffer.fetch(ids))
    started = time.perf_counter()
    for i, entry in enumerate(entries):
        to_trainer_group(entry, i)
    convert = time.perf_counter() - started
    started = time.perf_counter()
    source._run(source.buffer.fetch(ids))
    read = time.perf_counter() - started
    array_bytes = sum(len(s.tokens) for e in entries for s in e.group.samples)
    return {"total_s": total, "cpu_s": cpu, "convert_s": convert, "fetch_decode_s": read, "token_mb": array_bytes / 1e6,
            "convert_tolist_s": _tolist_only(entries)}


def _tolist_only(entries: list[Any]) -> float:
    """The part of conversion spent turning int32/float32 arrays into Python lists (slime's Sample wants lists)."""
    started = time.perf_counter()
    for entry in entries:
        for s in entry.group.samples:
            s.token_array().tolist()
            s.loss_mask_array().tolist()
            s.log_prob_array().tolist()
    return time.perf_counter() - started
