"""The slime entry points against a real redis-server (slime itself is not installed)."""

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from pipeline.config import ConfigError
from pipeline.keys import Counter, Keys
from pipeline.schema import Requeue, RequeueReason, Status, decode_requeue
from pipeline.slime.data_source import (
    LocalRolloutOutput,
    LocalSample,
    RedisDataSource,
    generate_rollout,
    post_process_rewards,
)
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group
from tests.support.source_helpers import push_groups, read_counters, source_args


def _args(redis_url, ns, **extra):
    return source_args(redis_url, ns, eta=1, **extra)


def _ids(batch):
    return [g[0].metadata["pipeline"]["group_id"] for g in batch]


def test_rollout_returns_batch_times_n_contiguous(redis_url, namespace):
    push_groups(redis_url, namespace, [make_group(f"t{i}:0", n=4, seed=i) for i in range(5)])
    ds = RedisDataSource(_args(redis_url, namespace))
    out = generate_rollout(ds.args, 0, ds)
    assert isinstance(out, LocalRolloutOutput)
    assert len(out.samples) == 2 and all(len(g) == 4 for g in out.samples)
    flat = [s for g in out.samples for s in g]
    assert [s.index for s in flat] == list(range(8))
    assert [s.group_index for s in flat] == [0] * 4 + [1] * 4
    s = flat[0]
    assert isinstance(s, LocalSample) and s.rollout_id is None
    assert s.status is LocalSample.Status.COMPLETED
    assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    assert out.metrics["rollout/pipeline/buffer_ready"] == 3
    assert out.metrics["rollout/pipeline/staleness_hist/0"] == 2
    assert "rollout/pipeline/reward_mean/synthetic" in out.metrics
    out2 = generate_rollout(ds.args, 1, ds)
    assert [g[0].group_index for g in out2.samples] == [2, 3]
    assert len(ds) == 1
    ds.close()


def test_an_environments_own_metrics_reach_the_step_metrics(redis_url, namespace):
    """NeMo-RL's global_post_process_and_metrics (workers/envs/plugins.py) rides on each sample as
    namespaced reward components; the step reports their mean per environment, nothing else of them."""
    import msgspec

    groups = []
    for i, rate in enumerate((1.0, 0.0)):
        group = make_group(f"m{i}:0", n=4, seed=i, env="puzzle")
        samples = [msgspec.structs.replace(s, reward_components={"nemo_rl/success_rate": rate, "correct": True,
                                                                  "nemo_rl/note": "text"})
                   for s in group.samples]
        groups.append(msgspec.structs.replace(group, samples=samples))
    push_groups(redis_url, namespace, groups)
    ds = RedisDataSource(_args(redis_url, namespace))
    out = generate_rollout(ds.args, 0, ds)
    env_keys = {k: v for k, v in out.metrics.items() if k.startswith("rollout/pipeline/env/")}
    assert env_keys == {"rollout/pipeline/env/puzzle/nemo_rl/success_rate": 0.5}
    ds.close()


def test_a_failed_episode_is_handed_over_removed_from_the_loss(redis_url, namespace):
    """An episode failed by an outage keeps its tokens for the record, but slime must not train
    on them with the reward 0 the outage gave them: remove_sample zeroes its loss mask."""
    group = make_group("tfail:0", n=4, rewards=[1.0, 0.0, 1.0, 0.0])
    failed = msgspec.structs.replace(group.samples[1], status=Status.FAILED)
    group = msgspec.structs.replace(group, samples=[group.samples[0], failed, *group.samples[2:]])
    push_groups(redis_url, namespace, [group, make_group("tok:0", n=4, seed=1)])
    ds = RedisDataSource(_args(redis_url, namespace))
    out = generate_rollout(ds.args, 0, ds)
    removed = {g[0].metadata["pipeline"]["group_id"]: [x.remove_sample for x in g] for g in out.samples}
    assert removed == {"tfail:0": [False, True, False, False], "tok:0": [False] * 4}
    statuses = {x.status for g in out.samples for x in g if x.remove_sample}
    assert statuses == {LocalSample.Status.FAILED}
    assert out.metrics["rollout/pipeline/samples_failed"] == 1
    # slime's --custom-reward-post-process-path: the failed sample shifts no sibling's baseline
    args = SimpleNamespace(**vars(ds.args), advantage_estimator="grpo", rewards_normalization=True,
                           grpo_std_normalization=True, reward_key=None)
    raw, advantages = post_process_rewards(args, [x for g in out.samples for x in g])
    by_group = {g[0].metadata["pipeline"]["group_id"]: advantages[4 * i:4 * i + 4] for i, g in enumerate(out.samples)}
    assert by_group["tfail:0"] == pytest.approx([1 / 3 ** 0.5, 0.0, 1 / 3 ** 0.5, -2 / 3 ** 0.5], abs=1e-5)
    assert len(raw) == 8
    ds.close()


