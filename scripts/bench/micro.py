"""Benchmark sections that need only pipeline/: codec, buffer, trainer hand-off.

Each section measures our path and its baseline side by side in the same process
and returns `Figure`s (value, baseline, ratio, goal).
"""

from __future__ import annotations

import asyncio
import functools
import json
import pickle
import resource
import statistics
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Union

import msgspec
import numpy as np

from pipeline.keys import TRAINER_GROUP, Keys
from pipeline.schema import Prompt, Sample, SampleGroup, SchemaError, Status, Task, decode_group, encode
from pipeline.slime.data_source import RedisDataSource, to_trainer_group
from pipeline.slime.samples import mask_list
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group
from scripts.bench.report import Figure
from scripts.bench.timing import ratio

CODEC_GOAL = 100.0  # x faster than pickle of lists: the goal the msgpack codec was chosen for (~1 us against ~300 us)
BUFFER_GOAL = 0.5  # x raw redis-py pipelined stream ops
HANDOFF_GOAL_S = 0.5  # get_samples(64 groups x 16 x 4k tokens) incl. conversion
PUSH_CONCURRENCY = 64  # groups finishing at once in one worker process (its arq max_jobs)


# ------------------------------------------------------------------ codec

# (samples, prompt tokens, response tokens): one long sample, a small group, a large group
CODEC_SHAPES = ((1, 1024, 7168), (8, 256, 768), (16, 512, 3584))


def _as_lists(group: SampleGroup) -> dict[str, Any]:
    """The same group as plain Python lists: what a naive pipeline would pickle or JSON-encode."""
    return {
        "group_id": group.group_id,
        "admission_version": group.admission_version,
        "samples": [
            {
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
            for s in group.samples
        ],
    }


def _best_interleaved(fns: dict[str, tuple[Callable[[], Any], int]], *, loops: int = 5) -> dict[str, float]:
    """Seconds per call of each fn: the best of `loops` loops of its `calls` calls, the fns taking
    turns loop by loop, so that a slow spell of this shared machine hits them alike."""
    best = {name: float("inf") for name in fns}
    for _ in range(loops):
        for name, (fn, calls) in fns.items():
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - started) / calls)
    return best


