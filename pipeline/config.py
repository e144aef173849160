"""Typed configuration: the pipeline YAML (producers, workers, environments) and the
slime-side settings (from slime's `args` with env-var fallbacks).

Every section is a msgspec Struct with `forbid_unknown_fields`, so a typo in a YAML
key is an error that names the key and its path, not a silently ignored setting.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

import msgspec
import yaml

from pipeline.keys import DEFAULT_NAMESPACE
from pipeline.sampling import seed_errors
from pipeline.schema import SamplingParams
from pipeline.staleness import ConsumeOrder, StalePolicy, TrainerLoop
from pipeline.store.redis_conn import (
    DEFAULT_REDIS_URL,
    ENV_MIN_REPLICA_ACKS,
    ENV_REDIS_URL,
    parse_redis_url,
    redact,
    with_replica_acks,
)

ENV_NAMESPACE = "ROLLOUT_NAMESPACE"
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")

# Bounds of numeric settings: a value outside is an error naming the key ("Expected `int` >= 1 -
# at `$.rollout.rollout_batch_size`"), not a pipeline that stalls or spins.
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class ConfigError(ValueError):
    """A configuration value is missing or wrong; the message names the file and key."""


def check_redis_url(url: str, where: str = "redis.url") -> None:
    """ValueError naming `where` unless `url` is a redis://, rediss://, unix:// or
    redis+sentinel://host:26379,host2:26379/<service>/<db> URL."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"{where} {redact(url)!r} is not a Redis URL (redis://host:6379/0, rediss://..., unix://..., "
                         "redis+sentinel://host:26379,host2:26379/mymaster/0)")
    try:
        parse_redis_url(url)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if scheme in ("redis", "rediss"):
        try:
            urlsplit(url).port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise ValueError(f"{where} {redact(url)!r}: {exc}") from None


def check_namespace(ns: str, where: str = "redis.namespace") -> None:
    if not ns or any(c.isspace() for c in ns):
        raise ValueError(f"{where} {ns!r} must be a non-empty string without spaces")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class RedisSection(_Section, frozen=True):
    url: str = ""  # empty = $ROLLOUT_REDIS_URL or redis://127.0.0.1:6379/0; redis+sentinel://h:26379,.../mymaster/0
    namespace: str = DEFAULT_NAMESPACE
    # WAIT for this many replicas after a write that must not vanish in a failover (push, step
    # record, ack, admission); None = the URL's ?min_replica_acks=, else $ROLLOUT_REDIS_MIN_REPLICA_ACKS, else 0
    min_replica_acks: Union[NonNegInt, None] = None

    def __post_init__(self) -> None:
        if self.url:
            check_redis_url(self.url)
        check_namespace(self.namespace)

    def resolved_url(self) -> str:
        """The URL every component connects with; it carries `min_replica_acks` when set here."""
        url = self.url or os.environ.get(ENV_REDIS_URL, DEFAULT_REDIS_URL)
        return url if self.min_replica_acks is None else with_replica_acks(url, self.min_replica_acks)


class EngineSection(_Section, frozen=True):
    url: str = "auto"  # "auto" = follow `{ns}:engine` published by the slime side
    tokenizer: str = ""  # path or name loadable by transformers.AutoTokenizer
    request_timeout_s: PosFloat = 600.0
    max_retries: NonNegInt = 5
    retry_backoff_s: NonNegFloat = 0.5
    max_context_tokens: PosInt = 32768
    # the engines run SGLang's --enable-deterministic-inference (slime: --sglang-enable-deterministic-
    # inference): only then does a `rollout.sampling.sampling_seed` do anything (pipeline/sampling.py)
    deterministic_inference: bool = False
    # send each request's group clock as SGLang `priority` (the group due soonest gets a free slot
    # first) where every engine says enable_priority_scheduling in /server_info (slime:
    # --sglang-enable-priority-scheduling); engines without it get no priority either way
    due_priority: bool = True


class RolloutSection(_Section, frozen=True):
    n_samples_per_prompt: PosInt = 8
    rollout_batch_size: PosInt = 32  # groups per training step (B)
    eta: NonNegInt = 2  # staleness bound
    max_response_tokens: PosInt = 4096  # budget over all turns of one episode
    max_turns: PosInt = 8  # default; an environment may override
    sampling: SamplingParams = SamplingParams(temperature=1.0, top_p=1.0)
    # re-admissions of one (task, epoch) after a failure or a stale rejection, then it is
    # dead-lettered for good (workers hand failed tasks back themselves; the producer re-admits
    # the rest; `rollout enqueue --max-requeues` overrides it there)
    max_requeues: NonNegInt = 3
    # `rollout plan --save` output (pipeline/sizing.py): the producer warns once where the trainer's
    # B is below the B that keeps the engines full at this eta ("": no advice, no check)
    sizing_advice: str = ""


