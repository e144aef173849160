"""rollout prepare: every source kind into tasks.jsonl; bad rows -> file:line errors, nothing partial."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # no PyPI lookups from tests

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openreward.environments import Environment, TextBlock, ToolOutput, terminal, tool
from pydantic import BaseModel

from pipeline.config import ConfigError, parse_config
from pipeline.schema import decode_task_json
from producers.prepare_tasks import PrepareError, main, prepare_tasks
from tests.support.env_helpers import serve_openreward
from workers.envs.base import Environment as PipelineEnvironment


class RowsOnly(PipelineEnvironment):
    """A kind that requires nothing of a task: these tests are about reading rows (a math kind
    would also require each row's label, see workers/validate.py)."""

    async def start(self, task):  # pragma: no cover - never run
        raise NotImplementedError


ROWS_ONLY = f"{__name__}:RowsOnly"


def config_for(**datasets):
    return parse_config({"environments": {
        name: {"kind": "openreward" if ds.get("source") == "openreward" else ROWS_ONLY, "dataset": ds,
               **({"options": ds.pop("_options")} if "_options" in ds else {}),
               **ds.pop("_env", {})}
        for name, ds in datasets.items()
    }})


def read_tasks(path: Path):
    return [decode_task_json(line) for line in path.read_bytes().splitlines()]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_with_field_map_given_and_hashed_ids(tmp_path):
    write_jsonl(tmp_path / "math.jsonl", [
        {"uid": 7, "question": "What is 6*7?", "answer": 42, "level": 2, "extra": "x"},
        {"question": "  What is 1+1?", "answer": "2", "level": 1},
        {"uid": "m3", "question": [{"role": "user", "content": "chat form"}], "answer": None},
    ])
    config = config_for(math={"source": "jsonl", "files": ["math*.jsonl"],
                              "fields": {"id": "uid", "prompt": "question", "label": "answer", "metadata": ["level"]}})
    report = prepare_tasks(config, tmp_path / "tasks.jsonl", base_dir=tmp_path)
    tasks = read_tasks(tmp_path / "tasks.jsonl")
    assert [t.id for t in tasks][0::2] == ["7", "m3"]
    assert tasks[0].label == "42" and tasks[0].metadata == {"level": 2} and tasks[0].env == "math"
    assert tasks[1].id.startswith("math/") and tasks[2].prompt == [{"role": "user", "content": "chat form"}]
    assert report.written == 3 and report.envs["math"].rows == 3
    again = tmp_path / "again.jsonl"
    prepare_tasks(config, again, base_dir=tmp_path)
    assert again.read_bytes() == (tmp_path / "tasks.jsonl").read_bytes()  # content-hash ids are stable


def test_parquet_source(tmp_path):
    table = pa.table({"id": ["p1", "p2"], "prompt": ["first", "second"], "label": ["1", "2"], "topic": ["a", "b"]})
    pq.write_table(table, tmp_path / "part-0.parquet")
    config = config_for(pq_env={"source": "parquet", "files": ["part-*.parquet"]})
    prepare_tasks(config, tmp_path / "tasks.jsonl", base_dir=tmp_path)
    tasks = read_tasks(tmp_path / "tasks.jsonl")
    assert [(t.id, t.prompt, t.label, t.metadata) for t in tasks] == [
        ("p1", "first", "1", {"topic": "a"}), ("p2", "second", "2", {"topic": "b"})]


def test_nemo_gym_rows_keep_the_whole_row_as_metadata(tmp_path):
    row = {"responses_create_params": {"input": [{"role": "user", "content": "What is 2+3?"}],
                                       "tools": [{"type": "function", "name": "calc", "parameters": {}}]},
           "question": "What is 2+3?", "expected_answer": "5"}
    write_jsonl(tmp_path / "gym.jsonl", [row])
    prepare_tasks(config_for(gym={"source": "nemo_gym", "files": ["gym.jsonl"]}), tmp_path / "t.jsonl",
                  base_dir=tmp_path)
    [task] = read_tasks(tmp_path / "t.jsonl")
    assert task.prompt == row["responses_create_params"]["input"] and task.label == "5"
    assert task.metadata == row and task.id.startswith("gym/")


class Answer(BaseModel):
    answer: str


class Quiz(Environment):
    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"id": f"{split}-{i}", "question": f"{split} q{i}"} for i in range(5)]

    def get_prompt(self):
        return [TextBlock(text=self.task_spec["question"])]

    @terminal
    @tool
    async def submit(self, params: Answer) -> ToolOutput:
        """Grade the answer."""
        return ToolOutput(blocks=[TextBlock(text="ok")], reward=1.0, finished=True)


