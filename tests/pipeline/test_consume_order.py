"""Which groups a step takes: due-first vs arrival, on a real redis-server with the real
admission script and the real data source (issue 17: long groups finish last; arrival order
discards them as stale, due-first waits for them and discards nothing)."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pipeline.keys import Counter, Keys
from pipeline.schema import PromptJob, Task
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group
from producers.admission import Admission, Limits, job_envelope

B, ETA = 2, 1


def _args(redis_url, ns, order, **extra):
    return SimpleNamespace(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=B, n_samples_per_prompt=2,
        pipeline_eta=ETA, pipeline_wait_log_s=0.2, pipeline_trainer_loop="sync", pipeline_consume_order=order,
        pipeline_stale_policy="drop",  # (a requeue would hold fresh admissions until a producer re-admits it)
        **extra,
    )


class Cluster:
    """Admits jobs through the producers' admission script and 'generates' them by pushing
    their groups whenever the test says, from its own event loop thread."""

    def __init__(self, redis_url: str, ns: str):
        self.keys = Keys(ns)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.redis = self.call(self._connect(redis_url))
        self.admission = Admission(self.redis, self.keys)
        self.buffer = GroupBuffer(self.redis, self.keys)
        self.clock_of: dict[str, int] = {}
        self.position = 0

    async def _connect(self, url):
        return connect(url)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def admit(self, *names: str) -> None:
        async def go():
            version = int(await self.redis.get(self.keys.version) or 0)
            jobs = []
            for name in names:
                job = PromptJob(task=Task(id=name, env="synthetic", prompt="p", label="1"), epoch=0, n_samples=2,
                                admission_version=version)
                jobs.append((job.job_id, job_envelope(job, enqueue_time_ms=1)))
                self.clock_of[job.job_id] = version
            out = await self.admission.admit_fresh(Limits(B, ETA, 2), jobs, cursor_field="e0", position=self.position,
                                                   score_ms=1, version=version)
            assert out.admitted == len(names), out
            self.position += out.consumed
            return [job_id for job_id, _ in jobs]
        return self.call(go())

    def push(self, job_id: str, response_len: int = 8) -> None:
        group = make_group(job_id, n=2, response_len=response_len, admission_version=self.clock_of[job_id],
                           rewards=[0.0, 1.0])
        self.call(self.buffer.push(group))

    def open_ids(self) -> set[str]:
        return {m.decode() for m in self.call(self.redis.zrange(self.keys.open, 0, -1))}

    def counters(self) -> dict[str, int]:
        raw = self.call(self.redis.hgetall(self.keys.counters))
        return {k.decode(): int(v) for k, v in raw.items()}

    def close(self) -> None:
        self.call(self.redis.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _group_ids(out):
    return [g[0].metadata["pipeline"]["group_id"] for g in out.samples]


def _run(redis_url, namespace, order):
    """Step 0 takes the two short groups of four admitted at clock 0; at step 1 the two long ones
    (due: clock 0 + eta 1) are still generating while two fresh short ones (clock 1) are ready."""
    source = RedisDataSource(_args(redis_url, namespace, order))
    cluster = Cluster(redis_url, namespace)
    try:
        source.publish(0)
        long0, long1, short0, short1 = cluster.admit("long0", "long1", "short0", "short1")
        assert cluster.open_ids() == {long0, long1, short0, short1}
        cluster.push(short0)
        cluster.push(short1)
        step0 = generate_rollout(source.args, 0, source)
        assert sorted(_group_ids(step0)) == sorted([short0, short1])
        source.save(0)
        source.publish(1)
        fresh0, fresh1 = cluster.admit("fresh0", "fresh1")
        cluster.push(fresh0)
        cluster.push(fresh1)
        late = threading.Timer(1.0, lambda: (cluster.push(long0, 64), cluster.push(long1, 64)))
        late.start()
        started = time.monotonic()
        step1 = generate_rollout(source.args, 1, source)
        waited = time.monotonic() - started
        late.join()
        source.save(1)
        source.publish(2)
        # two more admitted and pushed a moment later: what refills a batch after discards
        more = threading.Timer(0.5, lambda: [cluster.push(g) for g in cluster.admit("more0", "more1")])
        more.start()
        step2 = generate_rollout(source.args, 2, source)
        more.join()
        return SimpleNamespace(
            step1=_group_ids(step1), step2=_group_ids(step2), waited=waited, counters=cluster.counters(),
            ids=dict(long=(long0, long1), fresh=(fresh0, fresh1)), metrics=step1.metrics,
        )
    finally:
        cluster.close()
        source.close()


def test_due_first_waits_for_the_long_groups_and_discards_nothing(redis_url, namespace):
    r = _run(redis_url, namespace, "due-first")
    assert sorted(r.step1) == sorted(r.ids["long"]), "step 1 must take the due groups, not the fresh ones"
    assert r.waited >= 0.9  # it waited for them to be pushed
    assert sorted(r.step2) == sorted(r.ids["fresh"])
    assert r.counters.get(Counter.STALE, 0) == r.counters.get(Counter.DISCARDED, 0) == 0
    assert r.counters[Counter.ACCEPTED] == 6
    assert r.metrics["rollout/pipeline/groups_due"] == 2


def test_arrival_order_discards_the_long_groups(redis_url, namespace):
    r = _run(redis_url, namespace, "arrival")
    assert sorted(r.step1) == sorted(r.ids["fresh"])
    # at step 2 the long groups are two versions old: thrown away (the waste due-first removes)
    assert not set(r.step2) & set(r.ids["long"])
    assert r.counters[Counter.STALE] == r.counters[Counter.DISCARDED] == 2


def test_a_due_group_that_never_comes_is_waited_for_at_most_due_wait_s(redis_url, namespace, caplog):
    source = RedisDataSource(_args(redis_url, namespace, "due-first", pipeline_due_wait_s=0.5))
    cluster = Cluster(redis_url, namespace)
    try:
        source.publish(0)
        lost, a, b, c = cluster.admit("lost", "a", "b", "c")
        for gid in (a, b):
            cluster.push(gid)
        generate_rollout(source.args, 0, source)
        source.publish(1)
        d, _e = cluster.admit("d", "e")
        cluster.push(c)
        cluster.push(d)
        started = time.monotonic()
        out = generate_rollout(source.args, 1, source)  # `lost` is due and never pushed
        assert time.monotonic() - started < 10
    finally:
        cluster.close()
        source.close()
    assert sorted(_group_ids(out)) == sorted([c, d]) and "not waiting for them any more" in caplog.text


@pytest.mark.parametrize("order", ["due-first", "arrival"])
def test_order_setting_is_validated(redis_url, namespace, order):
    from pipeline.config import ConfigError, TrainerSettings

    assert TrainerSettings.from_args(_args(redis_url, namespace, order)).consume_order.value == order
    with pytest.raises(ConfigError, match="consume_order"):
        TrainerSettings.from_args(_args(redis_url, namespace, "newest-first"))


def test_a_group_delivered_again_after_it_was_trained_is_not_trained_twice(redis_url, namespace, caplog):
    """Redis lost its last second (AOF everysec, machine crash): the ack of a trained group and
    its dedup marker are gone, so the entry is delivered again or a re-run pushes it again. The
    data source remembers what it trained and acknowledges it as a duplicate."""
    source = RedisDataSource(_args(redis_url, namespace, "due-first"))
    cluster = Cluster(redis_url, namespace)
    try:
        source.publish(0)
        a, b, c, d = cluster.admit("a", "b", "c", "d")
        cluster.push(a)
        cluster.push(b)
        assert sorted(_group_ids(generate_rollout(source.args, 0, source))) == sorted([a, b])
        source.save(0)
        source.publish(1)
        cluster.call(cluster.redis.delete(cluster.keys.dedup(a)))  # the lost second took the marker
        cluster.push(a)  # a re-run's push: a new entry of a trained group
        cluster.push(c)
        cluster.push(d)
        assert sorted(_group_ids(generate_rollout(source.args, 1, source))) == sorted([c, d])
        assert cluster.counters()[Counter.DUPLICATES] == 1
        assert cluster.call(cluster.redis.xlen(cluster.keys.groups)) == 2  # c, d until save; a acked
    finally:
        cluster.close()
        source.close()
    assert "it was already trained at rollout 0" in caplog.text


def test_places_kept_are_what_the_deadlines_need_and_no_more():
    """eta 2, B 8: clock 0 admits 24 groups, so step 0 must take 8 of them (24 - 2 x 8); with
    none ready it keeps 8 places. Later clocks only count once their own deadline is near."""
    from pipeline.staleness import places_to_keep

    clock0 = {f"a{i}": 0 for i in range(24)}
    assert places_to_keep(clock0, set(), rollout_id=0, batch_size=8, eta=2) == 8
    assert places_to_keep(clock0, {"a0", "a1", "a2"}, rollout_id=0, batch_size=8, eta=2) == 5
    # step 1: 12 of clock 0 left (4 ready) and clock 1's 12: clock 0 needs 12 - 1 x 8 = 4 now,
    # clocks <= 1 need 24 - 2 x 8 = 8 now (steps 2 and 3 take 16): 4 here, 4 places kept
    left = {f"a{i}": 0 for i in range(12)} | {f"b{i}": 1 for i in range(12)}
    assert places_to_keep(left, {"a0", "a1", "a2", "a3"}, rollout_id=1, batch_size=8, eta=2) == 4
    assert places_to_keep(left, {"a0", "a1", "b0", "b1", "b2", "b3", "b4", "b5"}, rollout_id=1, batch_size=8,
                          eta=2) == 2  # clock 0 still needs 2 more of its own
    assert places_to_keep(left, {f"b{i}" for i in range(8)} | {"a0", "a1", "a2", "a3"}, rollout_id=1,
                          batch_size=8, eta=2) == 0


def test_due_first_never_hands_a_stale_group_back_while_hands_back_is_0(redis_url, namespace, caplog):
    """Issue 25 item 4: a due group given up after due_wait_s that comes anyway, past eta, went
    to `{ns}:requeue` under due-first while `{ns}:trainer` said hands_back 0, so a plain
    `rollout enqueue` may have exited and the task was lost for the run. Due-first hands nothing
    back now: the group is dead-lettered with the reason (counted stale and discarded)."""
    args = _args(redis_url, namespace, "due-first", pipeline_due_wait_s=0.3)
    args.pipeline_stale_policy = "requeue"  # the default
    source = RedisDataSource(args)
    cluster = Cluster(redis_url, namespace)
    try:
        source.publish(0)
        late, a, b, c = cluster.admit("late", "a", "b", "c")
        cluster.push(a)
        cluster.push(b)
        generate_rollout(source.args, 0, source)
        source.save(0)
        source.publish(1)
        d, e = cluster.admit("d", "e")
        cluster.push(c)
        cluster.push(d)
        generate_rollout(source.args, 1, source)  # `late` is due, given up after 0.3 s
        source.save(1)
        source.publish(2)
        f, _g = cluster.admit("f", "g")
        cluster.push(late)  # comes at last: lag 2 > eta 1
        cluster.push(e)
        cluster.push(f)
        assert sorted(_group_ids(generate_rollout(source.args, 2, source))) == sorted([e, f])
        hands_back = int(cluster.call(cluster.redis.hget(cluster.keys.trainer, "hands_back")) or 0)
        requeued = cluster.call(cluster.redis.llen(cluster.keys.requeue))
        dead = cluster.call(cluster.redis.xrange(cluster.keys.dead))
        counters = cluster.counters()
    finally:
        cluster.close()
        source.close()
    assert requeued == 0 or hands_back == 1, "handed back to a producer told nothing comes back"
    assert requeued == 0
    reasons = [fields[b"reason"].decode() for _id, fields in dead]
    assert len(reasons) == 1 and "stale under due-first" in reasons[0] and "lag 2 > eta 1" in reasons[0], reasons
    assert counters[Counter.STALE] == counters[Counter.DISCARDED] == 1