class WorkersSection(_Section, frozen=True):
    concurrency: PosInt = 32  # groups run at once per process (arq max_jobs)
    job_timeout_s: PosFloat = 3600.0
    max_tries: PosInt = 3
    poll_delay_s: PosFloat = 0.05
    # a worker with a free slot also waits on the admission's `{ns}:queued_events` message and takes
    # at once what was admitted (false: the poll alone, which backs off to 1 s on an empty queue)
    wake_on_admission: bool = True
    heartbeat_s: PosFloat = 5.0
    dead_after_s: PosFloat = 20.0  # a worker silent this long has its jobs released
    drain_grace_s: NonNegFloat = 30.0  # SIGTERM: finish running groups within this, then hand back
    # eval jobs' (pipeline/eval/evaluation.py) share of a process: of its slots, max(1, floor(eval_share x
    # concurrency)), and of its requests at the engine, max(1, floor(eval_share x concurrency x
    # rollout.n_samples_per_prompt)) eval episodes at once (workers/eval_jobs.py); eval jobs are queued
    # first, so training keeps the rest while a round runs. 1.0: a round may take the whole worker
    eval_share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5

    def __post_init__(self) -> None:
        if self.dead_after_s <= 2 * self.heartbeat_s:
            raise ValueError(f"workers.dead_after_s ({self.dead_after_s}) must exceed two heartbeats "
                             f"(2 x workers.heartbeat_s = {2 * self.heartbeat_s}): live workers would be reaped")


class CallBudget(_Section, frozen=True):
    """Timeout and retry budget of one kind of environment call."""

    timeout_s: PosFloat = 30.0
    retries: NonNegInt = 3
    backoff_s: NonNegFloat = 0.5


class EnvTimeouts(_Section, frozen=True):
    start: CallBudget = CallBudget()
    step: CallBudget = CallBudget()
    verify: CallBudget = CallBudget(timeout_s=60.0)
    verify_deadline_s: PosFloat = 300.0  # aggregate deadline for one episode's verification


class EnvConfig(_Section, frozen=True):
    """One environment, as in OpenReward's train_config.yaml (plus our kinds)."""

    kind: str  # registered kind ("math", "code", "nemo_gym", "openreward", ...) or a dotted path
    weight: float = 1.0  # mixing weight for producers
    max_turns: Union[PosInt, None] = None  # None = rollout.max_turns
    nonterminal_reward: Union[float, None] = None  # reward when the episode never reached a terminal state
    reward_reduction: Literal["sum", "mean", "max", "min"] = "sum"
    min_reward: Union[float, None] = None
    max_reward: Union[float, None] = None
    splits: list[str] = []
    num_samples: Union[NonNegInt, None] = None
    secrets: list[str] = []  # names of env vars; values are read at start and never logged or stored
    # zero: failed episodes get reward 0 (and no loss), the group goes on; retry_all_failed:
    # the same, but a group whose every episode failed (an outage) is retried, not pushed;
    # drop_group: any failed episode fails the group (retried, then handed back)
    on_failure: Literal["zero", "retry_all_failed", "drop_group"] = "zero"
    # an answer whose own size exhausts the verifier's budget (math-verify's timeout or recursion
    # limit; math and nemo_skills): zero scores it 0 with its reason, counted as undecided;
    # remove fails the episode (no loss), which rewards a pathological answer with nothing worse
    on_undecided: Literal["zero", "remove"] = "zero"
    timeouts: EnvTimeouts = EnvTimeouts()
    options: dict[str, Any] = {}  # kind-specific settings, validated by the kind
    dataset: dict[str, Any] = {}  # where `rollout prepare` reads this env's tasks (producers/sources.py)

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ValueError(f"min_reward {self.min_reward} > max_reward {self.max_reward}")


