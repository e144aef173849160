"""The simulated engine's scripted policy: no model, a script that knows answers.

It works on the real test tokenizer (workers.sim.tokenizer). For each turn it decodes the input
ids, finds the last user question and:
- if tools are offered (`<tools>` in the system prompt) and no tool answered yet, calls one
  (probability `tool_use`) in Hermes format: `<tool_call>{json}</tool_call>`;
- otherwise answers `... Answer: X`. X is right with probability `accuracy`. The script knows
  the right answer only by evaluating an arithmetic question ("What is 12 * 7?") itself or by
  looking the question up in tasks given with `--tasks FILE` (tasks.jsonl with labels,
  `load_answers`): it is told the answers, it does not reason.
Before the answer stands a lognormal number of filler tokens (the long tail of response lengths).
A turn's plan is seeded by (seed, routing key, context length), so a request resumed after an
abort continues the same plan, and the n episodes of a group differ. With `puzzle` it plays
sliding-puzzle moves instead (workers/sim/puzzle.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from typing import Any

import numpy as np

from pipeline.schema import Task
from workers.sim.config import SimConfig
from workers.sim.policy import DEFAULT_MAX_NEW_TOKENS, Draft
from workers.sim.puzzle import puzzle_move

_QUESTION = re.compile(r"(?:what is|compute|calculate|evaluate)\s+([-+*/%().\d\s]+?)\s*[?.=]?\s*$", re.IGNORECASE)
_FILLER_WORDS = (
    "the answer is that let me think about this step by step first we have then we get so result check "
    "again compute and multiply add numbers total is value of it for with hmm wait right ok"
).split()
_NO_WEIGHTS = "this simulated engine plays the scripted policy (no --policy-path): no weights to load"


class ScriptedPolicy:
    """The script behind the engine's `Policy` interface (workers/sim/policy.py)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self._filler_ids = _single_token_words(tokenizer)
        self._assistant_header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def weights_refusal(self) -> str | None:
        return _NO_WEIGHTS

    def load(self, path: str) -> None:
        raise ValueError(_NO_WEIGHTS)

    async def redraw(self, in_flight: list[tuple[Draft, int]]) -> int:
        return 0  # no weights, nothing drawn by earlier ones

    async def draft(self, input_ids: list[int], routing_key: str, params: dict[str, Any], config: SimConfig) -> Draft:
        if config.puzzle:
            return self._puzzle_draft(input_ids, params)
        plan_ids, plan_lps, done = self.plan(input_ids, routing_key, config)
        max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        budget = len(plan_ids) if max_new is None else max_new
        ids, lps = plan_ids[done : done + budget], plan_lps[done : done + budget]
        finish = ({"type": "stop", "matched": self.eos_id} if ids and ids[-1] == self.eos_id
                  else {"type": "length", "length": len(ids)})
        return Draft(ids, lps, finish, max_new, planned=len(plan_ids) if done == 0 else None, resumed=done > 0)

    def _puzzle_draft(self, input_ids: list[int], params: dict[str, Any]) -> Draft:
        """One sliding-puzzle move, cut at the first of the request's `stop` strings as SGLang
        cuts it (the output ends with the stop string's tokens, finish `stop`)."""
        move = puzzle_move(self.tokenizer.decode(input_ids, skip_special_tokens=False))
        text = f"I slide {move}. <action>{move}</action> That is my move."
        stops = params.get("stop") or []
        hits = [(text.find(s), s) for s in ([stops] if isinstance(stops, str) else stops) if s and s in text]
        if hits:
            at, stop = min(hits)
            ids = self._encode(text[: at + len(stop)])
            finish: dict[str, Any] = {"type": "stop", "matched": stop}
        else:
            ids = self._encode(text) + [self.eos_id]
            finish = {"type": "stop", "matched": self.eos_id}
        budget = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if budget is not None and len(ids) > budget:
            ids, finish = ids[:budget], {"type": "length", "length": budget}
        return Draft(ids, [-0.5] * len(ids), finish, len(ids))

    def plan(self, input_ids: list[int], routing_key: str, config: SimConfig) -> tuple[list[int], list[float], int]:
        """This turn's full response (ids, log-probs) and how much of it the input already holds."""
        turn_start = _rfind(input_ids, self._assistant_header)
        context_end = turn_start if turn_start >= 0 else len(input_ids)
        done = len(input_ids) - (turn_start + len(self._assistant_header)) if turn_start >= 0 else 0
        context = self.tokenizer.decode(input_ids[:context_end], skip_special_tokens=False)
        seed = int.from_bytes(
            hashlib.blake2b(f"{config.seed}|{routing_key}|{context_end}".encode(), digest_size=8).digest(), "little"
        )
        rng = np.random.default_rng(seed)
        body_ids = self._respond(context, rng, config)
        ids = body_ids + [self.eos_id]
        log_probs = (-np.abs(rng.normal(0.0, 0.4, size=len(ids)))).astype(np.float32).tolist()
        return ids, log_probs, min(done, len(ids))

    def _respond(self, context: str, rng: np.random.Generator, config: SimConfig) -> list[int]:
        question, after_question = _last_question(context)
        tools = _offered_tools(context)
        filler = self._filler(rng, config)
        if tools and "<tool_response>" not in after_question and rng.random() < config.tool_use:
            return filler + self._encode("\n" + _tool_call(tools, question, rng, config))
        answer = _answer(question, rng, config)
        return filler + self._encode(f" Answer: {answer}")

    def _filler(self, rng: np.random.Generator, config: SimConfig) -> list[int]:
        n = int(min(config.max_filler_tokens, max(1, rng.lognormal(config.length_mu, config.length_sigma))))
        return [int(i) for i in rng.choice(self._filler_ids, size=n)]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _tool_call(tools: list[dict[str, Any]], question: str, rng: np.random.Generator, config: SimConfig) -> str:
    if rng.random() < config.malformed_rate:
        return '<tool_call>\n{"name": "calculator", "arguments": {expression}\n</tool_call>'
    tool = tools[0].get("function", tools[0])
    params = tool.get("parameters", {}).get("properties", {})
    match = _QUESTION.search(question)
    expression = match.group(1).strip() if match else question[-100:]
    arguments = {name: expression for name in params} if params else {}
    return "<tool_call>\n" + json.dumps({"name": tool.get("name", "tool"), "arguments": arguments}) + "\n</tool_call>"


