"""Import a user-supplied object by dotted path: `package.module:name` or `package.module.name`."""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(target: str) -> Any:
    """The object at `target`; ValueError saying what failed when it cannot be imported."""
    module_name, _sep, attr = target.partition(":") if ":" in target else target.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{target!r} is not a dotted path (package.module:name)")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {target!r}: {exc}") from exc