class PipelineConfig(_Section, frozen=True):
    redis: RedisSection = RedisSection()
    engine: EngineSection = EngineSection()
    rollout: RolloutSection = RolloutSection()
    workers: WorkersSection = WorkersSection()
    environments: dict[str, EnvConfig] = {}

    def __post_init__(self) -> None:
        seed = self.rollout.sampling.sampling_seed
        errors = seed_errors(seed, n_samples=self.rollout.n_samples_per_prompt,
                             deterministic=self.engine.deterministic_inference)
        if errors:  # one line saying why; msgspec adds no path at the top level
            raise ValueError(errors[0])

    def env(self, name: str) -> EnvConfig:
        try:
            return self.environments[name]
        except KeyError:
            known = ", ".join(sorted(self.environments)) or "none"
            raise ConfigError(f"environment {name!r} is not configured (configured: {known})") from None


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> PipelineConfig:
    """Load and validate a pipeline YAML; `None` gives the embedded defaults.

    Precedence, the same for every command: `overrides` (command-line flags) > environment
    (`$ROLLOUT_REDIS_URL` -> redis.url, `$ROLLOUT_NAMESPACE` -> redis.namespace) > the file >
    the defaults. `environ=None` reads `os.environ`; pass `{}` to ignore the environment.
    """
    data: dict[str, Any] = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config {where}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config {where}: top level must be a mapping, got {type(data).__name__}")
    for dotted, value in env_overrides(environ).items():
        _check_named(dotted, value, f"${ENV_KEYS[dotted]}")
        _set_dotted(data, dotted, int(value) if dotted == "redis.min_replica_acks" else value)
    for dotted, value in (overrides or {}).items():
        _check_named(dotted, value, _FLAGS.get(dotted, dotted))
        _set_dotted(data, dotted, value)
    return parse_config(data, where)


_FLAGS = {"redis.url": "--redis-url", "redis.namespace": "--namespace"}


def _check_named(dotted: str, value: Any, source: str) -> None:
    """A Redis URL or namespace from a flag or env var: the error names where it came from."""
    try:
        if dotted == "redis.url" and value:
            check_redis_url(str(value), f"{dotted} from {source}")
        elif dotted == "redis.namespace":
            check_namespace(str(value), f"{dotted} from {source}")
        elif dotted == "redis.min_replica_acks" and (not str(value).isdigit()):
            raise ValueError(f"{dotted} from {source}: {value!r} is not an integer >= 0")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# pipeline YAML key <- environment variable (flag > env var > file > default)
ENV_KEYS: dict[str, str] = {"redis.url": ENV_REDIS_URL, "redis.namespace": ENV_NAMESPACE,
                            "redis.min_replica_acks": ENV_MIN_REPLICA_ACKS}


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{dotted key: value} of the ROLLOUT_* variables that name the pipeline and are set (non-empty)."""
    env = os.environ if environ is None else environ
    return {dotted: env[var] for dotted, var in ENV_KEYS.items() if env.get(var)}


def parse_config(data: dict[str, Any], where: str = "<dict>") -> PipelineConfig:
    envs = data.get("environments")
    if isinstance(envs, dict):  # validate one by one so the error names the environment
        for name, env in envs.items():
            try:
                msgspec.convert(env, EnvConfig)
            except msgspec.ValidationError as exc:
                raise ConfigError(f"config {where}: environments.{name}: {exc}") from exc
    try:
        return msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config {where}: {exc}") from exc


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):  # absent or null ("redis:" with nothing under it)
            child = node[part] = {}
        node = child
    node[leaf] = value


# ------------------------------------------------------------------ slime side

# TrainerSettings field -> (slime args attribute, env var fallback)
_TRAINER_SOURCES = {
    "redis_url": ("pipeline_redis_url", "ROLLOUT_REDIS_URL"),
    "namespace": ("pipeline_namespace", "ROLLOUT_NAMESPACE"),
    "consumer": ("pipeline_consumer", "ROLLOUT_CONSUMER"),
    "rollout_batch_size": ("rollout_batch_size", "ROLLOUT_BATCH_SIZE"),
    "n_samples_per_prompt": ("n_samples_per_prompt", "ROLLOUT_N_SAMPLES"),
    "eta": ("pipeline_eta", "ROLLOUT_ETA"),
    "stale_policy": ("pipeline_stale_policy", "ROLLOUT_STALE_POLICY"),
    "consume_order": ("pipeline_consume_order", "ROLLOUT_CONSUME_ORDER"),
    "due_wait_s": ("pipeline_due_wait_s", "ROLLOUT_DUE_WAIT_S"),
    "filter_zero_variance": ("pipeline_filter_zero_variance", "ROLLOUT_FILTER_ZERO_VARIANCE"),
    "wait_log_s": ("pipeline_wait_log_s", "ROLLOUT_WAIT_LOG_S"),
    "wait_timeout_s": ("pipeline_wait_timeout_s", "ROLLOUT_WAIT_TIMEOUT_S"),
    "publish_engine": ("pipeline_publish_engine", "ROLLOUT_PUBLISH_ENGINE"),
    "trainer_loop": ("pipeline_trainer_loop", "ROLLOUT_TRAINER_LOOP"),
    "ledger_dir": ("pipeline_ledger_dir", "ROLLOUT_LEDGER_DIR"),
    "eval_datasets": ("pipeline_eval_datasets", "ROLLOUT_EVAL_DATASETS"),
    "eval_timeout_s": ("pipeline_eval_timeout_s", "ROLLOUT_EVAL_TIMEOUT_S"),
    "eval_mode": ("pipeline_eval_mode", "ROLLOUT_EVAL_MODE"),
    "eval_max_rounds": ("pipeline_eval_max_rounds", "ROLLOUT_EVAL_MAX_ROUNDS"),
}


class EvalMode(str, enum.Enum):
    """What slime's `evaluation=True` call does with `pipeline_eval_datasets` (docs/architecture.md)."""

    BLOCKING = "blocking"  # run the round and return its results: the step waits for it
    BACKGROUND = "background"  # start the round, return at once with earlier rounds' results


