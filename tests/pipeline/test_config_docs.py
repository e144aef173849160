"""docs/configuration.md is checked against the schema: every field of PipelineConfig's sections,
EnvConfig, its timeouts and TrainerSettings is documented, with its real default."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from pipeline import config as cfg

DOC = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
ROW = re.compile(r"^\| `([^`]+)` \|(.*)$", re.MULTILINE)


def _rows() -> dict[str, list[str]]:
    return {key: [c.strip() for c in rest.split("|")[:-1]] for key, rest in ROW.findall(DOC)}


def _default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        return msgspec.json.encode(field.default).decode()
    if field.default_factory is not msgspec.NODEFAULT:
        return msgspec.json.encode(field.default_factory()).decode()
    return "required"


def _documented(rows: dict[str, list[str]], key: str, column: int = 0) -> str:
    assert key in rows, f"docs/configuration.md does not document `{key}`"
    return rows[key][column].strip("`")


SECTIONS = [("redis", cfg.RedisSection), ("engine", cfg.EngineSection), ("rollout", cfg.RolloutSection),
            ("workers", cfg.WorkersSection), ("environments.<name>", cfg.EnvConfig),
            ("timeouts", cfg.EnvTimeouts), ("timeouts.*", cfg.CallBudget)]


@pytest.mark.parametrize("prefix,struct", SECTIONS, ids=[p for p, _ in SECTIONS])
def test_every_yaml_field_is_documented_with_its_default(prefix, struct):
    rows = _rows()
    for field in msgspec.structs.fields(struct):
        documented = _documented(rows, f"{prefix}.{field.name}")
        if documented != "see below":  # nested tables document their own fields
            assert documented == _default_text(field), f"`{prefix}.{field.name}`: doc says {documented}"


def test_every_top_level_section_is_documented():
    for field in msgspec.structs.fields(cfg.PipelineConfig):
        assert f"## `{field.name}" in DOC, f"section `{field.name}` missing from docs/configuration.md"


def test_every_trainer_setting_is_documented_with_its_sources_and_default():
    rows = _rows()
    for field in msgspec.structs.fields(cfg.TrainerSettings):
        attr, env = cfg._TRAINER_SOURCES[field.name]
        cells = rows.get(field.name)
        assert cells is not None, f"TrainerSettings.{field.name} is not documented"
        assert cells[:2] == [f"`{attr}`", f"`{env}`"], f"{field.name}: sources in the doc {cells[:2]}"
        assert cells[2].strip("`") == _default_text(field), f"{field.name}: doc default {cells[2]}"
