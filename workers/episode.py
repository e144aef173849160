"""One episode, token in / token out: the engine's output ids are kept verbatim, never re-tokenised.

    prompt ids (chat template, tools)  ->  per turn:
      /generate(full sequence)  ->  append output ids verbatim (mask 1, engine log-probs)
      parse tool calls from that turn's text
      env.step(calls)           ->  append the template's continuation tokens (mask 0, log-prob 0.0)
    stop: no tool call | env done | max_turns | response budget | context length

A turn-taking session (NeMo-RL games: `plugins.NemoRLSession`) defines `step_text(message)`:
it answers every turn, tool call or not, and only `done`, `max_turns` or a budget end the
episode; its `next_stop_strings` (when set) are the next turn's SGLang `stop`, and with
`raw_observations` its observations are appended as their content's own tokens (no template).
    verify -> reward (nonterminal reward, clamp) -> Sample

An engine `abort` (pause for a weight update) resumes the same turn from the tokens
produced so far with the remaining budget; every generate call's weight version is
recorded, so a resumed episode carries both versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.config import EnvConfig, PipelineConfig
from pipeline.schema import MEASUREMENT_FAILED, Sample, SamplingParams, Status, Task
from workers.chat import ChatTokens
from workers.engine import ContextOverflow, EngineClient, EngineError, Generation
from workers.envs.base import Environment, EnvSession, EpisodeRecord, MeasurementFailed, Message, ToolCall
from workers.envs.rewards import final_reward
from workers.errors import is_bug
from workers.tools import ParsedTurn, ToolParser, get_parser, run_parser

log = logging.getLogger(__name__)

# metadata["messages"] of a plain single-turn episode: the task's prompt, then the response (stripped)
PLAIN_CONVERSATION = "prompt+response"


@dataclass(frozen=True)
class EpisodeSettings:
    sampling: SamplingParams  # per-call cap in max_new_tokens, if set
    max_turns: int
    max_response_tokens: int  # budget over all turns
    max_context_tokens: int
    tool_parser: ToolParser
    max_abort_resumes: int = 50  # an engine that aborts forever ends the episode as aborted

    @classmethod
    def from_config(cls, config: PipelineConfig, env: EnvConfig, job_sampling: SamplingParams) -> EpisodeSettings:
        merged = {**config.rollout.sampling.to_dict(), **job_sampling.to_dict()}
        return cls(
            sampling=SamplingParams(**merged),
            max_turns=env.max_turns or config.rollout.max_turns,
            max_response_tokens=config.rollout.max_response_tokens,
            max_context_tokens=config.engine.max_context_tokens,
            tool_parser=get_parser(str(env.options.get("tool_parser", "hermes"))),
        )


@dataclass
class _Trace:
    """The growing episode: tokens, mask, log-probs and what each turn did."""

    tokens: list[int]
    prompt_length: int
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    finished: bool = False
    malformed_calls: int = 0
    policy_versions: list[int] = field(default_factory=list)
    policy_run: int = 0
    token_versions: list[int] = field(default_factory=list)  # per response token (-1: no policy made it)

    def stamp(self, stamps: list[tuple[int, int]]) -> None:
        """Record each call's (run, version); the run is the first call's (a trainer restart
        mid-episode leaves later calls on a newer run, whose versions are not older)."""
        for run, version in stamps:
            self.policy_run = self.policy_run or run
            self.policy_versions.append(version)

    def add_model(self, ids: list[int], log_probs: list[float], versions: list[int]) -> None:
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.log_probs += log_probs
        self.token_versions += versions

    def add_template(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.token_versions += [-1] * len(ids)

    def version_runs(self) -> list[tuple[int, int]]:
        """`Sample.token_version_runs`: [] when no token has a version (no policy clock)."""
        if all(v < 0 for v in self.token_versions):
            return []
        runs: list[tuple[int, int]] = []
        for v in self.token_versions:
            if runs and runs[-1][0] == v:
                runs[-1] = (v, runs[-1][1] + 1)
            else:
                runs.append((v, 1))
        return runs

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length


@dataclass
class _Turn:
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish: str = "stop"
    aborts: int = 0
    versions: list[str] = field(default_factory=list)
    policy: list[tuple[int, int]] = field(default_factory=list)  # (run, version) per generate call that answered
    token_versions: list[int] = field(default_factory=list)  # policy version per token of `ids` (-1: unknown)


class EpisodeRunner:
    """Runs episodes of one environment with one engine client and tokenizer."""

    def __init__(self, engine: EngineClient, chat: ChatTokens, env: Environment, settings: EpisodeSettings, run: str = "",
                 due_order: int | None = None):
        self.engine = engine
        self.chat = chat
        self.env = env
        self.settings = settings
        self.run_name = run  # the pipeline run (Redis namespace), for EnvSession.episode_done
        # the group's place in the due order (its admission clock): its requests go first in the
        # engine's queue the sooner the group is due (SGLang priority, workers/engine.py); None: none
        self.due_order = due_order

    async def run(self, task: Task, episode_id: str, sample_index: int = 0) -> Sample:
        """One episode; `sample_index` (its place in the group) varies a configured sampling seed."""
        started = time.monotonic()
        try:
            session = await self.env.start(task)
        except Exception as exc:  # noqa: BLE001 - any env failure ends this episode, not the group
            if is_bug(exc):
                raise  # a bug fails the job once, loudly (workers/jobs.py), not every episode quietly
            log.warning("episode %s: env %s start failed: %s", episode_id, self.env.name, exc)
            # The task's own prompt: slime builds log-prob targets from every sample's tokens,
            # and an empty one crashes its training step even with the loss masked out.
            prompt_ids = self.chat.prompt_ids(_task_messages(task), None)
            trace = _Trace(tokens=list(prompt_ids), prompt_length=len(prompt_ids))
            return self._sample(task, trace, Status.FAILED, 0.0, {}, started, error=f"env start: {exc}")
        try:
            sample = await self._run_session(task, session, episode_id, started, sample_index)
            _tell_done(session, sample, episode_id, self.run_name)
            return sample
        finally:
            await asyncio.shield(_close_quietly(session, episode_id))

    async def _run_session(
        self, task: Task, session: EnvSession, episode_id: str, started: float, sample_index: int
    ) -> Sample:
        prompt_ids = self.chat.prompt_ids(session.messages, session.tools)
        trace = _Trace(tokens=list(prompt_ids), prompt_length=len(prompt_ids), messages=list(session.messages))
        sampling = _per_sample(self.settings.sampling, sample_index)
        try:
            status = await self._loop(session, trace, episode_id, sampling)
        except EngineError as exc:
            log.warning("episode %s failed: %s", episode_id, exc)
            return self._sample(task, trace, Status.FAILED, 0.0, {}, started, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - env step errors fail one episode; bugs fail the job
            if is_bug(exc):
                raise
            log.warning("episode %s failed in env step: %r", episode_id, exc, exc_info=True)
            return self._sample(task, trace, Status.FAILED, 0.0, {}, started, error=f"env step: {exc!r}")
        record = EpisodeRecord(
            task=task,
            messages=trace.messages,
            response_text=" ".join(t["text"] for t in trace.turns),
            step_rewards=trace.step_rewards,
            finished=trace.finished,
            status=status,
            turns=len(trace.turns),
        )
        try:
            verification = await session.verify(record)
        except Exception as exc:  # noqa: BLE001 - a verifier outage fails the episode; bugs fail the job
            if is_bug(exc):
                raise
            log.warning("episode %s: verify failed: %r", episode_id, exc)
            measured = {MEASUREMENT_FAILED: True} if isinstance(exc, MeasurementFailed) else {}  # counted apart
            return self._sample(task, trace, Status.FAILED, 0.0, measured, started, error=f"verify: {exc!r}")
        reward = final_reward(self.env.config, verification, finished=trace.finished)
        return self._sample(task, trace, status, reward, verification.components, started)

    async def _loop(self, session: EnvSession, trace: _Trace, episode_id: str, sampling: SamplingParams) -> Status:
        """Turns until a stop condition; returns completed or truncated."""
        s = self.settings
        engine_context = await self.engine.context_length()
        context = min(s.max_context_tokens, engine_context or s.max_context_tokens)
        while True:
            # SGLang refuses input + max_new_tokens over its context: size the turn to fit
            room = min(s.max_response_tokens - trace.response_length, context - len(trace.tokens))
            if s.sampling.max_new_tokens is not None:
                room_this_turn = min(room, s.sampling.max_new_tokens)
            else:
                room_this_turn = room
            if room_this_turn <= 0:
                return Status.TRUNCATED
            turn_index = len(trace.turns)
            gen_started = time.monotonic()
            stops = getattr(session, "next_stop_strings", None)  # a turn-taking env bounds the next turn
            turn_sampling = sampling if stops is None else msgspec.structs.replace(sampling, stop=list(stops))
            try:
                turn = await self._generate(
                    trace.tokens, room_this_turn, turn_sampling, rid=f"{episode_id}:t{turn_index}", routing_key=episode_id
                )
            except ContextOverflow as exc:
                trace.turns.append({"text": "", "finish": "context_overflow", "error": str(exc)})
                return Status.TRUNCATED
            trace.add_model(turn.ids, turn.log_probs, turn.token_versions)
            trace.weight_versions += turn.versions
            trace.stamp(turn.policy)
            text = self.chat.decode(turn.ids)
            parsed = run_parser(s.tool_parser, self.chat.decode_for_tools(turn.ids), session.tools)
            meta = _turn_meta(turn, text, parsed, time.monotonic() - gen_started)
            trace.turns.append(meta)
            trace.messages.append(_assistant_message(parsed))
            if turn.finish == "abort":
                return Status.ABORTED
            if turn.finish == "length":
                return Status.TRUNCATED
            step_text = getattr(session, "step_text", None)  # an env that answers every turn (NeMo-RL games)
            if not parsed.wants_tools and step_text is None:
                return Status.COMPLETED
            if len(trace.turns) >= s.max_turns and step_text is None:
                return Status.TRUNCATED
            env_started = time.monotonic()
            if step_text is not None:
                observations, done = await self._observe_text(step_text, trace, text)
            else:
                observations, done = await self._observe(session, trace, parsed)
            meta["env_s"] = round(time.monotonic() - env_started, 6)
            trace.messages += observations
            if done:
                trace.finished = True
                return Status.COMPLETED
            if step_text is not None and len(trace.turns) >= s.max_turns:
                return Status.TRUNCATED
            ended_with_eos = bool(turn.ids) and turn.ids[-1] == self.chat.eos_id
            if getattr(session, "raw_observations", False):  # NeMo-RL: the content's own tokens, no template
                continuation = [i for m in observations for i in self.chat.encode(str(m.get("content") or ""))]
            else:
                continuation = self.chat.continuation_ids(observations, model_ended_with_eos=ended_with_eos)
            if len(trace.tokens) + len(continuation) >= context:
                return Status.TRUNCATED
            trace.add_template(continuation)

    async def _generate(
        self, tokens: list[int], max_new: int, base: SamplingParams, *, rid: str, routing_key: str
    ) -> _Turn:
        """One model turn; an abort resumes from the tokens so far with the remaining budget."""
        turn = _Turn()
        while True:
            left = max_new - len(turn.ids)
            min_new = base.min_new_tokens
            sampling = msgspec.structs.replace(
                base, max_new_tokens=left, min_new_tokens=None if min_new is None else min(min_new, left)
            )
            gen = await self.engine.generate(
                tokens + turn.ids, sampling, rid=f"{rid}.{turn.aborts}", routing_key=routing_key,
                due_order=self.due_order,
            )
            turn.ids += gen.output_ids
            turn.log_probs += gen.log_probs
            turn.versions += gen.weight_versions
            turn.token_versions += _token_versions(gen)
            if gen.policy is not None:
                turn.policy.append((gen.policy.run, gen.policy.version_of(gen.weight_versions)))
            turn.finish = gen.finish
            if gen.finish != "abort":
                return turn
            if len(turn.ids) >= max_new:
                turn.finish = "length"
                return turn
            if turn.aborts >= self.settings.max_abort_resumes:
                return turn
            turn.aborts += 1
            await asyncio.sleep(min(1.0, 0.02 * turn.aborts))  # the engine is paused for a weight update

    async def _observe(self, session: EnvSession, trace: _Trace, parsed: ParsedTurn) -> tuple[list[Message], bool]:
        """Run valid calls through the env; malformed ones become error observations."""
        observations: list[Message] = []
        done = False
        if parsed.calls:
            result = await session.step(parsed.calls)
            observations += result.messages
            done = result.done
            if result.reward is not None:
                trace.step_rewards.append(float(result.reward))
        if parsed.errors:
            trace.malformed_calls += len(parsed.errors)
            observations += [{"role": "tool", "content": f"error: {e}", "name": "error"} for e in parsed.errors]
        return observations, done

    async def _observe_text(self, step_text: Any, trace: _Trace, text: str) -> tuple[list[Message], bool]:
        """A turn-taking environment's answer to the model's whole turn (`session.step_text`)."""
        result = await step_text({"role": "assistant", "content": text})
        if result.reward is not None:
            trace.step_rewards.append(float(result.reward))
        return list(result.messages), result.done

    def _sample(
        self,
        task: Task,
        trace: _Trace,
        status: Status,
        reward: float,
        components: dict[str, Any],
        started: float,
        error: str = "",
    ) -> Sample:
        if trace.response_length == 0:
            # Nothing was generated (env start failed, engine down, prompt over the context):
            # no answer to train on. One masked EOS keeps the sample well-formed for slime,
            # whose log-prob targets and response slices assume a response token.
            status = Status.FAILED
            error = error or "no response token (the prompt does not fit the context)"
            trace.add_template([self.chat.eos_id if self.chat.eos_id is not None else 0])
        response_ids = trace.tokens[trace.prompt_length :]
        metadata: dict[str, Any] = {
            "env": self.env.name,
            "turns": len(trace.turns),
            "turn_log": [{k: v for k, v in t.items() if k != "text"} for t in trace.turns],
            "tool_calls": sum(len(t.get("tool_calls", ())) for t in trace.turns),
            "malformed_tool_calls": trace.malformed_calls,
            "step_rewards": trace.step_rewards,
            "finished": trace.finished,
            "episode_s": round(time.monotonic() - started, 6),
        }
        response = self.chat.decode(response_ids)
        # The conversation verify saw (prompt, assistant turns with tool calls, observations): what
        # `rollout ledger rescore` verifies again and `rollout show` renders. When it is just the
        # task's prompt and the response (a plain single-turn episode), a marker says so instead
        # of repeating both on the wire (pipeline/ops/ledger.py rebuilds it).
        plain = _task_messages(task) + [{"role": "assistant", "content": response.strip()}]
        metadata["messages"] = PLAIN_CONVERSATION if trace.messages == plain else trace.messages
        response_text = " ".join(t.get("text", "") for t in trace.turns)
        if response_text != response:  # multi-turn: verify's response_text is the model's turns alone
            metadata["response_text"] = response_text
        if error:
            metadata["error"] = error[:2000]
        return Sample.build(
            tokens=trace.tokens,
            response_length=trace.response_length,
            loss_mask=trace.mask,
            rollout_log_probs=trace.log_probs,
            reward=reward,
            status=status,
            reward_components=components,
            weight_versions=trace.weight_versions,
            policy_versions=trace.policy_versions,
            policy_run=trace.policy_run,
            token_version_runs=trace.version_runs(),
            prompt=task.prompt,
            response=response,
            label=task.label,
            metadata=metadata,
        )


def _token_versions(gen: Generation) -> list[int]:
    """The policy version of each output token of one call: its span's label read through the
    call's stamp (`PolicyStamp.version_of`), the call's own version without spans, -1 throughout
    without a stamp. The engine client has checked that the spans tile the output tokens
    (`check_version_spans`): one version per token, never more or fewer."""
    if gen.policy is None:
        return [-1] * len(gen.output_ids)
    if not gen.version_spans:
        return [gen.policy.version_of(gen.weight_versions)] * len(gen.output_ids)
    return [version for label, start, end in gen.version_spans for version in [gen.policy.version_of([label])] * (end - start)]


def _turn_meta(turn: _Turn, text: str, parsed: ParsedTurn, gen_s: float) -> dict[str, Any]:
    return {
        "text": text,
        "tokens": len(turn.ids),
        "finish": turn.finish,
        "aborts": turn.aborts,
        "weight_versions": turn.versions,
        "tool_calls": [c.name for c in parsed.calls],
        "malformed": len(parsed.errors),
        "gen_s": round(gen_s, 6),
    }


def _assistant_message(parsed: ParsedTurn) -> Message:
    message: Message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [_openai_call(c) for c in parsed.calls]
    return message


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _task_messages(task: Task) -> list[Message]:
    """The task's prompt as chat messages (what an environment starts from by default)."""
    if isinstance(task.prompt, str):
        return [{"role": "user", "content": task.prompt}]
    return list(task.prompt)


def _per_sample(sampling: SamplingParams, sample_index: int) -> SamplingParams:
    """A configured `sampling_seed` plus the sample's index, as slime does: one seed for every
    episode of a group would make them identical under deterministic inference."""
    if sampling.sampling_seed is None:
        return sampling
    return msgspec.structs.replace(sampling, sampling_seed=sampling.sampling_seed + sample_index)


def _tell_done(session: EnvSession, sample: Sample, episode_id: str, run: str) -> None:
    try:
        session.episode_done(sample, episode_id, run)
    except Exception as exc:  # noqa: BLE001 - watching an episode never changes or fails it
        log.warning("episode %s: episode_done of env session failed: %r", episode_id, exc)


async def _close_quietly(session: EnvSession, episode_id: str) -> None:
    try:
        await session.close()
    except Exception as exc:  # noqa: BLE001 - close must never mask the episode's result
        log.warning("episode %s: session close failed: %r", episode_id, exc)
