"""slime's own training loops, executed: the pinned snapshot's `train.py` and `train_async.py`
loaded as modules and their `train(args)` run with the GPU-side actors stood in for.

What stays slime's: the loop order in both files, `create_training_models` (it sets
`start_rollout_id` and calls `rollout_manager.load(start - 1)`), `create_rollout_manager`,
`should_run_periodic_action` (checkpoints), and the RolloutManager methods the loop reaches
(`_get_rollout_data`: `call_rollout_fn` + `validate_rollout_id_annotated`, `save`, `load`),
bound to a light object as tests/conformance/test_conformance_slime.py does. The data source and rollout
function are the pipeline's, loaded by slime's `load_function` from `--data-source-path` and
`--rollout-function-path`.

What is stood in for: Ray (`ray.get` resolves futures; an actor's calls run one at a time in
submission order on one thread, as a plain `@ray.remote` actor runs them), the placement
groups, tracking, and the Megatron actor: `update_weights()` does what slime's updater does to
the engines (pause in the cluster's `push_mode`, `/update_weight_version` with the per-process
push count, continue: pipeline.slime.weight_push.push_weights; under abort the engines answer running
requests as SGLang does, under in_place / retract they keep them) and records which policy version each
(run, label) really is, from the steps it trained: the oracle.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from argparse import Namespace
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

from pipeline.slime.weight_push import PushMode, push_weights


class Crash(Exception):
    """The trainer process dies in the middle of a step."""


def load_loop(slime_path: Path, name: str) -> ModuleType:
    """slime's `train.py` or `train_async.py` as a fresh module (its imports are slime's own)."""
    spec = importlib.util.spec_from_file_location(f"slime_loop_{name}", slime_path / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolve(ref: Any) -> Any:
    """`ray.get`: a future's result, a list element-wise, anything else as is."""
    if isinstance(ref, Future):
        return ref.result()
    if isinstance(ref, list):
        return [resolve(r) for r in ref]
    return ref


FAKE_RAY = SimpleNamespace(get=resolve)


class _Remote:
    def __init__(self, executor: ThreadPoolExecutor, fn: Any):
        self.executor, self.fn = executor, fn

    def remote(self, *args: Any, **kwargs: Any) -> Future:
        return self.executor.submit(self.fn, *args, **kwargs)


