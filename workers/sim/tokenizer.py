"""A small, real, local tokenizer with a Qwen/ChatML-style chat template.

No model hub is reachable from tests, the demo or CI, so we train a byte-level BPE
tokenizer (the `tokenizers` library) on a small embedded corpus and save it as a
directory that `transformers.AutoTokenizer.from_pretrained(path)` loads. Byte-level
means every string round-trips, so the simulated engine can emit any text.

The chat template follows the Hermes/Qwen2.5 conventions that real checkpoints use:
tools are listed in the system prompt inside `<tools></tools>`, assistant tool calls
are `<tool_call>{json}</tool_call>`, and tool output goes back in a user turn inside
`<tool_response></tool_response>`. `<|im_start|>`, `<|im_end|>` and `<|endoftext|>`
are special tokens; the tool tags are added (non-special) tokens as in Qwen, so
decoding with skip_special_tokens keeps them.

API: `build_test_tokenizer(path) -> str` writes one; `default_tokenizer_path() -> str`
returns a shared cached copy (built once per machine, atomically), and
`load_test_tokenizer()` loads that copy with transformers.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

TOKENIZER_VERSION = "v1"  # bump when the corpus, vocab or template changes
ENV_TOKENIZER_DIR = "ROLLOUT_TEST_TOKENIZER"
VOCAB_SIZE = 2048

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS_TOKEN = "<|im_end|>"

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Enough text for BPE to learn English words, digits, JSON and the tool-call shape.
_CORPUS = """\
You are a helpful assistant. Solve the problem step by step and put the final answer after "Answer:".
What is 12 + 35? Let me think. 12 plus 35 is 47. Answer: 47
What is 7 * 8? Seven times eight is fifty-six. Answer: 56
Compute 144 / 12 - 3. The quotient is 12, minus 3 gives 9. Answer: 9
The calculator tool evaluates an arithmetic expression and returns the result as text.
I will use the calculator to check the result before answering the question.
{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}
{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
 "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
error: the tool call could not be parsed as JSON; expected {"name": ..., "arguments": {...}}
The answer is correct. The answer is wrong. Please try again with a different approach.
def add(a, b):\n    return a + b\nprint(add(2, 3))\nimport math\nfor i in range(10):\n    total += i
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 75 100 128 256 512 1000 1024 2048
the of and to in is that it for on with as was at by this be from or have an are not but which
Question: If a train travels 60 miles in 1.5 hours, what is its average speed? Answer: 40 miles per hour.
Hmm, wait. Let me double-check the arithmetic: 3 + 4 = 7, and 12 * 7 = 84. So the result is 84.
"""


def build_test_tokenizer(path: str | os.PathLike[str]) -> str:
    """Train the test tokenizer and save it (with chat template) under `path`; returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_tokens(TOOL_TOKENS, special_tokens=False)
    wrapped.chat_template = CHAT_TEMPLATE
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out))
    return str(out)


def default_tokenizer_path() -> str:
    """A shared copy: `$ROLLOUT_TEST_TOKENIZER`, else ~/.cache/rollout-pipeline/test-tokenizer-<version>.

    Built on first use into a temporary sibling and renamed into place, so several
    processes racing to build it never see a half-written directory.
    """
    override = os.environ.get(ENV_TOKENIZER_DIR)
    if override:
        if not Path(override, "tokenizer.json").exists():
            build_test_tokenizer(override)
        return override
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollout-pipeline"
    target = cache_root / f"test-tokenizer-{TOKENIZER_VERSION}"
    if (target / "tokenizer.json").exists():
        return str(target)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix="tok-build-", dir=cache_root)
    build_test_tokenizer(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process won the race; its copy is identical
        _remove_tree(Path(staging))
    return str(target)


def load_test_tokenizer(path: str | None = None) -> Any:
    """`AutoTokenizer.from_pretrained` on the shared copy (or `path`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path or default_tokenizer_path())


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    print(default_tokenizer_path())
