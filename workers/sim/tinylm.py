"""A real policy for the simulated engine: a tiny causal LM (transformers' Qwen2 architecture,
~0.2M parameters, the shared test tokenizer's 673-token vocabulary) sampled as SGLang samples.

The simulator's scheduler still decides when and which requests step and how long a step
lasts (the aiconfigurator tables); this decides which tokens. A request's tokens are sampled at
its own `temperature` / `top_p` / `top_k` / `max_new_tokens` / `stop` / `stop_token_ids`, and
its log-probs are SGLang's default `output_token_logprobs`: log softmax(logits / temperature)
of the sampled token (sglang/srt/layers/sampler.py: `torch.log(probs)` after the temperature,
before top-p). Requests that arrive together are generated as one padded batch with a KV cache
(`TinyPolicy.generate`), so a GRPO group costs one forward per token, not n.

Weights are a transformers checkpoint directory (`save_checkpoint`), loaded the way SGLang's
`/update_weights_from_disk {"model_path": dir}` loads them (`TinyPolicy.load`). Every result
says which load drew it (`GenResult.weights`), and a request can go on from output it already
has (`GenRequest.emitted`): the engine re-draws the tokens a request has not emitted yet when
new weights load while it is in flight, so each token is the draw of the weights loaded at its
step, as SGLang decodes (workers/sim/core.py `SimEngine.load_weights_from_disk`).

`TinyLMPolicy` is the model behind the engine's policy interface (workers/sim/policy.py): it
turns a request's sampling params into a `GenRequest`, batches the requests that arrive in one
tick, and re-draws the drafts in flight after a load.

torch and transformers are imported lazily: the project imports, and the demo runs, without
them; only a policy that is asked for needs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.sim.config import SimConfig
from workers.sim.policy import DEFAULT_MAX_NEW_TOKENS, Draft

# the model's shape (Qwen2ForCausalLM): small enough that a GRPO step over a few hundred short
# answers trains in about a second on one CPU core
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


@dataclass
class GenRequest:
    """One request as the scheduler hands it: prompt ids and SGLang's sampling params."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # output it already has (drawn by earlier weights): the model reads it after the prompt, and
    # the finish rules count it (the max_new_tokens budget, stop strings across the boundary)
    emitted: list[int] = field(default_factory=list)


@dataclass
class GenResult:
    ids: list[int]  # the new tokens (after `emitted`)
    log_probs: list[float]
    finish: dict[str, Any]  # over the whole output: `emitted` + `ids`
    weights: int = 0  # which load of the weights drew it (`TinyPolicy.loads`)


def new_model(vocab_size: int, *, seed: int = 0, eos_id: int = 0) -> Any:
    """A freshly initialised tiny Qwen2 causal LM over `vocab_size` tokens."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id,
                         **TINY_SHAPE)
    model = Qwen2ForCausalLM(config)
    model.eval()
    return model


def save_checkpoint(model: Any, path: str | Path) -> str:
    """Write `model` as a transformers checkpoint directory (config.json + safetensors), as a
    trainer's HF export writes one for SGLang to load; returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def load_model(path: str | Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


class TinyPolicy:
    """The model the engine serves, and its sampler. Thread-safe: `load` and `generate` take a
    lock, so a weight update waits for the batch in flight (SGLang's model_update_lock)."""

    def __init__(self, path: str | Path, tokenizer: Any, *, seed: int = 0, threads: int = 1):
        import torch

        torch.set_num_threads(threads)
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.lock = threading.Lock()
        self.generator = torch.Generator().manual_seed(seed)
        self.path = ""
        self.model: Any = None
        self.loads = 0  # weights loaded so far: a result drawn under another count is stale
        self.load(path)

    def load(self, path: str | Path) -> None:
        """SGLang's update_weights_from_disk: the checkpoint at `path` replaces the weights."""
        model = load_model(path)
        with self.lock:
            self.model, self.path = model, str(path)
            self.loads += 1

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        with self.lock:
            return self._generate(requests)

    def _generate(self, requests: list[GenRequest]) -> list[GenResult]:
        import torch

        if not requests:
            return []
        batch = len(requests)
        contexts = [r.input_ids + r.emitted for r in requests]
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        pad = self.eos_id
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, context in enumerate(contexts):  # left padding: every row's next token is at the end
            ids[i, width - lengths[i]:] = torch.tensor(context, dtype=torch.long)
            mask[i, width - lengths[i]:] = 1
        temps = torch.tensor([max(r.temperature, 1e-5) for r in requests]).unsqueeze(1)
        greedy = torch.tensor([r.temperature < 1e-5 or r.top_k == 1 for r in requests])
        out: list[list[int]] = [list(r.emitted) for r in requests]  # the whole output, for the finish rules
        lps: list[list[float]] = [[] for _ in requests]
        finish: list[dict[str, Any] | None] = [None] * batch
        for i, r in enumerate(requests):
            if len(r.emitted) >= r.max_new_tokens:
                finish[i] = {"type": "length", "length": len(r.emitted)}
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = None
        step_ids = ids
        with torch.no_grad():
            while any(f is None for f in finish):
                result = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                                    past_key_values=past, use_cache=True)
                past = result.past_key_values
                logits = result.logits[:, -1, :].float()
                chosen, logp = self._sample(logits, temps, greedy, requests)
                for i, r in enumerate(requests):
                    if finish[i] is not None:
                        continue
                    token = int(chosen[i])
                    out[i].append(token)
                    lps[i].append(float(logp[i]))
                    finish[i] = self._finished(r, out[i], token)
                step_ids = chosen.unsqueeze(1)
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
        return [GenResult(o[len(r.emitted):], lp, f or {"type": "length", "length": len(o)}, self.loads)
                for r, o, lp, f in zip(requests, out, lps, finish)]

    def _sample(self, logits: Any, temps: Any, greedy: Any, requests: list[GenRequest]) -> tuple[Any, Any]:
        """SGLang's sampler: logits / temperature, softmax, top-k / top-p filtering of the draw
        (not of the returned log-prob), one draw per row; greedy rows take the argmax."""
        import torch

        scaled = logits / temps
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = logprobs.exp()
        filtered = probs.clone()
        for i, r in enumerate(requests):
            if r.top_k > 0:
                kth = torch.topk(filtered[i], min(r.top_k, filtered.shape[-1])).values[-1]
                filtered[i][filtered[i] < kth] = 0.0
            if r.top_p < 1.0:
                sorted_p, order = torch.sort(filtered[i], descending=True)
                drop = sorted_p.cumsum(0) - sorted_p > r.top_p  # keep the smallest set reaching top_p
                filtered[i][order[drop]] = 0.0
        drawn = torch.multinomial(filtered, 1, generator=self.generator).squeeze(1)
        chosen = torch.where(greedy, logits.argmax(-1), drawn)
        raw = torch.log_softmax(logits, dim=-1)
        logp = torch.where(greedy, raw.gather(1, chosen.unsqueeze(1)).squeeze(1),
                           logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1))
        return chosen, logp

    def _finished(self, request: GenRequest, produced: list[int], token: int) -> dict[str, Any] | None:
        """SGLang's check_finished order: eos / stop token ids, stop strings, then the budget."""
        if token == self.eos_id or token in request.stop_token_ids:
            return {"type": "stop", "matched": token}
        if request.stop:
            tail = self.tokenizer.decode(produced[-8:], skip_special_tokens=False)
            for stop in request.stop:
                if stop and stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(produced) >= request.max_new_tokens:
            return {"type": "length", "length": len(produced)}
        return None


