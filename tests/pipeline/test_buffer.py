import msgspec

from pipeline.keys import Counter, Keys
from pipeline.state import PipelineState
from pipeline.store.buffer import GroupBuffer, summary_decoder
from pipeline.synthetic import make_group


async def test_push_read_ack_round_trip(redis, keys):
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    groups = [make_group(f"task{i}:0", n=2, seed=i) for i in range(3)]
    ids = [await buf.push(g, running=-1) for g in groups]
    assert all(ids)
    assert await buf.depth() == (3, 0)
    entries = await buf.read("c1", 10, block_ms=100)
    assert [e.group for e in entries] == groups
    assert [e.stream_id for e in entries] == ids
    assert await buf.depth() == (0, 3)
    await buf.ack(ids[:2])
    assert await buf.depth() == (0, 1)
    counters = await PipelineState(redis, keys).counters()
    assert counters[Counter.BUFFERED] == 3 and counters["running"] == -3
    recent = [summary_decoder.decode(x) for x in await redis.lrange(keys.recent, 0, -1)]
    assert len(recent) == 3 and recent[0].env == "synthetic"


async def test_duplicate_push_stored_once(redis, keys):
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    group = make_group("dup:0")
    assert await buf.push(group, running=-1) is not None
    assert await buf.push(group, running=-1) is None  # a re-run job
    assert await redis.xlen(keys.groups) == 1
    counters = await PipelineState(redis, keys).counters()
    assert counters[Counter.DUPLICATES] == 1
    assert counters["running"] == -1  # deltas only applied when stored


async def test_pending_entries_come_first_for_a_restarted_consumer(redis, keys):
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    for i in range(4):
        await buf.push(make_group(f"p{i}:0", seed=i))
    first = await buf.read("trainer", 2, block_ms=100)
    # the consumer "crashes": a new buffer object with the same consumer name
    fresh = GroupBuffer(redis, keys)
    again = await fresh.read("trainer", 3, block_ms=100)
    assert [e.stream_id for e in again[:2]] == [e.stream_id for e in first]
    assert again[2].group.group_id == "p2:0"
    # excluded pending ids are skipped
    other = GroupBuffer(redis, keys)
    skipped = await other.read("trainer", 1, block_ms=100, exclude=frozenset([first[0].stream_id]))
    assert skipped[0].stream_id == first[1].stream_id


async def test_garbage_entry_dead_lettered_while_good_ones_flow(redis, keys):
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    await buf.push(make_group("good1:0"))
    bad_id = (await redis.xadd(keys.groups, {"g": b"\x93garbage", "id": "bad"})).decode()
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(make_group("bad2:0")))
    raw["samples"][0]["loss_mask"] = b""
    await redis.xadd(keys.groups, {"g": msgspec.msgpack.encode(raw), "id": "bad2:0"})
    await buf.push(make_group("good2:0"))
    entries = await buf.read("c", 10, block_ms=100)
    assert [e.group.group_id for e in entries] == ["good1:0", "good2:0"]
    dead = await redis.xrange(keys.dead)
    assert len(dead) == 2
    assert dead[0][1][b"ref"].decode() == bad_id
    assert b"undecodable SampleGroup" in dead[0][1][b"reason"]
    assert b"group 'bad2:0' sample 0: field 'loss_mask'" in dead[1][1][b"reason"]
    assert await buf.depth() == (0, 2)  # the bad ones were acknowledged and removed


async def test_version_runs_that_do_not_cover_the_response_are_dead_lettered_at_decode(redis, keys):
    """Issue 39 item 5 (fails on e13e9eb: such runs decoded fine, and `token_version_counts`
    raised SchemaError inside the trainer's get_samples after the entries were read)."""
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    for group_id, runs in (("short:0", [[3, 200]]), ("negative:0", [[3, 300], [4, -44]])):
        raw = msgspec.msgpack.decode(msgspec.msgpack.encode(make_group(group_id)))  # 256 response tokens
        raw["samples"][1]["token_version_runs"] = runs
        await redis.xadd(keys.groups, {"g": msgspec.msgpack.encode(raw), "id": group_id})
    await buf.push(make_group("good:0"))
    entries = await buf.read("c", 10, block_ms=100)
    assert [e.group.group_id for e in entries] == ["good:0"]
    entries[0].group.token_version_counts()  # what the trainer computes per group read
    reasons = [fields[b"reason"].decode() for _id, fields in await redis.xrange(keys.dead)]
    assert len(reasons) == 2
    assert "group 'short:0' sample 1: field 'token_version_runs' covers 200 tokens" in reasons[0]
    assert "group 'negative:0' sample 1: field 'token_version_runs' covers 256 tokens with counts [300, -44]" in reasons[1]


async def test_blocking_read_times_out_empty(redis, keys):
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    assert await buf.read("c", 1, block_ms=50) == []


async def test_namespaces_are_isolated(redis):
    a, b = GroupBuffer(redis, Keys("nsA_iso")), GroupBuffer(redis, Keys("nsB_iso"))
    await a.ensure_group(), await b.ensure_group()
    await a.push(make_group("x:0"))
    assert await b.depth() == (0, 0)
    assert (await a.depth())[0] == 1


async def test_state_version_engine_trainer(redis, keys):
    from pipeline.state import TrainerInfo
    st = PipelineState(redis, keys)
    assert await st.get_version() == 0
    await st.set_version(7)
    assert await st.get_version() == 7
    await st.set_engine("http://10.0.0.1:30000")
    assert await st.get_engine() == "http://10.0.0.1:30000"
    await st.set_trainer_info(TrainerInfo(rollout_batch_size=4, n_samples_per_prompt=8, eta=2))
    assert (await st.get_trainer_info()).n_samples_per_prompt == 8
    await st.incr(enqueued=3, running=1)
    assert (await st.counters())["enqueued"] == 3


async def test_concurrent_duplicate_pushes_store_once(redis_url, keys):
    """Same group pushed concurrently within one process (one coalesced transaction)
    and from two separate clients (racing WATCH/EXEC): stored exactly once."""
    import asyncio

    from pipeline.store.redis_conn import connect

    clients = [connect(redis_url), connect(redis_url)]
    buffers = [GroupBuffer(c, keys) for c in clients]
    await buffers[0].ensure_group()
    groups = [make_group(f"race{i}:0", seed=i) for i in range(20)]
    results = await asyncio.gather(*(buf.push(g, running=-1) for g in groups for buf in buffers for _ in range(3)))
    assert sum(r is not None for r in results) == 20
    assert await clients[0].xlen(keys.groups) == 20
    counters = await PipelineState(clients[0], keys).counters()
    assert counters[Counter.BUFFERED] == 20 and counters["running"] == -20
    assert counters[Counter.DUPLICATES] == 100
    for c in clients:
        await c.aclose()