@pytest.fixture(scope="module")
def quiz_server():
    with serve_openreward(Quiz) as url:
        yield url


def test_openreward_task_lists_through_the_sdk(tmp_path, quiz_server):
    config = config_for(quiz={"source": "openreward", "_options": {"environment": "quiz", "base_url": quiz_server},
                              "_env": {"splits": ["train", "test"], "num_samples": 3}})
    prepare_tasks(config, tmp_path / "t.jsonl", base_dir=tmp_path)
    tasks = read_tasks(tmp_path / "t.jsonl")
    assert [t.id for t in tasks] == ["train-0", "train-1", "train-2", "test-0", "test-1", "test-2"]
    assert tasks[0].metadata["task_spec"] == {"id": "train-0", "question": "train q0"}
    assert tasks[3].metadata["split"] == "test" and tasks[3].metadata["index"] == 0


BAD_ROWS = [
    ('{"id": "b1", "prompt": "fine"}', None),
    ('{"id": "b2", "prompt": "unterminated', "malformed JSON"),
    ('{"id": "b3", "text": "no prompt"}', "missing field 'prompt' (prompt)"),
    ('{"id": "b4", "prompt": 12}', "Expected `str | array`, got `int`"),
    ('{"id": "b5", "prompt": "   "}', "field 'prompt' is empty"),
    ('{"id": "b1", "prompt": "again"}', "duplicate task id 'b1' (first at"),
    ('{"id": "b7", "prompt": "x", "label": {"a": 1}}', "(label) must be a string or number, got dict"),
    ('{"id": "b8", "prompt": "' + "y" * 5000 + '"}', "over the limit of 4096"),
    ('{"id": "b9", "prompt": "lone \\ud800 surrogate"}', "surrogate"),
    ('["a", "list"]', "row must be a JSON object, got list"),
    ('{"id": "b11", "prompt": [{"content": "no role"}]}', "prompt[0] has no 'role'"),
    ('{"id": true, "prompt": "bool id"}', "(id) must be a string or integer, got bool"),
]


def _bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    lines = [row for row, _ in BAD_ROWS] + ['{"id": "ok-unicode", "prompt": "é ⁄ 𝔘 \u202e \\u0000 👩‍👩‍👧"}']
    path.write_bytes("\n".join(lines).encode("utf-8") + b"\n" + b'{"id": "bin", "prompt": "\xff\xfe"}\n')
    return path


def test_bad_rows_fail_with_file_line_and_write_nothing(tmp_path):
    bad = _bad_file(tmp_path)
    out = tmp_path / "tasks.jsonl"
    out.write_text("previous good output\n")
    config = config_for(env={"source": "jsonl", "files": ["bad.jsonl"]})
    with pytest.raises(PrepareError) as err:
        prepare_tasks(config, out, base_dir=tmp_path, max_row_bytes=4096)
    message = str(err.value)
    for number, (_row, reason) in enumerate(BAD_ROWS, start=1):
        if reason:
            assert f"{bad}:{number}: " in message and reason in message, (number, reason, message)
    assert f"{bad}:{len(BAD_ROWS) + 2}: not valid UTF-8" in message
    assert f"{bad}:{len(BAD_ROWS) + 1}" not in message  # odd but valid unicode is fine
    assert out.read_text() == "previous good output\n"  # untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tasks")] == []  # no temp left


