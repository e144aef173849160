"""Token bookkeeping with the tokenizer's chat template: prompt ids and continuation ids.

The prompt is rendered once (tools included). After that, the model's tokens are
kept verbatim and only the *template's* tokens for the environment's reply are
added. Those are found by rendering a fixed two-message conversation with and
without the observation messages and taking the difference, so they are exactly
what the template would have produced, without ever re-tokenising model output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgspec

from workers.envs.base import Message

_MARK = "\u2063rollout-mark\u2063"  # content no real message has
_CACHE_SIZE = 1024  # renders keyed by their JSON: the n episodes of a group share one prompt
_json = msgspec.json.Encoder()
_BASE: list[Message] = [{"role": "user", "content": "."}, {"role": "assistant", "content": _MARK}]


class TemplateError(ValueError):
    """The chat template does not render observations as a suffix of the conversation."""


class ChatTokens:
    def __init__(self, tokenizer: Any):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id
        self._base_text = self._render(_BASE, add_generation_prompt=False)
        # The template's tokens that close an assistant turn (e.g. "<|im_end|>\n").
        self._close_ids = self.encode(self._base_text.split(_MARK, 1)[1])
        # Rendering + encoding costs ~0.5 ms; cached so a busy event loop stays responsive.
        self._prompt_cached = functools.lru_cache(_CACHE_SIZE)(self._prompt_uncached)
        self._observation_cached = functools.lru_cache(_CACHE_SIZE)(self._observation_uncached)

    def _render(self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Any = None) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Display text of model tokens (special tokens dropped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_for_tools(self, ids: Sequence[int]) -> str:
        """The text tool parsers read: special tokens kept, because several formats mark their
        calls with them (gpt-oss `<|call|>`, Mistral `[TOOL_CALLS]`, Kimi-K2's sections)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        return list(self._prompt_cached(_json.encode([list(messages), list(tools or [])])))

    def _prompt_uncached(self, key: bytes) -> tuple[int, ...]:
        messages, tools = msgspec.json.decode(key)
        return tuple(self.encode(self._render(messages, add_generation_prompt=True, tools=tools)))

    def continuation_ids(self, observations: Sequence[Message], *, model_ended_with_eos: bool) -> list[int]:
        """Template tokens after an assistant turn: close it, add `observations`, open the next one.

        When the model's last token was EOS (the normal stop), that token already
        closes its turn and is not added again.
        """
        close = self._close_ids
        if model_ended_with_eos and close and close[0] == self.eos_id:
            close = close[1:]
        return close + list(self._observation_cached(_json.encode(list(observations))))

    def _observation_uncached(self, key: bytes) -> tuple[int, ...]:
        full = self._render([*_BASE, *msgspec.json.decode(key)], add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise TemplateError("chat template renders earlier turns differently once observations follow")
        return tuple(self.encode(full[len(self._base_text) :]))