@dataclass(kw_only=True)
class ModelDraft(Draft):
    """A tiny-policy request's answer, with what a re-draw needs: what it asked for, and which
    load of the weights drew the ids past the emitted ones."""

    request: GenRequest
    weights: int


def gen_request(input_ids: list[int], params: dict[str, Any]) -> GenRequest:
    """The request as the model samples it, from SGLang's sampling params (absent or null: SGLang's defaults)."""
    budget = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    stops = params.get("stop") or []
    return GenRequest(
        input_ids=input_ids, max_new_tokens=int(budget if budget is not None else DEFAULT_MAX_NEW_TOKENS),
        temperature=float(params.get("temperature", 1.0) if params.get("temperature") is not None else 1.0),
        top_p=float(params.get("top_p") or 1.0), top_k=int(params.get("top_k") or -1),
        stop=[stops] if isinstance(stops, str) else list(stops),
        stop_token_ids=list(params.get("stop_token_ids") or []))


class TinyLMPolicy:
    """The tiny LM behind the engine's `Policy` interface (workers/sim/policy.py). A request's
    answer is drawn whole when it arrives, at its own sampling params; the scheduler times it. A
    weight load while it is in flight re-draws what it has not emitted yet (`redraw`), so every
    token is the draw of the weights loaded at its step."""

    def __init__(self, path: str, tokenizer: Any, *, seed: int):
        self.model = TinyPolicy(path, tokenizer, seed=seed)
        self._queue: list[tuple[GenRequest, asyncio.Future[GenResult]]] = []
        self._busy = False

    def weights_refusal(self) -> str | None:
        return None

    def load(self, path: str) -> None:
        self.model.load(path)

    async def draft(self, input_ids: list[int], routing_key: str, params: dict[str, Any], config: SimConfig) -> Draft:
        request = gen_request(input_ids, params)
        result = await self._generate(request)
        while result.weights != self.model.loads:  # drawn before a load that ended since: draw again
            result = await self._generate(request)
        return ModelDraft(result.ids, result.log_probs, result.finish, request.max_new_tokens, request=request,
                          weights=result.weights)

    async def redraw(self, in_flight: list[tuple[Draft, int]]) -> int:
        """Every draft in flight that an earlier load drew gets the rest of its answer drawn again
        by the weights now loaded, in one batch: conditioned on its prompt and the tokens it
        already emitted, at its own sampling params, within what is left of its max_new_tokens,
        with these weights' log-probs and finish."""
        stale = [(draft, produced) for draft, produced in in_flight
                 if isinstance(draft, ModelDraft) and draft.weights != self.model.loads]
        if not stale:
            return 0
        requests = [dataclasses.replace(draft.request, emitted=draft.ids[:produced]) for draft, produced in stale]
        results = await asyncio.to_thread(self.model.generate, requests)
        for (draft, produced), result in zip(stale, results):
            draft.ids[produced:] = result.ids  # in place: the scheduler's SimReq steps through this list
            draft.log_probs[produced:] = result.log_probs
            draft.finish, draft.weights = result.finish, result.weights
        return len(stale)

    async def _generate(self, request: GenRequest) -> GenResult:
        """Requests that arrive while a batch generates go together in the next one (one forward
        per token for the whole batch, as the scheduler's running batch)."""
        future: asyncio.Future[GenResult] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if not self._busy:
            self._busy = True
            asyncio.ensure_future(self._loop())
        return await future

    async def _loop(self) -> None:
        try:
            while self._queue:
                await asyncio.sleep(0)  # the requests of this tick join the batch
                batch, self._queue = self._queue, []
                results: Sequence[GenResult | Exception]
                try:
                    results = await asyncio.to_thread(self.model.generate, [r for r, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every waiter hears of it
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._busy = False
