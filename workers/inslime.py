"""slime in-process mode: the pipeline's episode runner and environments inside slime's own
rollout (`train.py` / `train_async.py` with slime's stock `generate_rollout`); no Redis, no
producers, no worker pool: the workers' episode code runs in slime's rollout process.

    --custom-generate-function-path workers.inslime.generate
    --custom-rm-path workers.inslime.reward
    --custom-config-path pipeline.yaml

`generate(args, sample, sampling_params)` is slime's custom generate contract
(`slime/rollout/sglang_rollout.py: generate_and_rm`): it runs one multi-turn, token-in/token-out
episode (`workers.episode.EpisodeRunner`) against slime's router with the sample's environment,
and fills the slime `Sample` back: `tokens` (prompt + response), `response_length`, `loss_mask`
(1 = model tokens, 0 = tool output and template tokens), `rollout_log_probs` (the engine's, 0.0
where masked), `response`, `status`, `weight_versions` (the engine's label of every generate
call), `reward` (the environment's verification) and `metadata` (turns, tool calls, the
conversation, reward components). A failed episode (engine or environment past its budget) is
`Status.FAILED` with `remove_sample=True` and reward 0, as the pipeline's data source hands it
over. `reward(args, sample | samples)` is slime's custom reward contract (batched when slime
passes a list: `--group-rm`, or a generate function returning several samples): the stored
reward of a sample `generate` verified, else the environment's verification of its text (slime's
own generate, e.g. evaluation prompts).

Where things come from:
- **config**: the pipeline YAML at `args.pipeline_config` (a key of slime's custom config),
  else `$ROLLOUT_CONFIG`, else `args.custom_config_path` itself (only its pipeline sections,
  `redis engine rollout workers environments`, are read; other top-level keys are slime's);
- **engine**: slime's router, `http://{args.sglang_router_ip}:{args.sglang_router_port}`
  (`engine.url` is not used); `engine.request_timeout_s`, `max_retries`, `retry_backoff_s` apply;
- **tokenizer**: `args.hf_checkpoint` (as slime loads it), else `engine.tokenizer`;
- **environment** of a sample: `sample.metadata["env"]` (the prompt data's metadata column,
  `--metadata-key`, or an eval dataset's `metadata_overrides`), else `args.pipeline_env`, else
  the only environment of the config. The task is built from the sample: prompt (text or chat
  messages; slime's `--apply-chat-template` must be off: the runner renders the environment's
  messages and tools with the chat template itself), label, metadata (the task's metadata, e.g.
  a NeMo Gym row or code tests), id `metadata["task_id"]`/`["id"]`, else `slime/<index>`;
- **sampling**: slime's sampling params (its `--rollout-*` flags, an eval dataset's own) over
  `rollout.sampling` of the YAML. slime's `max_new_tokens` is the episode's response budget over
  all turns; the YAML's `rollout.sampling.max_new_tokens`, when set, caps each turn. `None`
  values are dropped; keys SGLang accepts that the pipeline's `SamplingParams` does not carry are
  dropped with a warning (once per key); `custom_params.return_top_p_token_ids` (slime asks for it
  when `--rollout-top-p` < 1) is refused: episodes do not replay top-p ids.

Concurrency, routing, abort: slime's `generate_and_rm` holds its semaphore
(`--sglang-server-concurrency` x engines) around the whole episode, so an episode of several
turns takes one slot. Every turn of an episode carries one routing key (`X-SMG-Routing-Key`, from
slime's `session_id`). When slime aborts (the batch is full: `abort_servers_until_idle`), an
aborted request ends its episode `ABORTED` at once (no resume, as slime's own generate): slime
pushes weights between rollouts, so the only aborts mid-episode are slime's own; and once
slime's `GenerateState.aborted` is set, no further turn is sent (an episode between turns ends
`ABORTED` too). An aborted sample that slime hands back (`--partial-rollout`) is run again from
its prompt.

Policy versions: there is no data source here, so the engine client stamps nothing
(`EngineClient(clock=None)`); slime records its own weight versions from the engines' labels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import yaml

from pipeline.config import ConfigError, PipelineConfig, load_config, parse_config
from pipeline.schema import SamplingParams, SchemaError, Status, Task
from workers.chat import ChatTokens
from workers.engine import EngineClient, Generation
from workers.envs.base import EpisodeRecord
from workers.envs.registry import UnknownEnvironmentKind, build_environment
from workers.envs.rewards import final_reward
from workers.episode import EpisodeRunner, EpisodeSettings
from workers.errors import is_bug
from workers.rescore import stored_record
from workers.tools import get_parser

log = logging.getLogger(__name__)

ENV_CONFIG = "ROLLOUT_CONFIG"
# metadata key: the sample's reward is the verification `generate` ran (reward() returns it)
SCORED_KEY = "pipeline_scored"
# the pipeline's sections: redis engine rollout workers environments
_SECTIONS = frozenset(f.name for f in msgspec.structs.fields(PipelineConfig))
_OUR_FIELDS = frozenset(f.name for f in msgspec.structs.fields(SamplingParams))
# SGLang's SamplingParams fields (sglang/srt/sampling/sampling_params.py) that the pipeline's
# SamplingParams does not carry: accepted by SGLang, dropped here with a warning
_SGLANG_ONLY = frozenset(
    "stop_regex beam_width structural_tag stream_interval logit_bias custom_params watermark".split()
)
# what the runner adds to a sample's metadata: stripped when a sample is run again
_RUNNER_KEYS = frozenset(
    "turns turn_log tool_calls malformed_tool_calls step_rewards finished episode_s messages response_text error "
    f"reward_components source_name {SCORED_KEY}".split()
)
_warned: set[str] = set()


# ------------------------------------------------------------------ configuration

def config_path(args: Any) -> str:
    """The pipeline YAML: `args.pipeline_config` > `$ROLLOUT_CONFIG` > `args.custom_config_path`."""
    path = (getattr(args, "pipeline_config", None) or os.environ.get(ENV_CONFIG)
            or getattr(args, "custom_config_path", None))
    if not path:
        raise ConfigError(
            "workers.inslime.generate/reward need the pipeline YAML: pass it to slime as --custom-config-path "
            f"pipeline.yaml, or set pipeline_config: <path> in slime's custom config, or ${ENV_CONFIG}"
        )
    return str(path)


def load_inprocess_config(args: Any) -> PipelineConfig:
    path = config_path(args)
    if getattr(args, "pipeline_config", None) or os.environ.get(ENV_CONFIG):
        return load_config(path)
    # slime's custom config: its top-level keys are set on `args`; the pipeline's sections are ours
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(data).__name__}")
    return parse_config({k: v for k, v in data.items() if k in _SECTIONS}, path)


def translate_sampling(
    params: Mapping[str, Any], base: SamplingParams | None = None
) -> tuple[SamplingParams, int | None]:
    """slime's sampling params -> (the pipeline's SamplingParams, slime's max_new_tokens).

    None values are dropped (slime sends `stop=None`, `stop_token_ids=None`); `base` (the YAML's
    `rollout.sampling`) is under slime's values; its `max_new_tokens` stays the per-turn cap while
    slime's becomes the episode's response budget (returned apart)."""
    values = {k: v for k, v in params.items() if v is not None}
    custom = values.get("custom_params")
    if isinstance(custom, Mapping) and custom.get("return_top_p_token_ids"):
        raise ConfigError(
            "slime asks for top-p token ids (--rollout-top-p below 1.0), which it needs to train top-p "
            "sampling: workers.inslime.generate does not return them; keep --rollout-top-p 1.0"
        )
    for key in sorted(set(values) - _OUR_FIELDS):
        values.pop(key)
        if key not in _warned:
            _warned.add(key)
            why = "SGLang accepts it but the pipeline's SamplingParams does not carry it" if key in _SGLANG_ONLY \
                else "SGLang would refuse it"
            log.warning("workers.inslime.generate: sampling param %r dropped (%s)", key, why)
    budget = values.pop("max_new_tokens", None)
    merged = {**(base.to_dict() if base is not None else {}), **values}
    try:
        sampling = msgspec.convert(merged, SamplingParams)
    except (msgspec.ValidationError, SchemaError) as exc:
        raise ConfigError(f"slime's sampling params {dict(params)!r}: {exc}") from exc
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise ConfigError(f"slime's sampling param max_new_tokens must be an int, got {budget!r}")
    return sampling, budget


# ------------------------------------------------------------------ per-process state

@dataclass
class InProcess:
    """What one process shares between episodes of one event loop: config, environments, and
    (built on first use, so `reward` loads no tokenizer) the engine client and chat tokens."""

    config: PipelineConfig
    router_url: str
    tokenizer_path: str
    environments: dict[str, Any] = field(default_factory=dict)
    _engine: Any = None
    _chat: Any = None

    @property
    def engine(self) -> Any:
        if self._engine is None:
            if not self.router_url:
                raise ConfigError("workers.inslime.generate: slime's args have no sglang_router_ip/sglang_router_port")
            e = self.config.engine
            self._engine = SlimeEngineClient(
                self.router_url, timeout_s=e.request_timeout_s, max_retries=e.max_retries,
                backoff_s=e.retry_backoff_s, clock=None,  # no data source: slime records its own weight versions
            )
        return self._engine

    @property
    def chat(self) -> Any:
        if self._chat is None:
            self._chat = _chat_tokens(self.tokenizer_path)
        return self._chat

    def environment(self, name: str) -> Any:
        env = self.environments.get(name)
        if env is None:
            try:
                env = build_environment(name, self.config.env(name))
            except UnknownEnvironmentKind as exc:
                raise ConfigError(str(exc)) from exc
            self.environments[name] = env
        return env

    async def aclose(self) -> None:
        for env in self.environments.values():
            await env.aclose()
        if self._engine is not None:
            await self._engine.close()


def slime_aborted() -> bool:
    """slime's rollout has aborted (its batch is full: `sglang_rollout.abort`), read from its
    GenerateState singleton when one exists; slime is never imported here."""
    module = sys.modules.get("slime.rollout.sglang_rollout")
    cls = getattr(module, "GenerateState", None)
    state = (getattr(cls, "_instances", None) or {}).get(cls) if cls is not None else None
    return bool(getattr(state, "aborted", False))


class SlimeEngineClient(EngineClient):
    """The engine client, except that once slime has aborted its rollout no further turn is
    sent: the call answers `abort` with no tokens, so the episode ends ABORTED between turns
    instead of holding slime's abort (which waits for every pending episode) for a whole turn."""

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, rid: str, routing_key: str,
        due_order: int | None = None,
    ) -> Generation:
        if slime_aborted():
            return Generation(output_ids=[], log_probs=[], finish="abort",
                              finish_message="slime aborted the rollout", weight_version="", text="",
                              cached_tokens=0, latency_s=0.0)
        return await super().generate(input_ids, sampling, rid=rid, routing_key=routing_key, due_order=due_order)