def test_get_samples_blocks_until_groups_arrive(redis_url, namespace):
    ds = RedisDataSource(_args(redis_url, namespace))
    timer = threading.Timer(0.5, push_groups, (redis_url, namespace, [make_group(f"late{i}:0", n=4) for i in range(2)]))
    timer.start()
    started = time.monotonic()
    batch = ds.get_samples(2)
    assert time.monotonic() - started >= 0.4
    assert _ids(batch) == ["late0:0", "late1:0"]
    ds.close()


def test_crash_then_load_replays_identical_batches_and_save_acks(redis_url, namespace):
    push_groups(redis_url, namespace, [make_group(f"c{i}:0", n=4, seed=i) for i in range(8)])
    ds = RedisDataSource(_args(redis_url, namespace, pipeline_eta=10))
    got = {rid: generate_rollout(ds.args, rid, ds).samples for rid in range(3)}
    ds.save(0)  # checkpoint after step 0; steps 1 and 2 were consumed, then the trainer dies
    ds._loop.close()  # crash: no save, no close

    ds2 = RedisDataSource(_args(redis_url, namespace, pipeline_eta=10))
    ds2.load(0)
    replay1 = generate_rollout(ds2.args, 1, ds2).samples
    replay2 = generate_rollout(ds2.args, 2, ds2).samples
    for old, new in ((got[1], replay1), (got[2], replay2)):
        assert _ids(old) == _ids(new)
        assert [[s.tokens for s in g] for g in old] == [[s.tokens for s in g] for g in new]
        assert [[s.index for s in g] for g in old] == [[s.index for s in g] for g in new]
    fresh = generate_rollout(ds2.args, 3, ds2).samples
    assert _ids(fresh) == ["c6:0", "c7:0"]
    ds2.save(3)
    assert len(ds2) == 0
    ds2.close()
    # after save nothing is re-delivered, even to a new instance resuming from 3
    ds3 = RedisDataSource(_args(redis_url, namespace, pipeline_eta=10, pipeline_wait_timeout_s=1))
    ds3.load(3)
    with pytest.raises(TimeoutError, match="0/2 groups"):
        ds3.get_samples(2)
    assert read_counters(redis_url, namespace)[Counter.ACCEPTED] == 8
    ds3.close()


def test_partial_read_before_crash_is_not_lost(redis_url, namespace):
    push_groups(redis_url, namespace, [make_group("only:0", n=4)])
    ds = RedisDataSource(_args(redis_url, namespace, pipeline_wait_timeout_s=0.5))
    with pytest.raises(TimeoutError):
        ds.get_samples(2)  # took one, waited for a second that never came
    ds._loop.close()
    push_groups(redis_url, namespace, [make_group("next:0", n=4)])
    ds2 = RedisDataSource(_args(redis_url, namespace))
    ds2.load(None)
    assert _ids(ds2.get_samples(2)) == ["only:0", "next:0"]
    ds2.close()


@pytest.mark.parametrize("policy", ["requeue", "drop", "keep"])
def test_staleness_policies(redis_url, namespace, policy):
    """Arrival order: the one order that hands stale groups back (due-first dead-letters them,
    test_due_first_hands_nothing_back below)."""
    fresh = [make_group(f"f{i}:0", n=4, admission_version=5) for i in range(2)]
    stale = msgspec.structs.replace(make_group("old:1r2", n=4, admission_version=1), epoch=1, attempt=2)
    push_groups(redis_url, namespace, [stale, *fresh])
    ds = RedisDataSource(_args(redis_url, namespace, pipeline_eta=2, pipeline_stale_policy=policy,
                               pipeline_consume_order="arrival"))
    out = generate_rollout(ds.args, 5, ds)  # version 5, eta 2: version 1 is 4 steps old
    counters = read_counters(redis_url, namespace)
    assert counters[Counter.STALE] == 1
    if policy == "keep":
        assert _ids(out.samples) == ["old:1r2", "f0:0"]
        assert out.metrics["rollout/pipeline/staleness_max"] == 4
    else:
        assert _ids(out.samples) == ["f0:0", "f1:0"]
        assert counters[Counter.DISCARDED] == 1
    if policy == "requeue":
        async def requeued():
            client = connect(redis_url)
            items = await client.lrange(Keys(namespace).requeue, 0, -1)
            await client.aclose()
            return [decode_requeue(x) for x in items]
        # back into its own epoch as the group's attempt; the producer admits attempt + 1
        assert asyncio.run(requeued()) == [
            Requeue(task=stale.task, epoch=1, attempt=2, reason=RequeueReason.STALE)
        ]
        assert out.metrics["rollout/pipeline/groups_requeued"] == 1
    ds.close()