class TrainerSettings(_Section, frozen=True):
    """Settings of the slime data source / rollout function.

    Read from slime's `args` (set them in `--custom-config-path x.yaml`, keys
    prefixed `pipeline_`), falling back to `ROLLOUT_*` environment variables.
    """

    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = DEFAULT_NAMESPACE
    consumer: str = "trainer"  # stable name: a restarted trainer finds its pending entries
    rollout_batch_size: PosInt = 1
    n_samples_per_prompt: PosInt = 1
    eta: NonNegInt = 2
    stale_policy: StalePolicy = StalePolicy.REQUEUE  # for a group past eta all the same (arrival order, resumes)
    consume_order: ConsumeOrder = ConsumeOrder.DUE_FIRST
    # how long a step waits for one due group still generating before it stops reserving its
    # place (it is then trained when it arrives if still within eta, else `stale_policy`)
    due_wait_s: NonNegFloat = 600.0
    filter_zero_variance: bool = False
    wait_log_s: PosFloat = 30.0  # log while blocked waiting for groups
    wait_timeout_s: NonNegFloat = 0.0  # 0 = wait forever
    publish_engine: bool = True  # publish slime's router URL as `{ns}:engine`
    # which loop calls the rollout function: train_async.py (engines one push behind the batch
    # being generated) or train.py / a loop that pushes weights before each generate
    trainer_loop: TrainerLoop = TrainerLoop.ASYNC

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url, "pipeline_redis_url / $ROLLOUT_REDIS_URL")
        check_namespace(self.namespace, "pipeline_namespace / $ROLLOUT_NAMESPACE")
    # directory of the ledger of trained groups (one Parquet file per step, pipeline/ops/ledger.py); "" = off
    ledger_dir: str = ""
    # evaluation through the workers (pipeline/eval/evaluation.py): a YAML/JSONL list of eval datasets;
    # "" = slime's own eval_rollout. How long one eval round may take before it is an error.
    eval_datasets: str = ""
    eval_timeout_s: PosFloat = 3600.0
    # blocking: slime's eval call returns the round's results (training waits, as with slime's own
    # eval); background: it starts the round and returns what earlier rounds finished
    # (pipeline/eval/background.py). Rounds in flight at most (background): a round due when this
    # many are in flight is skipped, and counted; above 1, the later ones queue behind the first.
    eval_mode: EvalMode = EvalMode.BLOCKING
    eval_max_rounds: PosInt = 1

    @classmethod
    def from_args(cls, args: Any) -> TrainerSettings:
        values: dict[str, Any] = {}
        for name, (attr, env) in _TRAINER_SOURCES.items():
            value = getattr(args, attr, None)
            if value is None and env in os.environ:
                value = os.environ[env]
            if value is not None:
                values[name] = value
        try:
            # strict=False: env vars are strings ("2", "true") and must coerce.
            return msgspec.convert(values, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"slime-side pipeline settings: {exc} (args attribute or ROLLOUT_* env var)") from exc
