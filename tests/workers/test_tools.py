"""Tool-call parsers (workers/tools.py) on text shaped like each model family's output, and
`options.tool_parser` as a per-environment setting of every built-in kind."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, parse_config
from workers.envs.options import check_tool_parser, check_tool_parsers
from workers.envs.registry import KINDS, build_environment
from workers.tools import PARSERS, ParsedTurn, get_parser, run_parser

W1 = {"location": "Tokyo"}
W2 = {"location": "Paris", "unit": "celsius"}

# One entry per format: how a call to get_weather(args) looks in that model's output.
DS = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def hermes_call(args, name="get_weather"):  # Qwen2.5 / Qwen3 / Hermes chat templates
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def qwen3_coder_call(args, name="get_weather"):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm_call(args, name="get_weather"):
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def ds_v3_call(args, name="get_weather"):
    return f"{DS[0]}function{DS[1]}{name}\n```json\n{json.dumps(args)}\n```{DS[2]}"


def ds_v31_call(args, name="get_weather"):
    return f"{DS[0]}{name}{DS[1]}{json.dumps(args)}{DS[2]}"


def kimi_call(args, name="get_weather", i=0):
    return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"


def harmony_call(args, name="get_weather"):
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{json.dumps(args)}<|call|>")


# (parser, text of one call, of two calls, of a call with malformed arguments, text before, after)
FORMATS = {
    "hermes": (
        hermes_call(W1),
        hermes_call(W1) + "\n" + hermes_call(W2),
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo"}\n</tool_call>',
    ),
    "qwen3_coder": (
        qwen3_coder_call(W1),
        qwen3_coder_call(W1) + "\n" + qwen3_coder_call(W2),
        "<tool_call>\n<parameter=location>\nTokyo\n</parameter>\n</tool_call>",  # no <function=...>
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Tokyo"}}<|eom_id|>',
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Tokyo"}}; '
        '{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}<|eom_id|>',
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Tokyo"<|eom_id|>',
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Tokyo"}, "id": "Ab3dE5gH1"}]</s>',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Tokyo"}}, '
        '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}]</s>',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Tokyo"]</s>',
    ),
    "deepseek_v3": (
        f"<｜tool▁calls▁begin｜>{ds_v3_call(W1)}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        f"<｜tool▁calls▁begin｜>{ds_v3_call(W1)}\n{ds_v3_call(W2)}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        f"<｜tool▁calls▁begin｜>{DS[0]}function{DS[1]}get_weather\n```json\n{{\"location\": Tokyo}}\n```{DS[2]}"
        "<｜tool▁calls▁end｜>",
    ),
    "deepseek_v31": (
        f"<｜tool▁calls▁begin｜>{ds_v31_call(W1)}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        f"<｜tool▁calls▁begin｜>{ds_v31_call(W1)}{ds_v31_call(W2)}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        f"<｜tool▁calls▁begin｜>{DS[0]}get_weather{DS[1]}{{'location': 'Tokyo'}}{DS[2]}<｜tool▁calls▁end｜>",
    ),
    "glm45": (
        glm_call(W1),
        glm_call(W1) + "\n" + glm_call(W2),
        "<tool_call>get_weather\n<arg_key>location</arg_key>\nTokyo\n</tool_call>",  # no <arg_value>
    ),
    "kimi_k2": (
        f"<|tool_calls_section_begin|>{kimi_call(W1)}<|tool_calls_section_end|><|im_end|>",
        f"<|tool_calls_section_begin|>{kimi_call(W1)}{kimi_call(W2, i=1)}<|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"location": "Tokyo",}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    "gpt_oss": (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>" + harmony_call(W1),
        "<|channel|>analysis<|message|>Two cities.<|end|>" + harmony_call(W1) + harmony_call(W2),
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"location": Tokyo}<|call|>',
    ),
}
NAMES = list(FORMATS)


def wrap(name: str, text: str, before: str, after: str) -> str:
    """`before` and `after` the calls where the format puts text (harmony: as messages)."""
    if name == "gpt_oss":  # a preamble (commentary without recipient) before, a final message after
        call = "<|start|>assistant<|channel|>commentary to="
        preamble = f"<|start|>assistant<|channel|>commentary<|message|>{before}<|end|>"
        final = f"<|start|>assistant<|channel|>final<|message|>{after}<|return|>"
        return text.replace(call, preamble + call, 1) + final
    for end in ("<|eom_id|>", "</s>", "<｜end▁of▁sentence｜>", "<|im_end|>"):  # after goes before the EOS
        if text.endswith(end):
            return before + text[: -len(end)] + after + end
    return f"{before}{text}{after}"


def test_every_format_is_registered_and_the_aliases_resolve():
    for name in NAMES + ["qwen", "qwen25", "llama3", "deepseekv3", "deepseekv31", "glm4_moe", "gpt-oss", "harmony"]:
        assert callable(get_parser(name))


@pytest.mark.parametrize("name", NAMES)
def test_no_call_is_plain_content(name):
    text = "The weather in Tokyo is sunny, 24 degrees. {not a call}"
    parsed = get_parser(name)(text)
    assert parsed == ParsedTurn(content=text) and not parsed.wants_tools


@pytest.mark.parametrize("name", NAMES)
def test_one_call(name):
    parsed = get_parser(name)(FORMATS[name][0])
    assert not parsed.errors, parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", W1)]
    assert parsed.content == ""  # the markup and end-of-turn tokens are not content
    assert parsed.calls[0].id


@pytest.mark.parametrize("name", NAMES)
def test_several_calls_get_distinct_ids(name):
    parsed = get_parser(name)(FORMATS[name][1])
    assert not parsed.errors, parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", W1), ("get_weather", W2)]
    assert len({c.id for c in parsed.calls}) == 2


@pytest.mark.parametrize("name", NAMES)
def test_malformed_call_is_an_error_not_an_exception(name):
    parsed = get_parser(name)(FORMATS[name][2])
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.wants_tools
    assert parsed.errors[0].startswith("tool call 0")


@pytest.mark.parametrize("name", NAMES)
def test_text_before_and_after_the_calls_is_content(name):
    text = wrap(name, FORMATS[name][1], before="Let me check both cities.\n\n", after="\n\nI'll wait for the results.")
    parsed = get_parser(name)(text)
    assert not parsed.errors, parsed.errors
    assert [c.arguments for c in parsed.calls] == [W1, W2]
    assert parsed.content == "Let me check both cities.\n\nI'll wait for the results."
    for marker in ("tool_call", "TOOL_CALLS", "tool▁", "<|", "location"):
        assert marker not in parsed.content, parsed.content


@pytest.mark.parametrize("name", [n for n in NAMES if n != "gpt_oss"])
def test_calls_inside_reasoning_are_not_calls(name):
    mentioned = FORMATS[name][0].replace("Tokyo", "Berlin")
    text = f"<think>\nMaybe {mentioned} ... no, Tokyo.\n</think>\n\n{FORMATS[name][0]}"
    parsed = get_parser(name)(text)
    assert [c.arguments for c in parsed.calls] == [W1] and not parsed.errors
    # the prompt opened <think> (Qwen3 thinking, DeepSeek-R1 templates): output starts inside it
    parsed = get_parser(name)(text.replace("<think>", "", 1))
    assert [c.arguments for c in parsed.calls] == [W1] and not parsed.errors
    # a turn that ran out while thinking has no calls
    assert not get_parser(name)(f"<think>\nI will call {mentioned}").wants_tools


def test_harmony_analysis_channel_is_neither_call_nor_content():
    text = ("<|channel|>analysis<|message|>I could call " + harmony_call({"location": "Berlin"})[len("<|start|>"):]
            .replace("<|call|>", "") + "<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>")
    parsed = get_parser("gpt_oss")(text)
    assert parsed.content == "It is sunny." and not parsed.wants_tools
    # recipient in the role header instead of the channel header (the harmony spec allows both)
    parsed = get_parser("gpt_oss")('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
                                   '<|message|>{"location": "Tokyo"}<|call|>')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", W1)]


def test_mistral_compact_format_and_model_ids():
    parsed = get_parser("mistral")('Checking.[TOOL_CALLS]get_weather[ARGS]{"location": "Tokyo"}'
                                   '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "unit": "celsius"}</s>')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", W1), ("get_weather", W2)]
    assert parsed.content == "Checking." and not parsed.errors
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.calls)  # Mistral templates demand it
    parsed = get_parser("mistral")('[TOOL_CALLS]get_weather[CALL_ID]Ab3dE5gH1[ARGS]{"location": "Tokyo"}')
    assert parsed.calls[0].id == "Ab3dE5gH1"
    parsed = get_parser("mistral")(FORMATS["mistral"][0])
    assert parsed.calls[0].id == "Ab3dE5gH1"
    parsed = get_parser("mistral")('[TOOL_CALLS]get_weather[ARGS]{"location": Tokyo}')
    assert not parsed.calls and parsed.errors[0].startswith("tool call 0")


def test_kimi_ids_are_the_models():
    parsed = get_parser("kimi_k2")(FORMATS["kimi_k2"][1])
    assert [c.id for c in parsed.calls] == ["functions.get_weather:0", "functions.get_weather:1"]


def test_deepseek_accepts_v3_and_v31_shapes_under_either_name():
    for name in ("deepseek_v3", "deepseek_v31"):
        for text in (FORMATS["deepseek_v3"][0], FORMATS["deepseek_v31"][0]):
            assert [c.arguments for c in get_parser(name)(text).calls] == [W1]


def test_llama3_json_without_python_tag_and_plain_json_answers():
    parsed = get_parser("llama3_json")('{"name": "get_weather", "parameters": {"location": "Tokyo"}}')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", W1)]
    assert get_parser("llama3_json")('{"answer": 42}') == ParsedTurn(content='{"answer": 42}')
    array = '<|python_tag|>[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {}}]'
    parsed = get_parser("llama3_json")(array)
    assert [c.name for c in parsed.calls] == ["a", "b"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "location": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "zip": {"type": "string"}}}}}]


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
def test_xml_formats_type_values_by_the_tool_schema(name):
    make = qwen3_coder_call if name == "qwen3_coder" else glm_call
    text = make({"location": "New York\nNY", "days": "3", "metric": "true", "hours": "[1, 2]", "zip": "02134"})
    typed = get_parser(name)(text, tools=TOOLS).calls[0].arguments
    assert typed == {"location": "New York\nNY", "days": 3, "metric": True, "hours": [1, 2], "zip": "02134"}
    untyped = get_parser(name)(text).calls[0].arguments
    assert untyped["zip"] == "02134" and untyped["location"] == "New York\nNY"
    assert untyped["days"] == ("3" if name == "qwen3_coder" else 3)  # qwen3_coder: text; glm45: JSON if it is


def test_run_parser_passes_tools_only_to_parsers_that_take_them():
    text = qwen3_coder_call({"days": "3"})
    assert run_parser(get_parser("qwen3_coder"), text, TOOLS).calls[0].arguments == {"days": 3}
    seen = []
    assert run_parser(lambda t: seen.append(t) or ParsedTurn(content=t), "hi", TOOLS) == ParsedTurn(content="hi")
    assert seen == ["hi"]


def test_unclosed_block_and_bad_names_are_errors():
    assert get_parser("hermes")('<tool_call>{"name": "f", "arguments": {}}').errors == [
        "tool call 0: missing </tool_call>"]
    assert get_parser("hermes")('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').errors[0].startswith(
        "tool call 0 (f): the arguments must be a JSON object")
    assert get_parser("glm45")('<tool_call>{"name": "f"}</tool_call>').errors  # hermes JSON is not GLM
    parsed = get_parser("hermes")(hermes_call(W1) + "<tool_call>oops</tool_call>" + hermes_call(W2))
    assert [c.id for c in parsed.calls] == ["call_0", "call_2"] and parsed.errors[0].startswith("tool call 1")


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; valid names: .*qwen3_coder"):
        get_parser("nope")
    assert get_parser("workers.tools:parse_hermes") is PARSERS["hermes"]
    with pytest.raises(ValueError, match="cannot import"):
        get_parser("no_such_module:parser")


# ------------------------------------------------------------------ per-environment setting

KIND_OPTIONS = {
    "arithmetic": {}, "calculator": {}, "math": {}, "code": {},
    "nemo_gym": {"url": "http://127.0.0.1:1"},
    "openreward": {"environment": "owner/env", "base_url": "http://127.0.0.1:1"},
    "nemo_rl": {"cls": "tests.workers.test_tools:_NemoRL"},
    "slime_rm": {"function": "tests.workers.test_tools:_reward"},
    "nemo_skills": {"prompt_config": {"user": "{problem}"}},
    "retrain": {"cls": "tests.workers.test_env_retrain:CalculatorQuiz"},
}


class _NemoRL:
    def step(self, message_logs, metadata):
        return [{}], metadata, None, [1.0], [True]


async def _reward(args, sample):
    return 1.0


def _config(kind: str, tool_parser: str):
    env = {"kind": kind, "options": {**KIND_OPTIONS[kind], "tool_parser": tool_parser}}
    return parse_config({"environments": {f"my_{kind}": env}}, "pipeline.yaml")


def test_every_built_in_kind_is_covered():
    assert set(KIND_OPTIONS) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KIND_OPTIONS))
def test_tool_parser_is_an_option_of_every_kind(kind, monkeypatch):
    monkeypatch.setenv("OPENREWARD_API_KEY", "test")
    config = _config(kind, "qwen3_coder")
    check_tool_parsers(config)
    if kind == "openreward":
        pytest.importorskip("openreward")
    if kind == "nemo_skills":
        from tests.support.conformance_support import require_nemo_skills

        require_nemo_skills("nemo_skills.prompt.utils")  # the kind imports NeMo-Skills when built
    env = build_environment(f"my_{kind}", config.env(f"my_{kind}"))
    if hasattr(env, "options"):
        assert env.options.tool_parser == "qwen3_coder"


@pytest.mark.parametrize("kind", sorted(KIND_OPTIONS))
def test_unknown_tool_parser_is_a_config_error_naming_env_and_valid_names(kind, monkeypatch):
    monkeypatch.setenv("OPENREWARD_API_KEY", "test")
    config = _config(kind, "nope")
    with pytest.raises(ConfigError) as caught:
        check_tool_parsers(config)
    message = str(caught.value)
    assert message.startswith(f"environments.my_{kind}.options.tool_parser: unknown tool parser 'nope'")
    for valid in ("hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "glm45",
                  "kimi_k2", "gpt_oss"):
        assert valid in message
    if kind in ("arithmetic", "calculator"):
        return  # no options struct: check_tool_parsers is their only check
    if kind == "openreward":
        pytest.importorskip("openreward")
    with pytest.raises(ConfigError, match=f"environments.my_{kind}.options.tool_parser: unknown tool parser"):
        build_environment(f"my_{kind}", config.env(f"my_{kind}"))


def test_tool_parser_must_be_a_string():
    config = parse_config({"environments": {"e": {"kind": "math", "options": {"tool_parser": 3}}}})
    with pytest.raises(ConfigError, match="environments.e.options.tool_parser: expected a parser name"):
        check_tool_parser("e", config.env("e"))