def _answer(question: str, rng: np.random.Generator, config: SimConfig) -> str:
    truth = _truth(question, config)
    if truth is not None and rng.random() < config.accuracy:
        return truth
    base = float(truth) if truth is not None and _is_number(truth) else 0.0
    wrong = base + float(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
    return str(int(wrong)) if wrong.is_integer() else str(wrong)


def _truth(question: str, config: SimConfig) -> str | None:
    from workers.envs.local import evaluate_arithmetic

    if question.strip() in config.answers:
        from workers.envs.math import gold_answer

        return gold_answer(config.answers[question.strip()])  # GSM8K's "... #### 72" is 72
    match = _QUESTION.search(question)
    if not match:
        return None
    try:
        value = evaluate_arithmetic(match.group(1))
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
        return None
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _single_token_words(tokenizer: Any) -> list[int]:
    ids = [tokenizer.encode(" " + w, add_special_tokens=False) for w in _FILLER_WORDS]
    return [i[0] for i in ids if len(i) == 1] or [i[0] for i in ids]


def _rfind(haystack: list[int], needle: list[int]) -> int:
    """Index of the last occurrence of `needle` in `haystack`, or -1."""
    n = len(needle)
    first = needle[0]
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i] == first and haystack[i : i + n] == needle:
            return i
    return -1


def _last_question(context: str) -> tuple[str, str]:
    """(content of the last user turn that is not a tool response, the text after it)."""
    pos = len(context)
    while True:
        start = context.rfind("<|im_start|>user\n", 0, pos)
        if start < 0:
            return "", context
        body_start = start + len("<|im_start|>user\n")
        end = context.find("<|im_end|>", body_start)
        content = context[body_start : end if end >= 0 else len(context)]
        if not content.startswith("<tool_response>"):
            return content, context[body_start:]
        pos = start


def _offered_tools(context: str) -> list[dict[str, Any]]:
    start, end = context.find("<tools>\n"), context.find("\n</tools>")
    if start < 0 or end < start:
        return []
    tools = []
    for line in context[start + 8 : end].splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            tools.append(json.loads(line))
    return tools


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load_answers(tasks_path: str) -> dict[str, str]:
    """question text -> label from a tasks.jsonl, for tasks the simulator cannot solve itself."""
    from pipeline.schema import decode_task_json

    answers: dict[str, str] = {}
    with open(tasks_path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            task: Task = decode_task_json(line)
            if task.label is not None:
                prompt = task.prompt if isinstance(task.prompt, str) else str(task.prompt[-1].get("content", ""))
                answers[prompt.strip()] = task.label
    return answers
