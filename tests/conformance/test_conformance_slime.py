"""Conformance with slime: slime's REAL code (the pinned snapshot, tests/support/conformance_support.py)
runs on what this pipeline hands it, through a real redis-server.

- the rollout function's samples are slime's own `Sample`, and `call_rollout_fn` /
  `validate_rollout_id_annotated` accept its output;
- `RolloutManager._convert_samples_to_train_data`, `_post_process_rewards` (ours through
  `--custom-reward-post-process-path`, and slime's default) and `_split_train_data_by_dp` take
  the batch (called unbound on a light object with the attributes they read);
- `_build_shifted_tokens` (the log-prob target builder of slime/backends/megatron_utils/loss.py)
  takes every sample, a failed episode's included: an episode whose environment failed in
  `start()` is run through `workers.episode.EpisodeRunner`, not built by hand;
- the weight-version law of slime's updaters, executed;
- the data-source calls of slime's train_async.py on a resume, with the engines' weight
  versions restarting at "1", the groups stamped as workers stamp them;
- slime's own train.py and train_async.py executed (scripts/oracle/slime_loop.py) with real
  workers on the simulator, intervals 1 and 2, a crash and a resume: every trained call carries
  the true policy version.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import urllib.request
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.conformance_support import require_slime
from tests.support.engine_stack import START_TIMEOUT_S
from tests.support.source_helpers import push_groups, read_counters, source_args

pytestmark = pytest.mark.conformance

N = 4
B = 2

SLIME_EXTRA = (
    "slime.ray.rollout",
    "slime.backends.megatron_utils.loss",
    "slime.observability.rollout_data_utils",
    "slime.backends.megatron_utils.update_weight.update_weight_from_distributed",
    "slime.ray.placement_group",
)


@pytest.fixture(scope="module")
def slime():
    """slime on sys.path and a pipeline.slime.data_source imported AFTER it (so its samples are slime's).

    pipeline.slime.data_source binds slime's classes at import; other test modules imported it without slime
    (LocalSample), so this module imports its own copy and puts the original back afterwards.
    """
    ns = require_slime(*SLIME_EXTRA)
    modules = ("pipeline.slime.samples", "pipeline.slime.data_source")  # the first binds slime's classes
    originals = {name: sys.modules.get(name) for name in modules}
    attrs = {name: getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2], None)
             for name in modules}
    for name in modules:
        sys.modules.pop(name, None)
    try:
        ns.pipeline = importlib.import_module("pipeline.slime.data_source")
        assert ns.pipeline.SampleClass is ns.Sample, "pipeline.slime.data_source did not pick up slime's Sample"
        yield ns
    finally:
        for name, module in originals.items():
            if module is not None:
                sys.modules[name] = module
                setattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2], attrs[name])
            else:
                sys.modules.pop(name, None)


# ------------------------------------------------------------------ helpers

def _args(redis_url, ns, **extra) -> Namespace:
    """What slime's argument parser would hand the data source and RolloutManager."""
    return source_args(
        # the pipeline's flags (and slime's batch shape)
        redis_url, ns, eta=2, batch=B, n=N, pipeline_wait_timeout_s=20,
        # slime's
        global_batch_size=B * N, micro_batch_size=1,
        advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True, reward_key=None,
        use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False,
        update_weights_interval=1, rollout_global_dataset=True, allgather_cp=False,
        custom_reward_post_process_path="pipeline.slime.data_source.post_process_rewards",
        custom_convert_samples_to_train_data_path=None,
        **extra,
    )


def _manager(slime, args):
    """A RolloutManager without Ray or engines: the conversion methods read only `args`,
    the two hooks `__init__` loads with slime's own `load_function`, and the train parallel
    config the actor sends (`set_train_parallel_config`)."""
    rollout = slime.modules["slime.ray.rollout"]
    from slime.utils.misc import load_function

    manager = SimpleNamespace(args=args)
    manager.custom_reward_post_process_func = (
        load_function(args.custom_reward_post_process_path) if args.custom_reward_post_process_path else None
    )
    manager.custom_convert_samples_to_train_data_func = None
    manager.train_parallel_config = {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    cls = rollout.RolloutManager.__ray_actor_class__  # @ray.remote wraps it; this is slime's class
    for name in ("_post_process_rewards", "_convert_samples_to_train_data", "_split_train_data_by_dp"):
        setattr(manager, name, getattr(cls, name).__get__(manager))
    return manager


def _rollout(slime, args, rid, ds):
    """slime's RolloutManager._get_rollout_data: call_rollout_fn, validate, flatten."""
    from slime.rollout.base_types import call_rollout_fn

    utils = slime.modules["slime.observability.rollout_data_utils"]
    out = call_rollout_fn(slime.pipeline.generate_rollout, args, rid, ds, evaluation=False)
    assert isinstance(out, slime.RolloutFnTrainOutput)
    utils.validate_rollout_id_annotated(out.samples)
    return out, [s for group in out.samples for s in group]


def _shifted_tokens(slime, samples):
    """slime's loss.py target builder on each sample as its own micro-batch (the first
    sample of a micro-batch is where a short sample breaks it), then on all of them packed."""
    import torch

    loss = slime.modules["slime.backends.megatron_utils.loss"]
    for s in samples:
        tokens = torch.tensor(s.tokens, dtype=torch.long)
        total = len(s.tokens)
        T = total + 3  # packed + padded logits are at least as long as the sample
        out = loss._build_shifted_tokens(T, torch.device("cpu"), [tokens], [total], [s.response_length], False)
        assert out.shape == (T,)
        assert out[: max(total - 1, 0)].tolist() == list(s.tokens[1:])
    lengths = [len(s.tokens) for s in samples]
    out = loss._build_shifted_tokens(
        sum(lengths), torch.device("cpu"), [torch.tensor(s.tokens, dtype=torch.long) for s in samples], lengths,
        [s.response_length for s in samples], False,
    )
    assert out.shape == (sum(lengths),)


def _group(group_id, *, admission_version, weight_versions, rewards=(1.0, 0.0, 1.0, 0.0), seed=0, prompt_len=12,
           response_len=6, **stamps):
    from pipeline.schema import Sample, SampleGroup, Status, Task

    rng = np.random.default_rng(seed)
    samples = [
        Sample.build(
            tokens=rng.integers(0, 1000, size=prompt_len + response_len), response_length=response_len,
            loss_mask=np.ones(response_len, dtype=np.uint8), rollout_log_probs=-rng.random(response_len),
            reward=float(r), status=Status.COMPLETED, weight_versions=list(weight_versions),
            prompt="p", response="r", label="1", **stamps,
        )
        for r in rewards
    ]
    task = Task(id=group_id.rsplit(":", 1)[0], env="synthetic", prompt="p", label="1")
    return SampleGroup(group_id=group_id, task=task, admission_version=admission_version, n_samples=len(samples),
                       samples=samples, worker_id="conformance")


# ------------------------------------------------------------------ (a) + (b)

def test_rollout_samples_are_slimes_and_rollout_manager_converts_them(slime, redis_url, namespace):
    from pipeline.synthetic import make_group

    rollout = slime.modules["slime.ray.rollout"]
    push_groups(redis_url, namespace, [make_group(f"g{i}:0", n=N, seed=i, prompt_len=16, response_len=8) for i in range(B)])
    args = _args(redis_url, namespace)
    ds = slime.pipeline.RedisDataSource(args)
    try:
        assert isinstance(ds, slime.DataSource)
        out, samples = _rollout(slime, args, 0, ds)
        assert all(type(s) is slime.Sample for s in samples)
        assert all(s.status is slime.Sample.Status.COMPLETED for s in samples)

        manager = _manager(slime, args)
        data = manager._convert_samples_to_train_data(samples)
        assert len(data["tokens"]) == B * N
        assert data["loss_masks"] == [s.loss_mask for s in samples]
        assert data["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
        assert set(data["source_names"]) == {"synthetic"}
        # ours, through --custom-reward-post-process-path, agrees with slime's own GRPO
        # normalisation when no sample is removed
        ours = data["rewards"]
        manager.custom_reward_post_process_func = None
        raw, theirs = manager._post_process_rewards(samples)
        assert ours == pytest.approx(theirs, abs=1e-4)
        assert raw == [s.reward for s in samples]

        # the Ray object store is not what is under test: put() hands the dict back
        boxes = []
        real_ray = rollout.ray
        rollout.ray = SimpleNamespace(put=lambda value, **_: value)
        try:
            boxes = manager._split_train_data_by_dp(data)
        finally:
            rollout.ray = real_ray
        assert len(boxes) == 1
        per_rank = boxes[0].inner
        assert sorted(per_rank["partition"]) == list(range(B * N))
        assert [t.tolist() for t in per_rank["tokens"]] == [data["tokens"][i] for i in per_rank["partition"]]
        _shifted_tokens(slime, samples)
    finally:
        ds.close()


# ------------------------------------------------------------------ (c) a failed episode

class _StartFails(Exception):
    pass


def _runner(client, chat, kind="calculator"):
    from pipeline.config import EnvConfig, parse_config
    from pipeline.schema import SamplingParams
    from workers.envs.registry import build_environment
    from workers.episode import EpisodeRunner, EpisodeSettings

    config = parse_config({})
    env_config = EnvConfig(kind=kind)
    env = build_environment("calc", env_config)
    return EpisodeRunner(client, chat, env, EpisodeSettings.from_config(config, env_config, SamplingParams()))


@pytest.mark.timeout(START_TIMEOUT_S + 120)  # + the session stack's start
def test_a_group_with_an_episode_whose_env_failed_to_start_trains_in_slime(slime, redis_url, namespace):
    """An environment that raises in start(): the episode is FAILED; slime hands it over with
    remove_sample=True (loss mask zeroed) but still builds log-prob targets from its tokens,
    so a sample with no tokens crashes the training step ("The expanded size of the tensor (N)
    must match the existing size (0)") even though it is masked out."""
    from pipeline.schema import SampleGroup, Status, Task
    from tests.support.engine_stack import shared_stack
    from workers.chat import ChatTokens
    from workers.engine import EngineClient
    from workers.sim.tokenizer import load_test_tokenizer

    task = Task(id="calc-1", env="calc", prompt="What is 12 * (3 + 4)?", label="84")
    chat = ChatTokens(load_test_tokenizer())
    stack = shared_stack()  # the episodes go through smg -> SGLang's front -> the simulator
    stack.configure(accuracy=1.0, tool_use=1.0)
    for url in stack.engine_urls:  # slime's first push labels the weights "1"
        request = urllib.request.Request(f"{url}/update_weight_version", data=b'{"new_version": "1"}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            resp.read()

    async def episodes():
        async with EngineClient(stack.router_url) as client:
            ok = [await _runner(client, chat).run(task, f"calc-1:0/0/{j}", j) for j in range(N - 1)]
            broken = _runner(client, chat)

            async def start(_task):
                raise _StartFails("environment server refused the session")

            broken.env.start = start
            failed = await broken.run(task, f"calc-1:0/0/{N - 1}", N - 1)
        return ok, failed

    ok, failed = asyncio.run(episodes())
    assert failed.status is Status.FAILED
    assert "environment server refused the session" in str(failed.metadata)
    group = SampleGroup(group_id="calc-1:0", task=task, admission_version=0, n_samples=N, samples=[*ok, failed],
                        worker_id="conformance")
    push_groups(redis_url, namespace, [group, _group("other:0", admission_version=0, weight_versions=["1"])])

    args = _args(redis_url, namespace)
    ds = slime.pipeline.RedisDataSource(args)
    try:
        _, samples = _rollout(slime, args, 0, ds)
        by_group = [s for s in samples if s.metadata["pipeline"]["group_id"] == "calc-1:0"]
        handed_over = by_group[N - 1]
        assert handed_over.remove_sample and handed_over.status is slime.Sample.Status.FAILED
        manager = _manager(slime, args)
        data = manager._convert_samples_to_train_data(samples)
        index = samples.index(handed_over)
        assert data["loss_masks"][index] == [0] * handed_over.response_length
        assert data["rewards"][index] == 0.0  # pipeline.slime.data_source.post_process_rewards: no advantage
        real_ray = slime.modules["slime.ray.rollout"].ray
        slime.modules["slime.ray.rollout"].ray = SimpleNamespace(put=lambda value, **_: value)
        try:
            (box,) = manager._split_train_data_by_dp(data)
        finally:
            slime.modules["slime.ray.rollout"].ray = real_ray
        assert sorted(box.inner["partition"]) == list(range(len(samples)))
        # the failed sample first in its micro-batch, as slime's packing may place it
        _shifted_tokens(slime, [handed_over, *[s for s in samples if s is not handed_over]])
    finally:
        ds.close()


# ------------------------------------------------------------------ (d) weight versions

class _Remote:
    """A Ray actor method stand-in: `.remote(**kw)` records the call and returns it."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, *args, **kwargs):
        self.log.append((self.name, kwargs))
        return (self.name, kwargs)


class _Engine:
    def __init__(self):
        self.calls = []
        for name in ("pause_generation", "flush_cache", "continue_generation", "update_weights_from_distributed"):
            setattr(self, name, _Remote(self.calls, name))


def test_weight_version_law_of_slimes_updaters(slime, monkeypatch):
    """slime's weight updaters label the engines' weights with a per-process counter: it
    starts at 0 in __init__, update_weights() adds 1 before sending, and the engines get
    str(counter) (`weight_version=str(weight_version)`). So the first push of every trainer
    process -- the one train_async.py makes before its loop, a resume included -- is "1":
    the labels restart after a resume and say nothing about the policy version.

    Executed on UpdateWeightFromDistributed with one in-process stand-in engine (Ray calls
    recorded, torch.distributed collectives no-ops, no tensors to send); the tensor
    (colocated) updater keeps the same counter, checked on its source.
    """
    mod = slime.modules["slime.backends.megatron_utils.update_weight.update_weight_from_distributed"]
    monkeypatch.setattr(mod, "ray", SimpleNamespace(get=lambda refs: refs))
    monkeypatch.setattr(mod, "dist", SimpleNamespace(get_rank=lambda: 0, barrier=lambda group=None: None))
    monkeypatch.setattr(mod, "get_gloo_group", lambda: None)

    class Lock:
        acquire = release = _Remote([], "lock")

    engine = _Engine()

    class OneBucket(mod.UpdateWeightFromDistributed):
        def _send_weights(self, pbar):  # one (empty) bucket through slime's real transfer path
            self._update_bucket_weights_from_distributed([], pbar=SimpleNamespace(update=lambda n: None))

    updater = OneBucket(Namespace(), [], lambda: {}, model_name="m", quantization_config=None)
    assert updater.weight_version == 0
    updater.rollout_engines, updater.rollout_engine_lock = [engine], Lock()
    updater._group_name, updater._model_update_groups, updater._is_pp_src_rank = "slime-pp_0", None, True
    sent = []
    for _ in range(3):
        updater.update_weights()
        sent += [kw["weight_version"] for name, kw in engine.calls if name == "update_weights_from_distributed"]
        engine.calls.clear()
    assert sent == ["1", "2", "3"]
    assert updater.weight_version == 3

    # a new process (a resume) starts over
    assert OneBucket(Namespace(), [], lambda: {}, model_name="m", quantization_config=None).weight_version == 0

    tensor_path = slime.path / "slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py"
    source = tensor_path.read_text()
    init = source[source.index("class UpdateWeightFromTensor"):]
    assert "self.weight_version = 0" in init[: init.index("def update_weights")]
    body = init[init.index("def update_weights") :]
    assert body.index("self.weight_version += 1") < body.index("ray.get(")
    assert '"weight_version": str(weight_version)' in source


# ------------------------------------------------------------------ train_async.py on a resume

def _published_stamp(redis_url, ns, rollout_id):
    """What a worker reads before a generate call once the data source published `rollout_id`."""
    from pipeline.keys import Keys
    from pipeline.state import PipelineState
    from pipeline.store.redis_conn import connect

    async def go():
        client = connect(redis_url)
        keys = Keys(ns)
        try:
            for _ in range(2000):
                if await client.hget(keys.policy, "rollout") == str(rollout_id).encode():
                    return await PipelineState(client, keys).get_policy()
                await asyncio.sleep(0.01)
            raise AssertionError(f"rollout {rollout_id} was never published")
        finally:
            await client.aclose()

    return asyncio.run(go())


def _rollout_with(slime, args, rid, ds, prefix, labels, *, seed):
    """generate_rollout(rid) as slime calls it while the workers produce its groups: B groups
    whose calls answered with engine `labels` carry the stamps a worker records for them
    (workers/episode.py: `(stamp.run, stamp.version_of(call's labels))`, one per call), and an
    admission version of 0 that would be stale on its own."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        rollout = pool.submit(_rollout, slime, args, rid, ds)
        stamp = _published_stamp(args.pipeline_redis_url, args.pipeline_namespace, rid)
        push_groups(args.pipeline_redis_url, args.pipeline_namespace, [
            _group(f"{prefix}{i}:0", admission_version=0, weight_versions=labels, seed=seed + i,
                   policy_versions=[stamp.version_of([label]) for label in labels], policy_run=stamp.run)
            for i in range(B)
        ])
        return rollout.result(timeout=60)


def test_resume_sequence_of_train_async_with_engine_versions_restarting(slime, redis_url, namespace):
    """What slime's train_async.py (the pinned snapshot) does with the data source on a resume
    from the checkpoint of rollout k (read from train_async.py, slime/ray/placement_group.py,
    slime/ray/rollout.py and slime/backends/megatron_utils/actor.py):

    1. `create_rollout_manager` -> `RolloutManager.__init__` builds the data source:
       `RedisDataSource(args)` (a new object in a new process; nothing of the old one survives).
       With `--num-rollout` unset it would also call `len(data_source)`.
    2. `create_training_models` -> the actor loads the checkpoint and returns
       `start_rollout_id = loaded_rollout_id + 1` = k + 1; then, only with
       `--rollout-global-dataset`, `rollout_manager.load(start_rollout_id - 1)` ->
       `data_source.load(k)`.
    3. `actor_model.update_weights()` BEFORE the loop: the engines get the checkpoint's
       weights labelled "1" (the updater's counter is per process, see the weight-version test),
       i.e. policy version k + 1 carries engine label "1".
    4. `rollout_manager.generate.remote(k + 1)` -> `generate_rollout(args, k + 1, data_source,
       evaluation=False)` (through `call_rollout_fn`); in the loop, `generate(rid + 1)` is
       started before step rid trains, `data_source.save(rid)` runs with each checkpoint
       (`--rollout-global-dataset`), and after every `--update-weights-interval` steps it waits
       for the pending generate, then `update_weights()` -> labels "2", "3", ...

    So after the resume, groups generated by the restarted engines carry engine weight
    versions ["1"] although the policy is k + 1: generate_rollout(k + 1) must take them, not
    reject them as k steps stale.

    The groups carry the stamps a worker records (`_stamped_groups`: read from what the data
    source published for that rollout, each call's label translated by
    `PolicyStamp.version_of`) and an admission version of 0, so only a right translation
    passes: one that maps "1" lower makes them stale, one that maps it higher shows in the
    versions slime receives, which must be the true ones (k + 1, then k + 2 after the push).
    """
    from pipeline.keys import Counter

    k = 5
    eta = 1
    # the run before the crash: steps 0..k trained, checkpoint k saved (acks everything <= k)
    push_groups(redis_url, namespace, [
        _group(f"old{i}:0", admission_version=i // B, weight_versions=[str(i // B + 1)], seed=i)
        for i in range(B * (k + 1))
    ])
    args = _args(redis_url, namespace, pipeline_eta=eta)
    ds = slime.pipeline.RedisDataSource(args)
    for rid in range(k + 1):
        _rollout(slime, args, rid, ds)
    ds.save(k)
    ds._loop.close()  # the trainer dies: no close()

    # the resumed process, step by step as train_async.py drives it
    args = _args(redis_url, namespace, pipeline_eta=eta, start_rollout_id=None)
    ds = slime.pipeline.RedisDataSource(args)  # 1.
    try:
        start_rollout_id = k + 1  # 2. loaded_rollout_id + 1
        ds.load(start_rollout_id - 1)
        # 3. the weight push labels the engines "1"; workers produce groups of policy k + 1
        out, samples = _rollout_with(slime, args, start_rollout_id, ds, "new", ["1"], seed=100)  # 4.
        assert [g[0].metadata["pipeline"]["group_id"] for g in out.samples] == ["new0:0", "new1:0"]
        assert all(type(s) is slime.Sample for s in samples)
        assert all(s.weight_versions == [str(k + 1)] for s in samples)  # the policy version, not the label
        counters = read_counters(redis_url, namespace)
        assert counters.get(Counter.STALE, 0) == 0, counters
        # next step: generated while k + 1 trains (label still "1"), then label "2" (version k + 2)
        out, samples = _rollout_with(slime, args, start_rollout_id + 1, ds, "next", ["1", "2"], seed=200)
        assert [g[0].metadata["pipeline"]["group_id"] for g in out.samples] == ["next0:0", "next1:0"]
        assert all(s.weight_versions == [str(k + 1), str(k + 2)] for s in samples)
        assert read_counters(redis_url, namespace).get(Counter.STALE, 0) == 0
    finally:
        ds.close()


def test_train_async_calls_are_the_ones_documented_above(slime):
    """Keeps the docstring above honest against the pinned snapshot."""
    train_async = (slime.path / "train_async.py").read_text()
    placement = (slime.path / "slime/ray/placement_group.py").read_text()
    actor = (slime.path / "slime/backends/megatron_utils/actor.py").read_text()
    rollout = inspect.getsource(slime.modules["slime.ray.rollout"])
    assert train_async.index("actor_model.update_weights()") < train_async.index(
        "rollout_manager.generate.remote(args.start_rollout_id)"
    ) < train_async.index("for rollout_id in range(args.start_rollout_id, args.num_rollout)")
    assert "rollout_manager.save.remote(rollout_id)" in train_async
    assert "rollout_manager.load.remote(args.start_rollout_id - 1)" in placement
    assert "start_rollout_id = loaded_rollout_id + 1" in actor
    assert "self.data_source = data_source_cls(args)" in rollout
    assert "call_rollout_fn(self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)" in rollout


# ------------------------------------------------------------------ slime's own loops, executed

LOOP_B, LOOP_N = 3, 2


def _loop_config(redis_url, ns, *, eta, engine):
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine, "max_retries": 2, "retry_backoff_s": 0.05},
        "rollout": {"n_samples_per_prompt": LOOP_N, "rollout_batch_size": LOOP_B, "eta": eta,
                    "max_response_tokens": 256},
        "environments": {"calc": {"kind": "calculator"}},
        "workers": {"concurrency": 4, "heartbeat_s": 0.5, "dead_after_s": 5.0, "poll_delay_s": 0.02},
    }


async def _quiet(redis, keys, timeout_s=60.0):
    """No group queued or generating (the crashed trainer's last policy is still published, so
    the workers finish what was admitted under it), steadily for half a second."""
    from pipeline.keys import Counter
    from pipeline.state import PipelineState

    loop = asyncio.get_running_loop()
    deadline, quiet_since = loop.time() + timeout_s, None
    while loop.time() < deadline:
        running = (await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0)
        if running == 0 and await redis.zcard(keys.queue) == 0:
            quiet_since = quiet_since or loop.time()
            if loop.time() - quiet_since >= 0.5:
                return
        else:
            quiet_since = None
        await asyncio.sleep(0.05)
    raise AssertionError("the workers never went quiet after the trainer died")


def _group_ids(samples):
    return [s.metadata["pipeline"]["group_id"] for s in samples]


def _check_every_stamp(cluster, eta):
    """Every call of every trained sample: the version slime receives is the true version of
    the weights that answered it (the oracle: which (run, label) the actor pushed after how many
    steps), and its lag, seen from the run that trained it, is <= eta. A step an earlier run had
    generated is replayed identically (docs/architecture.md, slime side): its groups are that
    run's and their lag is the one they had there. Returns the calls checked."""
    checked = 0
    generated = {m.data_source.run_id: m.batches for m in cluster.managers}
    for run, steps in cluster.trained.items():
        for rid, samples in steps.items():
            assert len(samples) == LOOP_B * LOOP_N, f"run {run} rollout {rid}: {len(samples)} samples"
            earlier = [batches[rid] for r, batches in generated.items() if r < run and rid in batches]
            if earlier:
                assert _group_ids(samples) == _group_ids(earlier[-1]), f"run {run} rollout {rid}: not a replay"
            for s in samples:
                if s.remove_sample:
                    continue
                labels, stamps = s.metadata["engine_weight_versions"], [int(v) for v in s.weight_versions]
                stamp_run = s.metadata["pipeline"]["policy_run"]
                assert stamps and len(labels) == len(stamps), (labels, stamps)
                seen_from = stamp_run if earlier else run
                later_starts = [start for r, start in cluster.starts.items() if stamp_run < r <= seen_from]
                for label, stamp in zip(labels, stamps):
                    truth = cluster.truth[(stamp_run, label)]
                    assert stamp == truth, f"run {run} rollout {rid}: stamped {stamp}, the weights were {truth}"
                    assert rid - min([truth, *later_starts]) <= eta, f"run {run} rollout {rid}: lag over {eta}"
                    checked += 1
    return checked


@pytest.mark.timeout(START_TIMEOUT_S + 120)  # + the session stack's start
@pytest.mark.parametrize("loop_name, interval, eta", [
    ("train", 1, 1), ("train", 2, 1), ("train_async", 1, 1), ("train_async", 2, 2),
])
async def test_slimes_own_loops_stamp_every_group_with_its_true_version(
        slime, monkeypatch, tmp_path, redis, redis_url, keys, namespace, loop_name, interval, eta):
    """slime's train.py / train_async.py (the snapshot's files, scripts/oracle/slime_loop.py) drive
    the pipeline: real workers generate against the simulated engine while the loop pushes
    weights in its own order (train.py after every step, whatever the interval; train_async.py
    every `interval` steps). Run 1 saves every 2 steps and dies in step 5; run 2 resumes from
    checkpoint 3 with the engines' labels back at "1" and trains 4-7. Every call of every trained
    sample carries its true policy version."""
    import json

    from pipeline.config import parse_config
    from producers.enqueue import ProducerOptions, run_producer
    from scripts.oracle.slime_loop import Cluster, Crash, install, load_loop, slime_args
    from tests.support.engine_stack import shared_stack
    from workers.settings import build_worker, stop_worker

    loop = load_loop(slime.path, loop_name)
    (tmp_path / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "env": "calc", "prompt": f"What is {i} * 3?", "label": str(3 * i)}) + "\n"
        for i in range(60)
    ))
    stack = await asyncio.to_thread(shared_stack)  # smg -> SGLang's fronts -> the simulators
    await asyncio.to_thread(stack.configure, accuracy=0.6)
    config = parse_config(_loop_config(redis_url, namespace, eta=eta, engine=stack.router_url))
    workers = [build_worker(config, handle_signals=False) for _ in range(2)]
    runs = [asyncio.create_task(w.async_run()) for w in workers]
    producer = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", follow=True, epochs=5,
                                                redis=redis, options=ProducerOptions(poll_s=0.02)))
    cluster = Cluster(stack.engine_urls)
    pipeline_args = dict(
        pipeline_redis_url=redis_url, pipeline_namespace=namespace, rollout_batch_size=LOOP_B,
        n_samples_per_prompt=LOOP_N, pipeline_eta=eta, pipeline_wait_timeout_s=60.0, pipeline_wait_log_s=5.0,
        pipeline_trainer_loop="sync" if loop_name == "train" else "async",
        sglang_router_ip="127.0.0.1", sglang_router_port=int(stack.router_url.rsplit(":", 1)[1]),
    )
    try:
        install(monkeypatch, loop, slime, cluster, crash_at=5)
        with pytest.raises(Crash):
            await asyncio.to_thread(loop.train, slime_args(pipeline_args, num_rollout=8, interval=interval,
                                                           save_interval=2))
        await asyncio.to_thread(cluster.managers[-1].die)
        assert cluster.checkpoint == 3 and sorted(cluster.trained[1]) == [0, 1, 2, 3, 4]
        await _quiet(redis, keys)

        install(monkeypatch, loop, slime, cluster)
        await asyncio.to_thread(loop.train, slime_args(pipeline_args, num_rollout=8, interval=interval,
                                                       save_interval=2))
        await asyncio.to_thread(cluster.managers[-1].close)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        for worker, task in zip(workers, runs):
            await stop_worker(worker, task)
    assert cluster.starts == {1: 0, 2: 4} and sorted(cluster.trained[2]) == [4, 5, 6, 7]
    pushes = {run: sorted(int(label) for r, label in cluster.truth if r == run) for run in (1, 2)}
    every_step = loop_name == "train" or interval == 1
    assert len(pushes[2]) == 1 + (4 if every_step else 2)  # the loop's own law, as executed
    assert _check_every_stamp(cluster, eta) > 0