_CHATS: dict[str, Any] = {}
_CONFIGS: dict[str, PipelineConfig] = {}
# per event loop (the engine's HTTP session and environments' pools belong to one), then per
# (config, router, tokenizer)
_STATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str, str], InProcess]] = (
    weakref.WeakKeyDictionary()
)


def _chat_tokens(path: str) -> Any:
    chat = _CHATS.get(path)
    if chat is None:
        if not path:
            raise ConfigError("workers.inslime.generate: no tokenizer (slime's --hf-checkpoint, or engine.tokenizer)")
        from transformers import AutoTokenizer

        # as slime loads the same checkpoint (slime.utils.processing_utils.load_tokenizer)
        chat = _CHATS[path] = ChatTokens(AutoTokenizer.from_pretrained(path, trust_remote_code=True))
    return chat


def state_for(args: Any) -> InProcess:
    """The cached state of this process and event loop for `args` (built synchronously: no
    await between lookup and insert, so concurrent first calls share one)."""
    path = config_path(args)
    config = _CONFIGS.get(path)
    if config is None:
        config = _CONFIGS[path] = load_inprocess_config(args)
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    router = f"http://{ip}:{port}" if ip and port else ""
    tokenizer = str(getattr(args, "hf_checkpoint", None) or config.engine.tokenizer or "")
    per_loop = _STATES.setdefault(asyncio.get_running_loop(), {})
    key = (path, router, tokenizer)
    state = per_loop.get(key)
    if state is None:
        state = per_loop[key] = InProcess(config=config, router_url=router, tokenizer_path=tokenizer)
        log.info("pipeline in-process mode: config %s, router %s, tokenizer %s, environments %s",
                 path, router or "-", tokenizer or "-", ", ".join(sorted(config.environments)) or "none")
    return state