class RolloutManagerActor:
    """A RolloutManager actor handle: slime's own methods on a light object, one call at a time."""

    def __init__(self, cls: type, args: Namespace):
        from slime.utils.http_utils import init_http_client
        from slime.utils.misc import load_function

        self.state = SimpleNamespace(args=args)
        init_http_client(args)  # RolloutManager.__init__: slime's generate posts with it (no engines counted: none)
        self.state.data_source = load_function(args.data_source_path)(args)  # RolloutManager.__init__
        self.state.generate_rollout = load_function(args.rollout_function_path)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-manager")
        get_data, save, load = (getattr(cls, n).__get__(self.state) for n in ("_get_rollout_data", "save", "load"))
        self.batches: dict[int, list[Any]] = {}  # rollout id -> the samples generate() returned
        # slime's RolloutManager.eval (its own eval function: --eval-function-path, else the
        # rollout function); the engines' health monitors it resumes are GPU-side: none here
        eval_rollout = load_function(getattr(args, "eval_function_path", None) or args.rollout_function_path)
        self.evals: list[tuple[int, dict[str, Any], float]] = []  # (rollout id, the round's metrics, when done)

        def eval_and_record(*fn_args: Any, **fn_kwargs: Any) -> Any:
            output = eval_rollout(*fn_args, **fn_kwargs)
            self.evals.append((fn_args[1], dict(getattr(output, "metrics", None) or {}), time.monotonic()))
            return output

        self.state.eval_generate_rollout = eval_and_record
        self.state.health_monitoring_resume = lambda: None
        slime_eval = getattr(cls, "eval").__get__(self.state)  # noqa: B009  (mypy: a type has no eval)
        self.eval_calls: list[tuple[int, float]] = []  # (rollout id, seconds the loop waited for the call)
        convert = self._converter(cls, args)

        self.generate_s: dict[int, float] = {}  # rollout id -> seconds its generate call took (the data's wait)

        def generate(rollout_id: int) -> Any:
            started = time.monotonic()
            self.batches[rollout_id] = get_data(rollout_id=rollout_id)[0]
            out = convert(self.batches[rollout_id]) if convert else self.batches[rollout_id]
            self.generate_s[rollout_id] = time.monotonic() - started
            return out

        def evaluate(rollout_id: int) -> None:
            started = time.monotonic()
            slime_eval(rollout_id)
            self.eval_calls.append((rollout_id, time.monotonic() - started))

        self.generate = _Remote(self.executor, generate)
        self.eval = _Remote(self.executor, evaluate)
        self.save = _Remote(self.executor, save)
        self.load = _Remote(self.executor, load)
        self.dispose = _Remote(self.executor, lambda: None)

    def _converter(self, cls: type, args: Namespace) -> Any:
        """With `args.cpu_actor`: slime's `_post_process_rewards` + `_convert_samples_to_train_data`
        on the samples (what RolloutManager.generate hands a real actor, before the DP split);
        `args.shuffle_rewards_hook(samples)` runs first when set (a negative control)."""
        if not getattr(args, "cpu_actor", False):
            return None
        from slime.utils.misc import load_function

        state = self.state
        state.custom_reward_post_process_func = (load_function(args.custom_reward_post_process_path)
                                                 if args.custom_reward_post_process_path else None)
        state.custom_convert_samples_to_train_data_func = None
        post, convert = (getattr(cls, n).__get__(state) for n in ("_post_process_rewards",
                                                                  "_convert_samples_to_train_data"))
        state._post_process_rewards = post
        hook = getattr(args, "before_convert", None)

        def run(samples: list[Any]) -> Any:
            if hook is not None:
                hook(samples)
            return convert(samples)

        return run

    @property
    def data_source(self) -> Any:
        return self.state.data_source

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        close = getattr(self.data_source, "close", None)  # the pipeline's has one; slime's own holds nothing to close
        if close is not None:
            close()

    def die(self) -> None:
        """The process is gone: the call in flight finishes (its batch is recorded), nothing closes."""
        self.executor.shutdown(wait=True)
        self.data_source._loop.close()


class Cluster:
    """The engines, the checkpoints and the truth, across trainer processes (runs)."""

    def __init__(self, engine_urls: list[str], *, train_s: float = 0.0, push_mode: PushMode = PushMode.ABORT):
        self.engine_urls = engine_urls  # slime's updater pushes to each engine, not to the router
        self.train_s = train_s  # how long a training step takes (0: at once)
        self.push_mode = push_mode  # SGLang's pause mode of every push (ROLLOUT_PUSH_MODE on a cluster)
        self.steps_at: list[tuple[int, float, float]] = []  # (rollout id, wall-clock start, end) of each step
        self.pushed_at: list[float] = []  # monotonic time of each weight push
        self.truth: dict[tuple[int, str], int] = {}  # (run, engine label) -> the policy version it was
        self.checkpoint: int | None = None  # the last rollout id saved
        self.trained: dict[int, dict[int, Any]] = {}  # run -> rollout id -> what the actor trained on
        self.starts: dict[int, int] = {}  # run -> its start_rollout_id
        self.managers: list[Any] = []  # RolloutManagerActor, or rollout_process.RolloutManagerHandle


class MegatronActor:
    """The train group of one trainer process (`RayTrainGroup`): trains, saves, pushes weights."""

    def __init__(self, cluster: Cluster, run: int, start: int, crash_at: int | None):
        self.cluster, self.run, self.start, self.crash_at = cluster, run, start, crash_at
        self.steps = 0  # optimizer steps taken by this process
        self.pushes = 0  # slime's updater counter: per process, from 0
        self.lock = threading.Lock()
        cluster.trained[run] = {}
        cluster.starts[run] = start

    def update_weights(self) -> None:
        self.pushes += 1
        label = str(self.pushes)
        self.cluster.truth[(self.run, label)] = self.start + self.steps
        push_weights(self.cluster.engine_urls, label, self.cluster.push_mode)
        self.cluster.pushed_at.append(time.monotonic())

    def async_train(self, rollout_id: int, data: Any, external_data: Any = None) -> None:
        if rollout_id == self.crash_at:
            raise Crash(f"trainer killed in step {rollout_id}")
        started = time.time()
        time.sleep(self.cluster.train_s)
        self.cluster.trained[self.run][rollout_id] = data
        self.steps += 1
        self.cluster.steps_at.append((rollout_id, started, time.time()))

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        self.cluster.checkpoint = rollout_id

    def clear_memory(self) -> None:
        pass