def bench_codec(*, quick: bool) -> list[Figure]:
    """decode_group(encode(group)) vs pickle-of-lists on three shapes (and json on the first)."""
    figures: list[Figure] = []
    us = 1e6
    for n, prompt_len, response_len in CODEC_SHAPES:
        group = make_group("codec:0", n=n, prompt_len=prompt_len, response_len=response_len)
        as_lists = _as_lists(group)
        tokens = n * (prompt_len + response_len)
        calls = max(20, 400 // n)  # cheap either way; more calls steady the ratio on a shared machine
        fns: dict[str, tuple[Callable[[], Any], int]] = {
            "ours": (functools.partial(_ours_roundtrip, group), calls),
            "pickle": (functools.partial(_pickle_roundtrip, as_lists), max(3, calls // 20)),
        }
        if n == 1:
            fns["json"] = (functools.partial(_json_roundtrip, as_lists), max(3, calls // 40))
        best = _best_interleaved(fns)
        payload = encode(group)
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        parts = _best_interleaved({"encode": (functools.partial(encode, group), calls),
                                   "decode": (functools.partial(decode_group, payload), calls)})
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / (10 * calls)
        shape = f"{n} x {tokens // n // 1024}k tokens"
        r = ratio(best["pickle"], best["ours"])
        met = r >= CODEC_GOAL
        print(f"[codec] {shape}: encode+decode {best['ours'] * us:.1f} us (encode {parts['encode'] * us:.1f}, "
              f"decode+checks {parts['decode'] * us:.1f}; {faults:.1f} page faults a call) vs pickle of lists {best['pickle'] * us:,.0f} us: "
              f"{r:.0f}x, goal >= {CODEC_GOAL:g}x {'met' if met else 'MISSED'}", flush=True)
        details = {
            "samples": n, "tokens": tokens, "response_tokens": n * response_len, "wire_bytes": len(payload),
            "encode_us": round(parts["encode"] * us, 2), "decode_us": round(parts["decode"] * us, 2),
            "pickle_bytes": len(pickle.dumps(as_lists, protocol=pickle.HIGHEST_PROTOCOL)),
            "page_faults_per_call": round(faults, 2),
        }
        figures.append(Figure(
            section="codec", name=f"msgspec encode+decode ({shape}, typed, invariants checked)",
            value=best["ours"] * us, unit="us", baseline="pickle of lists", baseline_value=best["pickle"] * us,
            ratio=r, goal=f"ratio >= {CODEC_GOAL:g}", met=met, details=details,
        ))
        if "json" in best:
            figures.append(Figure(
                section="codec", name=f"msgspec encode+decode ({shape})", value=best["ours"] * us, unit="us",
                baseline="json of lists", baseline_value=best["json"] * us, ratio=ratio(best["json"], best["ours"]),
            ))
    return figures


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


HANDOFF_SIZES = (16, 64, 256)  # batch sizes of the per-group scaling check; 64 is the figure
HANDOFF_FLAT = 0.8  # per-group cost at 256 groups within 1/0.8 = 1.25x of that at 16


def bench_handoff(redis_url: str, *, quick: bool) -> list[Figure]:
    """get_samples(64) of 16 x 4k-token groups through RedisDataSource, including conversion to Sample:
    min/median/max of a few repeats, and the cost per group at 16, 64 and 256 groups."""
    n, prompt_len, response_len = 16, 512, 3584
    repeats = 3 if quick else 5
    template = [make_group(f"h{i}:0", n=n, prompt_len=prompt_len, response_len=response_len, seed=i)
                for i in range(4)]
    runs: dict[int, list[dict[str, float]]] = {}
    # One discarded warm-up at the largest size first: a trainer process converts a batch every
    # step, so its memory has been touched before; a fresh VM's first touch of a page costs
    # ~7 us (the host backs it) against ~1-3 us afterwards, and it would land on whichever
    # size first needs more memory than the process ever had (256 groups: 1.5 GB).
    for n_groups, trial in [(max(HANDOFF_SIZES), -1)] + [(size, t) for size in HANDOFF_SIZES for t in range(repeats)]:
        keys = Keys(f"ho{uuid.uuid4().hex[:8]}")
        groups = [SampleGroup(**{**_fields(template[i % 4]), "group_id": f"h{n_groups}-{trial}-{i}:0"})
                  for i in range(n_groups)]
        asyncio.run(_fill(redis_url, keys, groups))
        del groups
        args = SimpleNamespace(pipeline_redis_url=redis_url, pipeline_namespace=keys.ns, rollout_batch_size=n_groups,
                               n_samples_per_prompt=n, pipeline_eta=1000)
        source = RedisDataSource(args)
        try:
            timing = _timed_get_samples(source, n_groups, breakdown=n_groups == 64 and trial == repeats - 1)
            if trial >= 0:
                runs.setdefault(n_groups, []).append(timing)
            source._run(source._redis.delete(keys.groups))  # 256 groups are 140 MB of the server's memory
        finally:
            source.close()
    spread = {size: _spread([r["total_s"] for r in rs]) for size, rs in runs.items()}
    per_group_ms = {size: round(s["median"] / size * 1e3, 2) for size, s in spread.items()}
    per_group_cpu_ms = {size: {k: round(statistics.median(r[k] for r in rs) / size * 1e3, 2) for k in ("cpu_s", "sys_s")}
                        for size, rs in runs.items()}
    faults_per_group = {size: round(statistics.median(r["page_faults"] for r in rs) / size) for size, rs in runs.items()}
    main = spread[64]
    breakdown = next(r for r in runs[64] if "convert_s" in r)
    tokens = 64 * n * (prompt_len + response_len)
    flat = ratio(per_group_ms[16], per_group_ms[256])
    print(f"[handoff] get_samples(64): min {main['min']:.3f} s, median {main['median']:.3f} s, max {main['max']:.3f} s "
          f"over {repeats} repeats; per group (median): "
          + ", ".join(f"{size} groups {ms:.2f} ms (CPU {per_group_cpu_ms[size]['cpu_s']:.2f}, of which kernel "
                      f"{per_group_cpu_ms[size]['sys_s']:.2f}, {faults_per_group[size]} page faults)"
                      for size, ms in per_group_ms.items()), flush=True)
    return [
        Figure(
            section="handoff",
            name=f"RedisDataSource.get_samples(64 groups x 16 x 4k tokens) incl. Sample conversion, median of {repeats}",
            value=main["median"], unit="s", goal=f"< {HANDOFF_GOAL_S:g} s", met=main["median"] < HANDOFF_GOAL_S,
            baseline="goal", baseline_value=HANDOFF_GOAL_S, ratio=ratio(HANDOFF_GOAL_S, main["median"]),
            details={"min_s": round(main["min"], 4), "median_s": round(main["median"], 4), "max_s": round(main["max"], 4),
                     "repeats": repeats, "tokens": tokens,
                     "breakdown": {k: round(v, 4) for k, v in breakdown.items()}},
        ),
        Figure(
            section="handoff", name="get_samples cost per group at 256 groups (median)", value=per_group_ms[256], unit="ms",
            baseline="per group at 16 groups", baseline_value=per_group_ms[16], ratio=flat,
            goal=f"flat: ratio >= {HANDOFF_FLAT:g}", met=flat >= HANDOFF_FLAT,
            details={"per_group_ms": per_group_ms, "per_group_cpu_ms": per_group_cpu_ms,
                     "page_faults_per_group": faults_per_group,
                     "seconds": {size: {k: round(v, 4) for k, v in s.items()} for size, s in spread.items()}},
        ),
    ]


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _ours_roundtrip(group: SampleGroup) -> SampleGroup:
    return decode_group(encode(group))


def _pickle_roundtrip(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _json_roundtrip(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _roundtrip(enc: msgspec.msgpack.Encoder, dec: msgspec.msgpack.Decoder, obj: Any) -> Any:
    return dec.decode(enc.encode(obj))


def _fields(group: msgspec.Struct) -> dict[str, Any]:
    return {f: getattr(group, f) for f in group.__struct_fields__}


def _timed_get_samples(source: RedisDataSource, n_groups: int, *, breakdown: bool = False) -> dict[str, float]:
    """Total get_samples time; with `breakdown`, also read+decode+checks and conversion, each
    re-run on the same entries."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started, cpu_started = time.perf_counter(), time.process_time()
    batch = source.get_samples(n_groups)
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert len(batch) == n_groups, f"hand-off returned {len(batch)} groups, wanted {n_groups}"
    # kernel time is mostly page faults: every converted batch is fresh memory (~5 MB a group)
    timing = {"total_s": total, "cpu_s": cpu, "sys_s": after.ru_stime - usage.ru_stime,
              "page_faults": float(after.ru_minflt - usage.ru_minflt)}
    if not breakdown:
        return timing
    ids = [group[0].metadata["pipeline"]["stream_id"] for group in batch]
    del batch  # the re-runs below start from the same memory state as get_samples did
    entries = source._run(source.buffer.fetch(ids))
    started = time.perf_counter()
    converted = [to_trainer_group(entry, i) for i, entry in enumerate(entries)]
    convert = time.perf_counter() - started
    del converted
    started = time.perf_counter()
    source._run(source.buffer.fetch(ids))
    read = time.perf_counter() - started
    array_bytes = sum(len(s.tokens) for e in entries for s in e.group.samples)
    return {**timing, "convert_s": convert, "fetch_decode_s": read, "token_mb": array_bytes / 1e6,
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


# ------------------------------------------------------------------ design alternatives
# Not a `rollout bench` section: the evidence behind two designs that were measured and not
# adopted (docs/benchmarks.md, "codec" and "trainer hand-off"). Run:
#     python -m scripts.bench.micro alternatives

# prototypes of the layouts codec_layouts compares (SampleGroup's fields, other arrangements)
class _Row(Sample, array_like=True, gc=False):
    pass


class _Rows(msgspec.Struct, kw_only=True, array_like=True, gc=False, tag=2):
    group_id: str
    task: Task
    admission_version: int
    n_samples: int
    samples: list[_Row]
    worker_id: str = ""
    timings: dict[str, float] = {}
    epoch: int = 0
    attempt: int = 0
    def __post_init__(self) -> None:  # the same checks
        SampleGroup.__post_init__(self)  # type: ignore[arg-type]  # same fields, duck-typed


class _Cold(msgspec.Struct, array_like=True, gc=False):
    reward_components: dict[str, Any]
    weight_versions: list[str]
    policy_versions: list[int]
    policy_run: int
    prompt: Prompt
    response: str
    label: Union[str, None]
    metadata: dict[str, Any]


class _Columns(msgspec.Struct, array_like=True, gc=False, tag=3):
    group_id: str
    task: Task
    admission_version: int
    n_samples: int
    worker_id: str
    timings: dict[str, float]
    epoch: int
    attempt: int
    token_bytes: list[int]
    response_lengths: list[int]
    rewards: list[float]
    statuses: list[Status]
    tokens: memoryview
    loss_mask: memoryview
    rollout_log_probs: memoryview
    cold: msgspec.Raw  # list[_Cold], decoded when the samples are built


class _Hot(msgspec.Struct, array_like=True, gc=False):
    tokens: memoryview
    response_length: int
    loss_mask: memoryview
    rollout_log_probs: memoryview
    reward: float
    status: Status


class _HotGroup(msgspec.Struct, array_like=True, gc=False):
    group_id: str
    task: Task
    samples: list[_Hot]


def codec_layouts() -> list[dict[str, Any]]:
    """encode+decode of each codec shape in four wire layouts, side by side with pickle of lists:
    the map layout in use; the same structs as msgpack arrays (array_like, tagged); a columnar
    group (one byte array per field, per-sample lengths, the other per-sample fields as one
    blob), with its samples left unbuilt and built; and a floor: the six fields the trainer needs,
    as arrays, no other field and no checks."""
    enc = msgspec.msgpack.Encoder()
    rows_dec, cols_dec, cold_dec = (msgspec.msgpack.Decoder(_Rows), msgspec.msgpack.Decoder(_Columns),
                                    msgspec.msgpack.Decoder(list[_Cold]))
    hot_dec = msgspec.msgpack.Decoder(_HotGroup)

    def encode_columns(g: SampleGroup) -> bytes:
        ss = g.samples
        cold = enc.encode([_Cold(s.reward_components, s.weight_versions, s.policy_versions, s.policy_run, s.prompt,
                                s.response, s.label, s.metadata) for s in ss])
        return enc.encode(_Columns(
            g.group_id, g.task, g.admission_version, g.n_samples, g.worker_id, g.timings, g.epoch, g.attempt,
            [len(s.tokens) for s in ss], [s.response_length for s in ss], [s.reward for s in ss], [s.status for s in ss],
            memoryview(b"".join([s.tokens for s in ss])), memoryview(b"".join([s.loss_mask for s in ss])),
            memoryview(b"".join([s.rollout_log_probs for s in ss])), msgspec.Raw(cold)))

    def decode_columns(data: bytes) -> Any:  # the same invariants, on the columns
        c = cols_dec.decode(data)
        if not len(c.token_bytes) == len(c.response_lengths) == len(c.rewards) == c.n_samples:
            raise SchemaError("sample count")
        if sum(c.token_bytes) != len(c.tokens) or sum(c.response_lengths) != len(c.loss_mask) \
                or 4 * len(c.loss_mask) != len(c.rollout_log_probs):
            raise SchemaError("column lengths")
        for t, n, r in zip(c.token_bytes, c.response_lengths, c.rewards):
            if t & 3 or n < 0 or 4 * n > t or r != r:
                raise SchemaError("sample")
        return c

    def build_samples(c: Any) -> list[Sample]:
        out, t0, m0 = [], 0, 0
        for t, n, r, st, k in zip(c.token_bytes, c.response_lengths, c.rewards, c.statuses, cold_dec.decode(c.cold)):
            out.append(Sample(
                tokens=c.tokens[t0:t0 + t], response_length=n, loss_mask=c.loss_mask[m0:m0 + n],
                rollout_log_probs=c.rollout_log_probs[4 * m0:4 * (m0 + n)], reward=r, status=st,
                reward_components=k.reward_components, weight_versions=k.weight_versions,
                policy_versions=k.policy_versions, policy_run=k.policy_run, prompt=k.prompt, response=k.response,
                label=k.label, metadata=k.metadata))
            t0, m0 = t0 + t, m0 + n
        return out

    def columnar(g: SampleGroup, *, build: bool) -> Any:
        decoded = decode_columns(encode_columns(g))
        return build_samples(decoded) if build else decoded

    rows = []
    for n, prompt_len, response_len in CODEC_SHAPES:
        group = make_group("codec:0", n=n, prompt_len=prompt_len, response_len=response_len)
        as_rows = _Rows(**{**_fields(group), "samples": [_Row(**_fields(s)) for s in group.samples]})
        hot = _HotGroup(group.group_id, group.task, [_Hot(s.tokens, s.response_length, s.loss_mask,
                                                        s.rollout_log_probs, s.reward, s.status) for s in group.samples])
        assert [bytes(s.tokens) for s in build_samples(decode_columns(encode_columns(group)))] == \
            [bytes(s.tokens) for s in group.samples]
        as_lists = _as_lists(group)
        calls = max(20, 400 // n)
        best = _best_interleaved({
            "pickle of lists": (functools.partial(_pickle_roundtrip, as_lists), max(3, calls // 20)),
            "map (in use)": (functools.partial(_ours_roundtrip, group), calls),
            "array_like": (functools.partial(_roundtrip, enc, rows_dec, as_rows), calls),
            "columnar, samples unbuilt": (functools.partial(columnar, group, build=False), calls),
            "columnar, samples built": (functools.partial(columnar, group, build=True), calls),
            "floor: 6 fields, no checks": (functools.partial(_roundtrip, enc, hot_dec, hot), calls),
        }, loops=7)
        shape = f"{n} x {(prompt_len + response_len) // 1024}k"
        pickle_s = best.pop("pickle of lists")
        print(f"[codec layouts] {shape}: pickle of lists {pickle_s * 1e6:,.0f} us; "
              + "; ".join(f"{name} {s * 1e6:.1f} us = {ratio(pickle_s, s):.0f}x" for name, s in best.items()), flush=True)
        rows.append({"shape": shape, "pickle_us": pickle_s * 1e6, **{k: v * 1e6 for k, v in best.items()}})
    return rows


def handoff_token_ints(rounds: int = 10) -> dict[str, dict[str, float]]:
    """CPU seconds (user + kernel) of a 64 x 16 x 4k batch's lists, built as `to_trainer_group`
    builds them (per sample: tokens, loss mask from its runs, log-probs), with the tokens made by
    `tolist()` (a fresh int object per id above 256) or taken from a process-wide table of shared
    int objects (`table.take(ids).tolist()`: no int allocated). The two take turns round by round;
    each round's lists stay alive until its end, like a batch. On the benchmark's uniform random
    ids (the hand-off section's groups) and on Zipf(1.1)-distributed ids (closer to text)."""
    vocab = 150_000
    table = np.array(range(vocab), dtype=object)
    rng = np.random.default_rng(0)
    zipf_ids = rng.permutation(vocab)
    log_probs = [-rng.random(3584, dtype=np.float32) for _ in range(64 * 16)]
    mask = np.ones(3584, dtype=np.uint8)
    batches = {
        "uniform ids": [rng.integers(0, vocab, 4096, dtype=np.int32) for _ in range(64 * 16)],
        "zipf ids": [zipf_ids[np.minimum(rng.zipf(1.1, 4096), vocab) - 1].astype(np.int32) for _ in range(64 * 16)],
    }
    out: dict[str, dict[str, float]] = {}
    for data, tokens in batches.items():
        cpu: dict[str, list[float]] = {"tolist": [], "shared-int table": []}
        for _ in range(rounds):
            for way, convert in (("tolist", lambda a: a.tolist()), ("shared-int table", lambda a: table.take(a).tolist())):
                started = time.process_time()
                lists = [(convert(t), mask_list(mask), lp.tolist()) for t, lp in zip(tokens, log_probs)]
                cpu[way].append(time.process_time() - started)
                del lists
        out[data] = {f"{way} {stat}": round(fn(v), 4) for way, v in cpu.items()
                     for stat, fn in (("min_s", min), ("median_s", statistics.median))}
        print(f"[handoff token ints] {data}: " + ", ".join(f"{k} {v:.3f}" for k, v in out[data].items()), flush=True)
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["alternatives"]:
        sys.exit("usage: python -m scripts.bench.micro alternatives")
    import gc

    gc.disable()  # as in to_trainer_group's build: no collection walks the lists being built
    handoff_token_ints()
    gc.enable()
    codec_layouts()