# ------------------------------------------------------------------ sample <-> task

def env_name(args: Any, sample: Any, config: PipelineConfig) -> str:
    """`metadata["env"]` > `args.pipeline_env` > the config's only environment."""
    meta = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
    name = meta.get("env") or getattr(args, "pipeline_env", None)
    if not name:
        if len(config.environments) == 1:
            return next(iter(config.environments))
        known = ", ".join(sorted(config.environments)) or "none"
        raise ConfigError(
            f"slime sample {getattr(sample, 'index', None)} names no environment: set metadata['env'] in the prompt "
            f"data (or pipeline_env in slime's custom config); configured: {known}"
        )
    config.env(str(name))  # ConfigError naming the configured ones
    return str(name)


def task_of(sample: Any, env: str) -> Task:
    meta = dict(sample.metadata) if isinstance(getattr(sample, "metadata", None), dict) else {}
    task_meta = {k: v for k, v in meta.items() if k not in _RUNNER_KEYS}
    task_id = meta.get("task_id") or meta.get("id") or f"slime/{getattr(sample, 'index', None)}"
    label = sample.label
    if label is not None and not isinstance(label, str):  # a number or a structure in the prompt data
        label = json.dumps(label) if isinstance(label, (dict, list)) else str(label)
    prompt = sample.prompt
    if isinstance(prompt, list):
        prompt = [dict(m) for m in prompt]
    try:
        return Task(id=str(task_id), env=env, prompt=prompt, label=label, metadata=task_meta)
    except SchemaError as exc:
        raise ConfigError(f"slime sample {getattr(sample, 'index', None)}: {exc}") from exc


