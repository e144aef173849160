"""Environment kinds: `kind` in the config -> Environment class.

A kind is a registered name (below) or a dotted path `package.module:Class` (or
`package.module.Class`) to a user's `Environment` subclass. Classes are imported
when resolved, so registering a kind never imports its dependencies.
"""

from __future__ import annotations

from pipeline.config import EnvConfig
from workers.envs.base import Environment
from workers.plugins import import_dotted

# kind -> "module:Class". Environment engineers add their kinds here.
KINDS: dict[str, str] = {
    "arithmetic": "workers.envs.local:ArithmeticEnvironment",
    "calculator": "workers.envs.local:CalculatorEnvironment",
    "math": "workers.envs.math:MathEnvironment",
    "code": "workers.envs.code:CodeEnvironment",
    "nemo_gym": "workers.envs.nemo_gym:NemoGymEnvironment",
    "openreward": "workers.envs.openreward_env:OpenRewardEnvironment",
    "nemo_rl": "workers.envs.plugins:NemoRLEnvironment",  # options.cls: a NeMo-RL-style batch environment
    "slime_rm": "workers.envs.plugins:SlimeRMEnvironment",  # options.function: a slime custom reward function
    "nemo_skills": "workers.envs.nemo_skills:NemoSkillsEnvironment",  # NeMo-Skills prompt_config + math grader
    "retrain": "workers.envs.retrain:RetrainEnvironment",  # options.cls: a retrain Environment (async reset/step)
}


class UnknownEnvironmentKind(ValueError):
    pass


def resolve_kind(kind: str) -> type[Environment]:
    target = KINDS.get(kind, kind)
    try:
        cls = import_dotted(target)
    except ValueError as exc:
        known = ", ".join(sorted(KINDS))
        raise UnknownEnvironmentKind(f"environment kind {kind!r} (registered: {known}): {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UnknownEnvironmentKind(f"environment kind {kind!r}: {target!r} is not an Environment subclass")
    return cls


def build_environment(name: str, config: EnvConfig) -> Environment:
    """The configured environment `name`, ready to `start` episodes."""
    return resolve_kind(config.kind)(name, config)
