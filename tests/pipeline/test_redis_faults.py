"""Redis faults one write at a time, through `LossyProxy` in front of a real redis-server:
a reply lost after the server executed the command (redis-py retries it), a Redis restart
(connections cut and refused), a half-open connection. Each test checks the data against
ground truth: nothing stored twice, nothing counted twice, nothing lost, no crash.
Each of these failed on the code before issue 13's fixes."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pipeline.keys import Counter
from pipeline.schema import PromptJob, Task
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.state import PipelineState
from pipeline.store.buffer import ID_UNKNOWN, GroupBuffer
from pipeline.store.redis_conn import RedisUnavailable, connect
from pipeline.synthetic import make_group
from producers.admission import Admission, Limits, job_envelope
from tests.support.chaos_helpers import LossyProxy
from workers.liveness import Liveness

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def proxy(redis_server):
    with LossyProxy(redis_server.port, rate=0.0) as p:
        yield p


@pytest.fixture
async def lossy(proxy):
    client = connect(proxy.url, outage_s=10)
    yield client
    await client.aclose()


async def _counters(redis, keys) -> dict[str, int]:
    return await PipelineState(redis, keys).counters()


async def test_push_whose_exec_reply_is_lost_is_stored_and_counted_once(proxy, lossy, redis, keys):
    buf = GroupBuffer(lossy, keys)
    await buf.ensure_group()
    proxy.lose_reply_to(b"EXEC")
    stream_id = await buf.push(make_group("g:0", n=2), episodes=2)
    assert proxy.dropped == 1
    assert stream_id == ID_UNKNOWN  # stored by this call; only the reply with its id was lost
    assert await redis.xlen(keys.groups) == 1
    c = await _counters(redis, keys)
    assert c[Counter.BUFFERED] == 1 and c[Counter.EPISODES] == 2 and c.get(Counter.DUPLICATES, 0) == 0
    assert await buf.push(make_group("g:0", n=2), episodes=2) is None  # a real duplicate still is one
    assert (await _counters(redis, keys))[Counter.DUPLICATES] == 1


async def test_requeue_dead_letter_and_counters_are_written_once(proxy, lossy, redis, keys):
    buf = GroupBuffer(lossy, keys)
    await buf.ensure_group()
    proxy.lose_reply_to(b"XADD", times=2)
    await buf.requeue(make_group("back:0", n=2))  # slime's add_samples
    await buf.dead_letter(source="test", reason="r", ref="x")
    proxy.lose_reply_to(b"HINCRBY")
    await PipelineState(lossy, keys).incr(**{Counter.STALE: 1})
    assert proxy.dropped == 3
    assert await redis.xlen(keys.groups) == 1 and await redis.xlen(keys.dead) == 1
    c = await _counters(redis, keys)
    assert c[Counter.DEAD] == 1 and c[Counter.STALE] == 1


async def test_fresh_admission_replayed_returns_its_result_not_cursor_moved(proxy, lossy, redis, keys, namespace):
    admission = Admission(lossy, keys)
    jobs = []
    for i in range(3):
        job = PromptJob(task=Task(id=f"{namespace}-t{i}", env="e", prompt="p"), epoch=0, n_samples=2)
        jobs.append((job.job_id, job_envelope(job, enqueue_time_ms=1)))
    await admission.admit_fresh(Limits(8, 0, 2), jobs[:1], cursor_field="e0", position=0, score_ms=1)  # loads the script
    proxy.lose_reply_to(b"EVALSHA")
    result = await admission.admit_fresh(Limits(8, 0, 2), jobs[1:], cursor_field="e0", position=1, score_ms=1)
    assert proxy.dropped == 1
    assert (result.consumed, result.admitted) == (2, 2)
    assert int(await redis.hget(keys.cursor, "e0")) == 3
    assert (await _counters(redis, keys))[Counter.ENQUEUED] == 3 and await redis.zcard(keys.queue) == 3


async def test_job_started_replayed_counts_running_once(proxy, lossy, redis, keys):
    live = Liveness(lossy, keys, "w", heartbeat_s=0.1, dead_after_s=1.0)
    await live.job_started("warm")
    proxy.lose_reply_to(b"running", times=2)  # the requests that move the `running` counter
    await live.job_started(keys.arq_job_id("a:0"))
    await live.job_ended(keys.arq_job_id("a:0"))
    assert proxy.dropped == 2
    assert (await _counters(redis, keys))[Counter.RUNNING] == 1  # "warm" only


def _args(url: str, ns: str, batch: int) -> SimpleNamespace:
    return SimpleNamespace(pipeline_redis_url=url, pipeline_namespace=ns, rollout_batch_size=batch,
                           n_samples_per_prompt=2, pipeline_eta=100, pipeline_wait_timeout_s=20.0,
                           pipeline_publish_engine=False)


async def _push_groups(redis, keys, count: int) -> None:
    buf = GroupBuffer(redis, keys)
    await buf.ensure_group()
    for i in range(count):
        await buf.push(make_group(f"g{i}:0", n=2, seed=i))


def _ids(batch) -> list[str]:
    return [g[0].metadata["pipeline"]["group_id"] for g in batch]


async def test_consumed_record_with_lost_reply_replays_exactly_b_groups(proxy, redis, keys, namespace):
    """`RPUSH consumed:rid` replayed held every id twice: a replay returned 2B groups."""
    B = 2
    await _push_groups(redis, keys, 3 * B)
    source = RedisDataSource(_args(proxy.url, namespace, B))
    proxy.lose_reply_to(b"RPUSH")
    first = await asyncio.to_thread(lambda: _ids(generate_rollout(source.args, 0, source).samples))
    assert proxy.dropped == 1
    assert await redis.llen(keys.consumed(0)) == B
    assert (await _counters(redis, keys))[Counter.ACCEPTED] == B
    await asyncio.to_thread(source.close)
    resumed = RedisDataSource(_args(proxy.url, namespace, B))
    resumed.load(-1)
    again = await asyncio.to_thread(lambda: _ids(generate_rollout(resumed.args, 0, resumed).samples))
    await asyncio.to_thread(resumed.close)
    assert again == first and len(again) == B


async def test_lost_xreadgroup_reply_loses_no_group(proxy, redis, keys, namespace):
    """The entries of a lost XREADGROUP reply sit in this consumer's pending list; the reader
    must look there again, not only after a restart."""
    B = 2
    await _push_groups(redis, keys, 3 * B)
    source = RedisDataSource(_args(proxy.url, namespace, B))
    try:
        proxy.lose_reply_to(b"XREADGROUP")
        trained = []
        for rid in range(3):
            trained += await asyncio.to_thread(lambda rid=rid: _ids(generate_rollout(source.args, rid, source).samples))
            await asyncio.to_thread(source.save, rid)
    finally:
        await asyncio.to_thread(source.close)
    assert proxy.dropped == 1
    assert sorted(trained) == sorted(f"g{i}:0" for i in range(3 * B))


async def test_a_restart_shorter_than_the_budget_is_ridden_out(proxy, keys):
    client = connect(proxy.url, outage_s=5)
    try:
        await client.set(keys.version, 1)  # a pooled connection exists
        proxy.down(1.5)  # cut it, refuse new ones for 1.5 s
        started = time.monotonic()
        assert await client.get(keys.version) == b"1"  # the first command after the cut reconnects
        assert time.monotonic() - started >= 1.0
        proxy.down(1.0)
        await asyncio.sleep(0.2)
        buf = GroupBuffer(client, keys)
        await buf.ensure_group()
        assert await buf.push(make_group("r:0", n=2)) is not None  # a transaction during the outage
    finally:
        await client.aclose()


async def test_past_the_budget_one_clear_error(proxy, keys):
    client = connect(proxy.url, outage_s=1)
    try:
        await client.ping()
        proxy.down(30)
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match=r"unreachable for 1s"):
            await client.get(keys.version)
        assert time.monotonic() - started < 5
    finally:
        await client.aclose()


async def test_a_half_open_connection_times_out_instead_of_hanging(proxy, keys):
    client = connect(proxy.url, outage_s=1, socket_timeout_s=0.3)
    try:
        await client.ping()
        proxy.stalled = True
        with pytest.raises(RedisUnavailable):
            await asyncio.wait_for(client.get(keys.version), 10)
    finally:
        proxy.stalled = False
        await client.aclose()


def test_producer_and_worker_exit_with_one_line_when_redis_stays_away(tmp_path):
    """Past $ROLLOUT_REDIS_OUTAGE_S the long-lived processes stop with one line naming the cause
    (exit status 3), instead of a traceback at the first refused connect or hanging forever."""
    import json
    import os
    import subprocess
    import sys

    from pipeline.store.local_redis import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(json.dumps({"redis": {"url": url, "namespace": "gone"}, "engine": {"url": "http://127.0.0.1:9"},
                               "environments": {"a": {"kind": "math"}}}))
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "env": "a", "prompt": "p", "label": "1"}) + "\n")
    env = {**os.environ, "ROLLOUT_REDIS_OUTAGE_S": "1"}
    for argv in (["enqueue", "--tasks", str(tmp_path / "tasks.jsonl"), "--config", str(cfg)],
                 ["workers", "--config", str(cfg)]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "scripts.cli", *argv], env=env, capture_output=True, text=True,
                              timeout=50)
        assert done.returncode == 3, (argv, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "unreachable" in done.stderr, done.stderr[-2000:]
        assert time.monotonic() - started < 40


async def test_a_cancel_turned_into_a_timeout_is_not_retried():
    """asyncio.timeout (redis-py's socket timeout) raises TimeoutError when it fires together with
    a cancel of the task (Python 3.11): the retry must hand the cancel on, not swallow it (a
    worker told to stop kept polling, and whoever awaited it hung)."""
    import asyncio

    from pipeline.store.redis_conn import OutageRetry

    calls = []

    async def do():
        calls.append(1)
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            raise TimeoutError("socket timeout") from None

    async def fail(_error):
        return None

    task = asyncio.ensure_future(OutageRetry(30.0, "test").call_with_retry(do, fail))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert calls == [1]


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="Task.cancelling: Python >= 3.11")
async def test_a_cancel_swallowed_by_a_finished_send_still_stops_the_caller(redis, keys):
    """redis-py sends with asyncio.wait_for(writer.drain(), socket_timeout); before Python 3.12 a
    cancel that meets a finished drain is dropped and the command's reply returned. A loop of
    commands told to stop must stop (a producer cancelled mid-epoch admitted the whole epoch)."""
    stopped_at = []
    for attempt in range(20):
        counter = f"{keys.ns}:loop:{attempt}"

        async def loop_of_commands(counter: str = counter) -> None:
            while True:
                await redis.incr(counter)

        task = asyncio.ensure_future(loop_of_commands())
        await asyncio.sleep(0.005 * (attempt % 5))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done and task.cancelled(), f"attempt {attempt}: a cancelled loop of Redis commands ran on"
        stopped_at.append(int(await redis.get(counter) or 0))
        await asyncio.sleep(0.02)
        assert int(await redis.get(counter) or 0) == stopped_at[-1]
