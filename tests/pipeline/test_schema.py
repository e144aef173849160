import msgspec
import numpy as np
import pytest

from pipeline.schema import (
    PromptJob,
    Sample,
    SampleGroup,
    SamplingParams,
    SchemaError,
    Status,
    Task,
    decode_group,
    decode_job,
    decode_task_json,
    encode,
)
from pipeline.synthetic import make_group


def test_group_round_trip_keeps_arrays_exact():
    group = make_group("task-1:0", n=3, prompt_len=10, response_len=20, admission_version=4)
    back = decode_group(encode(group))
    assert back == group
    s = back.samples[1]
    assert s.token_array().dtype == np.dtype("<i4") and s.num_tokens == 30
    assert s.log_prob_array().dtype == np.dtype("<f4") and len(s.log_prob_array()) == 20
    assert s.loss_mask_array().tolist() == [1] * 20
    assert back.oldest_version() == 4


def test_sample_build_from_lists():
    s = Sample.build(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.5, 0.0],
                     reward=1, status="completed")
    assert s.token_array().tolist() == [1, 2, 3, 4]
    assert s.log_prob_array().tolist() == [-0.5, 0.0]
    assert s.status is Status.COMPLETED


def _bad_sample(**override):
    fields = dict(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0],
                  reward=0.0, status="completed")
    fields.update(override)
    return Sample.build(**fields)


@pytest.mark.parametrize("override, message", [
    ({"loss_mask": [1]}, "sample 1: field 'loss_mask' has 1 entries, response_length is 2"),
    ({"rollout_log_probs": [-1.0]}, "sample 1: field 'rollout_log_probs' has 1 entries, response_length is 2"),
    ({"response_length": 5, "loss_mask": [1] * 5, "rollout_log_probs": [0.0] * 5},
     "field 'response_length' is 5 but 'tokens' has only 3"),
    ({"reward": float("nan")}, "field 'reward' is NaN"),
])
def test_invariants_rejected_on_build_with_group_and_field(override, message):
    good = _bad_sample()
    with pytest.raises(SchemaError, match="group 'g7'") as info:
        SampleGroup(group_id="g7", task=Task(id="t", env="e", prompt="p"), admission_version=0, n_samples=2,
                    samples=[good, _bad_sample(**override)])
    assert message in str(info.value)


def test_group_size_checked():
    group = make_group("g:0", n=2)
    with pytest.raises(SchemaError, match="field 'samples' has 2 samples, n_samples is 3"):
        SampleGroup(group_id="g:0", task=group.task, admission_version=0, n_samples=3, samples=group.samples)


