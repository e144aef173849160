import msgspec
import numpy as np
import pytest

from pipeline.schema import (
    PromptJob, Sample, SampleGroup, SamplingParams, SchemaError, Status, Task,
    decode_group, decode_job, decode_task_json, encode,
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