def test_due_first_hands_nothing_back(redis_url, namespace):
    """Due-first with stale_policy requeue: a group past eta (a resume) goes to the dead letters
    with its reason, never to {ns}:requeue, which no producer may be reading (issue 25 item 4)."""
    fresh = [make_group(f"f{i}:0", n=4, admission_version=5) for i in range(2)]
    stale = msgspec.structs.replace(make_group("old:1r2", n=4, admission_version=1), epoch=1, attempt=2)
    push_groups(redis_url, namespace, [stale, *fresh])
    ds = RedisDataSource(_args(redis_url, namespace, pipeline_eta=2, pipeline_stale_policy="requeue"))
    out = generate_rollout(ds.args, 5, ds)
    assert _ids(out.samples) == ["f0:0", "f1:0"]

    async def lists():
        client = connect(redis_url)
        requeued = await client.llen(Keys(namespace).requeue)
        dead = await client.xrange(Keys(namespace).dead)
        await client.aclose()
        return requeued, dead
    requeued, dead = asyncio.run(lists())
    assert requeued == 0
    assert len(dead) == 1 and b"stale under due-first" in dead[0][1][b"reason"]
    ds.close()


def test_zero_variance_filter_keeps_batch_full(redis_url, namespace):
    groups = [make_group("flat:0", n=4, rewards=[1.0] * 4), make_group("a:0", n=4), make_group("b:0", n=4)]
    push_groups(redis_url, namespace, groups)
    ds = RedisDataSource(_args(redis_url, namespace, pipeline_filter_zero_variance=True))
    out = generate_rollout(ds.args, 0, ds)
    assert _ids(out.samples) == ["a:0", "b:0"]
    assert out.metrics["rollout/pipeline/groups_filtered"] == 1
    assert read_counters(redis_url, namespace)[Counter.FILTERED] == 1
    ds.close()


def test_group_size_mismatch_drains_every_wrong_group_then_stops_once(redis_url, namespace):
    """One error for the lot, not one trainer crash per wrong-sized group; the right-sized
    groups stay for the restarted trainer."""
    wrong = [make_group(f"three{i}:0", n=3) for i in range(3)]
    push_groups(redis_url, namespace, [wrong[0], make_group("ok:0", n=4), *wrong[1:]])
    ds = RedisDataSource(_args(redis_url, namespace))
    with pytest.raises(ConfigError, match=r"3 group\(s\) have a size other than n_samples_per_prompt 4"):
        ds.get_samples(2)
    ds.close()
    ds2 = RedisDataSource(_args(redis_url, namespace))
    assert _ids(ds2.get_samples(1)) == ["ok:0"]  # nothing wrong left: no second crash
    ds2.close()


def test_add_samples_requeues_groups(redis_url, namespace):
    group = make_group("r:1r1", n=4)
    task = msgspec.structs.replace(group.task, metadata={"tools": ["calc"]})
    push_groups(redis_url, namespace, [msgspec.structs.replace(group, task=task, epoch=1, attempt=1)])
    ds = RedisDataSource(_args(redis_url, namespace))
    batch = ds.get_samples(1)
    ds.add_samples(batch)
    again = ds.get_samples(1)
    assert _ids(again) == ["r:1r1"] and again[0][0].tokens == batch[0][0].tokens
    meta = again[0][0].metadata["pipeline"]  # what a later requeue of the group is built from
    assert (meta["epoch"], meta["attempt"]) == (1, 1)
    assert msgspec.convert(meta["task"], type(task)) == task  # label and metadata kept
    ds.close()


def test_publishes_version_trainer_info_and_engine(redis_url, namespace):
    push_groups(redis_url, namespace, [make_group(f"v{i}:0", n=4, admission_version=3) for i in range(2)])
    ds = RedisDataSource(_args(redis_url, namespace, sglang_router_ip="10.1.2.3", sglang_router_port=3000))
    generate_rollout(ds.args, 3, ds)
    async def read():
        client = connect(redis_url)
        k = Keys(namespace)
        out = (await client.get(k.version), await client.get(k.engine), await client.hgetall(k.trainer))
        await client.aclose()
        return out
    version, engine, trainer = asyncio.run(read())
    assert version == b"3" and engine == b"http://10.1.2.3:3000"
    assert trainer[b"n_samples_per_prompt"] == b"4" and trainer[b"eta"] == b"1"
    ds.close()