def test_invariants_rejected_on_decode():
    group = make_group("g:1", n=2)
    raw = msgspec.msgpack.decode(encode(group))
    raw["samples"][0]["loss_mask"] = b"\x01"
    with pytest.raises(SchemaError, match=r"group 'g:1' sample 0: field 'loss_mask' has 1 entries"):
        decode_group(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(encode(group))
    raw["samples"][1]["tokens"] = b"\x01\x02\x03"
    with pytest.raises(SchemaError, match="not a multiple of 4"):
        decode_group(msgspec.msgpack.encode(raw))


def test_garbage_is_schema_error():
    for junk in (b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode({"group_id": 3})):
        with pytest.raises(SchemaError, match="undecodable SampleGroup"):
            decode_group(junk)


def test_job_round_trip_and_sampling_params_are_strict():
    job = PromptJob(task=Task(id="a", env="math", prompt=[{"role": "user", "content": "1+1"}], label="2"),
                    epoch=3, n_samples=8, sampling=SamplingParams(temperature=0.7, max_new_tokens=128),
                    admission_version=5)
    assert job.job_id == "a:3"
    back = decode_job(encode(job))
    assert back == job
    assert back.sampling.to_dict() == {"temperature": 0.7, "max_new_tokens": 128}
    with pytest.raises(msgspec.ValidationError, match="max_new_tokens"):
        msgspec.convert({"max_new_tokens": 1.5}, SamplingParams)
    with pytest.raises(msgspec.ValidationError, match="unknown field `best_of`"):
        msgspec.convert({"best_of": 2}, SamplingParams)


@pytest.mark.parametrize("line, message", [
    (b'{"id": "", "env": "m", "prompt": "x"}', "field 'id' is empty"),
    (b'{"id": "a", "env": "m", "prompt": "   "}', "field 'prompt' is empty"),
    (b'{"id": "a", "env": "m", "prompt": []}', "has no messages"),
    (b'{"id": "a", "env": "m", "prompt": [{"content": "x"}]}', "prompt[0] has no 'role'"),
    (b'{"id": "a", "env": "m"}', "missing required field `prompt`"),
    (b'{"id": 1, "env": "m", "prompt": "x"}', "Expected `str`, got `int` - at `$.id`"),
    (b'{"id": "a", "env": "m", "prompt": "x"', "truncated"),
])
def test_task_json_errors_are_clear(line, message):
    with pytest.raises(SchemaError) as info:
        decode_task_json(line)
    assert message in str(info.value)


# ------------------------------------------------ invariant checks on every decode (one fast pass)

def _raw_sample(**override):
    raw = dict(tokens=b"\x01\x00\x00\x00" * 3, response_length=2, loss_mask=b"\x01\x01",
               rollout_log_probs=b"\x00\x00\x80\xbf" * 2, reward=0.0, status="completed")
    raw.update(override)
    return raw


@pytest.mark.parametrize("override, message", [
    ({"tokens": b"\x01" * 11}, "field 'tokens' has 11 bytes, not a multiple of 4 (int32)"),
    ({"rollout_log_probs": b"\x00" * 7}, "field 'rollout_log_probs' has 7 bytes, not a multiple of 4 (float32)"),
    ({"response_length": -1, "loss_mask": b"", "rollout_log_probs": b""}, "field 'response_length' is negative (-1)"),
    ({"response_length": 4, "loss_mask": b"\x01" * 4, "rollout_log_probs": b"\x00" * 16},
     "field 'response_length' is 4 but 'tokens' has only 3"),
    ({"loss_mask": b"\x01\x01\x01"}, "field 'loss_mask' has 3 entries, response_length is 2"),
    ({"rollout_log_probs": b"\x00" * 12}, "field 'rollout_log_probs' has 3 entries, response_length is 2"),
    ({"reward": float("nan")}, "field 'reward' is NaN"),
])
@pytest.mark.parametrize("bad_index", [0, 2])
def test_every_invariant_is_checked_on_decode_and_names_the_sample(override, message, bad_index):
    """The fast per-sample pass in SampleGroup.__post_init__ lets no broken sample through, and the
    error is the one Sample.check words (the group, the sample index, the field)."""
    samples = [_raw_sample() for _ in range(3)]
    samples[bad_index] = _raw_sample(**override)
    raw = {"group_id": "g:9", "task": {"id": "t", "env": "e", "prompt": "p"}, "admission_version": 0,
           "n_samples": 3, "samples": samples}
    with pytest.raises(SchemaError) as info:
        decode_group(msgspec.msgpack.encode(raw))
    assert f"group 'g:9' sample {bad_index}: {message}" in str(info.value)


def test_edge_values_that_are_valid_pass():
    """Empty response, response spanning every token, -0.0 and inf rewards: valid, decoded as is."""
    raw = {"group_id": "g:10", "task": {"id": "t", "env": "e", "prompt": "p"}, "admission_version": 0, "n_samples": 3,
           "samples": [_raw_sample(response_length=0, loss_mask=b"", rollout_log_probs=b""),
                       _raw_sample(response_length=3, loss_mask=b"\x01" * 3, rollout_log_probs=b"\x00" * 12,
                                   reward=float("-inf")),
                       _raw_sample(reward=-0.0)]}
    group = decode_group(msgspec.msgpack.encode(raw))
    assert [s.response_length for s in group.samples] == [0, 3, 2]


def test_wire_format_is_unchanged_payloads_of_the_map_layout_decode():
    """Groups stored by earlier code (a msgpack map per struct, every field written) still decode,
    and what we write is that same layout: no format change between versions."""
    group = make_group("g:11", n=2, prompt_len=3, response_len=2)
    raw = msgspec.msgpack.decode(encode(group))
    assert isinstance(raw, dict) and isinstance(raw["samples"][0], dict)
    assert set(raw["samples"][0]) == set(Sample.__struct_fields__)
    legacy = msgspec.msgpack.encode({**raw, "samples": [dict(s) for s in raw["samples"]]})
    assert decode_group(legacy) == group


def test_per_token_versions_and_a_payload_from_before_them():
    """Issue 32 item 7: `token_version_runs` (per response token, run-length) is optional on the
    wire: a payload written before it decodes, and its tokens take their call's oldest stamp."""
    from pipeline.schema import decode_group, encode

    group = make_group("g:v", n=1, prompt_len=3, response_len=6)
    sample = group.samples[0]
    mask = np.array([1, 1, 1, 0, 1, 1], dtype=np.uint8)
    sample = msgspec.structs.replace(sample, loss_mask=memoryview(mask.tobytes()), policy_versions=[4, 5],
                                     token_version_runs=[(4, 2), (5, 1), (-1, 1), (5, 2)])
    group = msgspec.structs.replace(group, samples=[sample])
    again = decode_group(encode(group))
    assert list(again.samples[0].token_versions()) == [4, 4, 5, -1, 5, 5]
    assert again.token_version_counts() == {4: 2, 5: 3}
    old = msgspec.msgpack.decode(encode(group))
    del old["samples"][0]["token_version_runs"]  # what a worker before issue 32 wrote
    before = decode_group(msgspec.msgpack.encode(old))
    assert list(before.samples[0].token_versions()) == [4, 4, 4, -1, 4, 4]
    broken = msgspec.structs.replace(sample, token_version_runs=[(4, 2)])
    with pytest.raises(SchemaError, match="token_version_runs' covers 2 tokens, response_length is 6"):
        broken.token_versions()