def slime_args(pipeline_args: dict[str, Any], *, num_rollout: int, interval: int, save_interval: int) -> Namespace:
    """The attributes slime's parser gives that train.py, train_async.py and the helpers above read
    (`pipeline_args` may set slime's too, e.g. eval_interval)."""
    return Namespace(**{**dict(
        release_train=False, offload_rollout=False, offload_train=False, use_critic=False, colocate=False,
        check_weight_update_equal=False, num_rollout=num_rollout, num_epoch=None, eval_interval=None,
        skip_eval_before_train=True, save_interval=save_interval, rollout_global_dataset=True,
        update_weights_interval=interval, num_critic_only_steps=0, start_rollout_id=None,
        data_source_path="pipeline.slime.data_source.RedisDataSource", rollout_function_path="pipeline.slime.data_source.generate_rollout",
        load_debug_rollout_data=None, debug_rollout_only=False, debug_train_only=False,
        eval_function_path=None, save_debug_rollout_data=None,
        # what slime's RolloutManager.eval -> log_eval_rollout_data reads (no tracker here)
        custom_eval_rollout_log_function_path=None, advantage_estimator="grpo", reward_key=None,
        log_reward_category=None, log_passrate=False, wandb_always_use_train_step=False, use_wandb=False,
        use_tensorboard=False,
    ), **pipeline_args})


class Patches:
    """Attributes replaced for one run and put back by `undo()`: the two methods of pytest's
    MonkeyPatch that `install` calls (`setattr`, `undo`), without pytest (a test dependency, not a
    runtime one), on the standard library's `unittest.mock.patch.object` (the attribute must exist;
    undone in reverse order). Also a context manager: `with Patches() as patches: ...`."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self._stack.enter_context(mock.patch.object(target, name, value))

    def undo(self) -> None:
        self._stack.close()

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def install(monkeypatch: Any, loop: ModuleType, slime: Any, cluster: Cluster, *, crash_at: int | None = None,
            actor: Any = None, manager: Any = None) -> None:
    """Stand in for Ray, placement and the actor model under slime's own functions (through
    `monkeypatch.setattr`: a `Patches`, or pytest's MonkeyPatch in a test), for one trainer process (its run number is the one its data source began). `actor(cluster, run,
    start, crash_at)` builds the actor (default: `MegatronActor`, which trains nothing); `manager(args)`
    the RolloutManager (default: a `RolloutManagerActor` in this process; rollout_process.py's in a
    process of its own)."""
    placement = slime.modules["slime.ray.placement_group"]
    rollout = slime.modules["slime.ray.rollout"]
    manager_cls = rollout.RolloutManager.__ray_actor_class__  # slime's class (@ray.remote wraps it)

    class RolloutManagerClass:
        __ray_actor_class__ = manager_cls

        @staticmethod
        def options(**_: Any) -> Any:
            return SimpleNamespace(remote=lambda args, pg: _new_manager(args))

    def _new_manager(args: Namespace) -> Any:
        built = manager(args) if manager is not None else RolloutManagerActor(manager_cls, args)
        cluster.managers.append(built)
        return built

    def create_actor_model(args: Namespace, pgs: Any, rollout_manager: Any, actor_cls: Any = None) -> Any:
        start = 0 if cluster.checkpoint is None else cluster.checkpoint + 1  # actor.py: loaded_rollout_id + 1
        run = getattr(rollout_manager.data_source, "run_id", 0)  # slime's own data source counts no trainer runs
        return (actor or MegatronActor)(cluster, run, start, crash_at), [start]

    monkeypatch.setattr(rollout, "RolloutManager", RolloutManagerClass)
    monkeypatch.setattr(placement, "ray", FAKE_RAY)
    monkeypatch.setattr(placement, "create_actor_model", create_actor_model)
    monkeypatch.setattr(loop, "ray", FAKE_RAY)
    monkeypatch.setattr(loop, "create_placement_groups", lambda args: {"rollout": None, "actor": None, "critic": None})
    for name in ("configure_logger", "init_tracking", "finish_tracking"):
        monkeypatch.setattr(loop, name, lambda *a, **k: None)