def _check_args(args: Any, sample: Any) -> None:
    if getattr(args, "apply_chat_template", False):
        raise ConfigError(
            "workers.inslime.generate renders the environment's messages (and tools) with the chat template "
            "itself: run slime without --apply-chat-template (the prompt stays text or chat messages)"
        )
    if getattr(args, "use_rollout_routing_replay", False):
        raise ConfigError("workers.inslime.generate does not return routed experts: drop --use-rollout-routing-replay")
    multimodal = getattr(sample, "multimodal_inputs", None) or {}
    if any(v is not None for v in multimodal.values()):
        raise ConfigError("workers.inslime.generate runs text episodes: multimodal samples are not supported")


# ------------------------------------------------------------------ generate

async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's custom generate function: one episode of the sample's environment (module doc)."""
    _check_args(args, sample)
    state = state_for(args)
    config = state.config
    name = env_name(args, sample, config)
    env = state.environment(name)
    task = task_of(sample, name)
    sampling, budget = translate_sampling(sampling_params, config.rollout.sampling)
    context = config.engine.max_context_tokens
    if getattr(args, "rollout_max_context_len", None):
        context = min(context, int(args.rollout_max_context_len))
    settings = EpisodeSettings(
        sampling=sampling,
        max_turns=env.config.max_turns or config.rollout.max_turns,
        max_response_tokens=budget if budget is not None else config.rollout.max_response_tokens,
        max_context_tokens=context,
        tool_parser=get_parser(str(env.config.options.get("tool_parser", "hermes"))),
        max_abort_resumes=0,  # an abort is slime's (the batch is full): end the episode, as slime's generate
    )
    if settings.max_response_tokens <= 0:
        sample.status = type(sample).Status.TRUNCATED
        return sample
    runner = EpisodeRunner(state.engine, state.chat, env, settings)
    # one routing key per episode (slime's session id); the rid gets a fresh suffix per run
    session = getattr(sample, "session_id", None) or uuid.uuid4().hex
    episode_id = f"slime-{session}-{uuid.uuid4().hex[:8]}"
    ours = await runner.run(task, episode_id, sample_index=0)  # a slime seed is already per sample
    return _fill(sample, ours, name)


def _fill(sample: Any, ours: Any, env: str) -> Any:
    sample.tokens = ours.token_array().tolist()
    sample.response_length = int(ours.response_length)
    sample.loss_mask = ours.loss_mask_array().tolist()
    sample.rollout_log_probs = ours.log_prob_array().tolist()
    sample.response = ours.response
    sample.weight_versions = list(ours.weight_versions)
    sample.status = type(sample).Status(ours.status.value)
    sample.reward = float(ours.reward)
    # a failed episode (outage) says nothing about the policy: slime zeroes a removed sample's loss
    sample.remove_sample = ours.status is Status.FAILED
    kept = {k: v for k, v in (sample.metadata or {}).items() if k not in _RUNNER_KEYS}
    sample.metadata = {
        **kept,
        **ours.metadata,
        "reward_components": ours.reward_components,
        "source_name": env,  # slime's per-source rollout metrics group by it
        SCORED_KEY: True,
    }
    return sample


# ------------------------------------------------------------------ reward

async def reward(args: Any, sample: Any, **_kwargs: Any) -> Any:
    """slime's custom reward function: a float per sample, a list for a list (module doc)."""
    if isinstance(sample, list):
        return list(await asyncio.gather(*(_reward_one(args, s) for s in sample)))
    return await _reward_one(args, sample)