def test_skip_invalid_skips_and_counts(tmp_path):
    _bad_file(tmp_path)
    config = config_for(env={"source": "jsonl", "files": ["bad.jsonl"]})
    report = prepare_tasks(config, tmp_path / "t.jsonl", base_dir=tmp_path, skip_invalid=True, max_row_bytes=4096)
    tasks = read_tasks(tmp_path / "t.jsonl")
    ids = [t.id for t in tasks]
    assert ids[0] == "b1" and "ok-unicode" in ids and len(ids) == len(set(ids))
    assert tasks[-1].prompt == "é ⁄ 𝔘 \u202e \u0000 👩‍👩‍👧"  # odd but valid unicode survives byte for byte
    assert report.invalid == report.envs["env"].rows - len(tasks) >= 10


def test_duplicate_ids_across_environments_are_caught(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "same", "prompt": "a"}])
    write_jsonl(tmp_path / "b.jsonl", [{"id": "same", "prompt": "b"}])
    config = config_for(a={"source": "jsonl", "files": ["a.jsonl"]}, b={"source": "jsonl", "files": ["b.jsonl"]})
    with pytest.raises(PrepareError, match=r"b.jsonl:1: duplicate task id 'same' \(first at .*a.jsonl:1\)"):
        prepare_tasks(config, tmp_path / "t.jsonl", base_dir=tmp_path)


@pytest.mark.parametrize("dataset,env_extra,message", [
    ({"source": "csv", "files": ["x"]}, {}, "environments.e.dataset.source: Invalid enum value 'csv'"),
    ({"source": "jsonl"}, {}, "environments.e.dataset: source jsonl needs `files`"),
    ({"source": "jsonl", "files": ["x"], "fields": {"prompt": 3}}, {}, "environments.e.dataset.fields.prompt"),
    ({"source": "jsonl", "files": ["x"], "field_map": {}}, {}, "environments.e.dataset.field_map"),
    ({"source": "jsonl", "files": ["missing/*.jsonl"]}, {}, "environments.e.dataset.files: no file matches"),
    ({"source": "openreward"}, {"options": {"base_url": "http://x"}}, "environments.e.options: Object missing required field `environment`"),
])
def test_bad_dataset_settings_name_the_key(tmp_path, dataset, env_extra, message):
    config = parse_config({"environments": {"e": {"kind": "math", "dataset": dataset, **env_extra}}})
    with pytest.raises(ConfigError) as err:
        prepare_tasks(config, tmp_path / "t.jsonl", base_dir=tmp_path)
    assert message in str(err.value)


def test_cli_writes_summary_and_fails_cleanly(tmp_path, capsys):
    # a long directory (as under pytest-xdist or a CI checkout): the error's `file:line` stays on one
    # line, never wrapped at the console's width, so it can be copied and grepped
    tmp_path = tmp_path / ("deep-" * 16)
    tmp_path.mkdir()
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "one", "label": "1"}, {"prompt": "two", "label": "2"}])
    cfg = tmp_path / "train_config.yaml"
    cfg.write_text("environments:\n  e:\n    kind: math\n    dataset: {source: jsonl, files: [d.jsonl]}\n")
    assert main(["--config", str(cfg), "--output", str(tmp_path / "t.jsonl")]) == 0
    assert len(read_tasks(tmp_path / "t.jsonl")) == 2
    assert "wrote 2 tasks" in capsys.readouterr().err
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "one", "label": "1"}, {"prompt": "", "label": "2"}])
    assert main(["--config", str(cfg), "--output", str(tmp_path / "t2.jsonl")]) == 2  # usage/config class
    assert f"{tmp_path / 'd.jsonl'}:2: task" in capsys.readouterr().err and not (tmp_path / "t2.jsonl").exists()