def test_evaluation_and_wrong_data_source_are_clear_errors(redis_url, namespace, monkeypatch):
    ds = RedisDataSource(_args(redis_url, namespace))
    # slime absent (the conformance tests may have put the snapshot on sys.path in this session)
    monkeypatch.setitem(sys.modules, "slime.rollout.sglang_rollout", None)
    with pytest.raises(ConfigError, match="evaluation needs slime and --eval-prompt-data"):
        generate_rollout(ds.args, 0, ds, evaluation=True)
    with pytest.raises(TypeError, match="--data-source-path pipeline.slime.data_source.RedisDataSource"):
        generate_rollout(ds.args, 0, object())
    ds.close()


def test_settings_from_env_and_password_never_shown(monkeypatch, namespace):
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis://user:s3cret@127.0.0.1:1/0")
    monkeypatch.setenv("ROLLOUT_NAMESPACE", namespace)
    monkeypatch.setenv("ROLLOUT_ETA", "3")
    monkeypatch.setenv("ROLLOUT_REDIS_OUTAGE_S", "1")  # nothing listens on port 1: no 30 s wait
    with pytest.raises(ConnectionError) as info:
        RedisDataSource(SimpleNamespace(rollout_batch_size=1, n_samples_per_prompt=1))
    assert "s3cret" not in str(info.value) and "user:***@127.0.0.1:1" in str(info.value)


def test_mask_list_equals_tolist_for_any_mask():
    """The run-length conversion of the loss mask hands slime exactly what tolist() would."""
    import numpy as np

    from pipeline.slime.data_source import mask_list

    rng = np.random.default_rng(7)
    masks = [np.zeros(0, np.uint8), np.ones(5, np.uint8), np.zeros(5, np.uint8)]
    masks += [(rng.random(int(rng.integers(1, 300))) < rng.random()).astype(np.uint8) for _ in range(500)]
    for mask in masks:
        assert mask_list(mask) == mask.tolist()


def test_evaluation_runs_slimes_eval_rollout_and_leaves_the_buffer_alone(redis_url, namespace, monkeypatch):
    """slime calls the rollout function with evaluation=True when --eval-function-path is unset
    (slime/utils/arguments.py); we run slime's `eval_rollout(args, rollout_id)` through its
    `async_utils.run`, as slime/rollout/sglang_rollout.py's generate_rollout does. slime is not
    installable here, so its two functions are stood in by modules with their signatures."""
    import sys
    import types

    calls = []

    async def eval_rollout(args, rollout_id):
        calls.append((args, rollout_id))
        return SimpleNamespace(data={"aime": {"rewards": [1.0]}}), []

    modules = {
        "slime": types.ModuleType("slime"),
        "slime.rollout": types.ModuleType("slime.rollout"),
        "slime.rollout.sglang_rollout": types.ModuleType("slime.rollout.sglang_rollout"),
        "slime.utils": types.ModuleType("slime.utils"),
        "slime.utils.async_utils": types.ModuleType("slime.utils.async_utils"),
    }
    modules["slime.rollout.sglang_rollout"].eval_rollout = eval_rollout
    modules["slime.utils.async_utils"].run = asyncio.run
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    push_groups(redis_url, namespace, [make_group("e0:0", n=4)])
    ds = RedisDataSource(_args(redis_url, namespace))
    out = generate_rollout(ds.args, 7, ds, evaluation=True)
    assert out.data == {"aime": {"rewards": [1.0]}} and calls == [(ds.args, 7)]
    assert len(ds) == 1 and read_counters(redis_url, namespace).get(Counter.ACCEPTED, 0) == 0  # training data untouched
    ds.close()


def test_a_stale_storm_is_named_once(redis_url, namespace, caplog):
    stale = [make_group(f"old{i}:0", n=4, admission_version=0) for i in range(4)]
    push_groups(redis_url, namespace, [*stale, make_group("new:0", n=4, admission_version=6), make_group("new2:0", n=4, admission_version=7)])
    ds = RedisDataSource(_args(redis_url, namespace, pipeline_eta=1, pipeline_stale_policy="drop", rollout_batch_size=1))
    with caplog.at_level("WARNING", logger="pipeline.slime"):
        generate_rollout(ds.args, 6, ds)
        generate_rollout(ds.args, 7, ds)
    storms = [r.getMessage() for r in caplog.records if "were stale" in r.getMessage()]
    assert len(storms) == 1 and "policy is at version 6" in storms[0] and "eta 1" in storms[0]
    ds.close()