async def _reward_one(args: Any, sample: Any) -> float:
    meta = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
    if meta.get(SCORED_KEY) and isinstance(sample.reward, (int, float)):
        return float(sample.reward)  # generate verified it (or it failed: 0)
    state = state_for(args)
    name = env_name(args, sample, state.config)
    env = state.environment(name)
    task = task_of(sample, name)
    record = _record(task, sample)
    try:
        session = await env.start(task)
        try:
            verification = await session.verify(record)
        finally:
            await asyncio.shield(session.close())
    except Exception as exc:  # noqa: BLE001 - an outage fails this sample; bugs are raised
        if is_bug(exc):
            raise
        log.warning("workers.inslime.reward: env %s could not verify sample %s: %r",
                    name, getattr(sample, "index", None), exc)
        sample.metadata = {**meta, "error": f"verify: {exc!r}"[:2000], "source_name": name}
        sample.status = type(sample).Status.FAILED
        sample.remove_sample = True
        return 0.0
    sample.metadata = {**meta, "reward_components": verification.components, "source_name": name}
    return final_reward(env.config, verification, finished=record.finished)


def _record(task: Task, sample: Any) -> EpisodeRecord:
    """What verify sees of a sample's text: the conversation the runner recorded, else the
    task's messages and the response as the one assistant turn."""
    meta = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
    value = getattr(sample.status, "value", str(sample.status))
    status = Status(value) if value in Status._value2member_map_ else Status.COMPLETED
    return stored_record(task, meta, sample.response or "", status)[0]
