"""The house's one rule of imports: they run down, never up.

    scripts/    CLI, launchers, benchmarks        may import everything below
    producers/  tasks in, admission                may import workers/ and pipeline/
    workers/    episodes: engine, environments     may import pipeline/
    pipeline/   contracts every side shares        imports none of the three above

producers/ sits above workers/: they check tasks against the configured environments with the
workers' own code (`workers.validate`, `workers.envs.convert`); workers import nothing of
producers. Every module is read as source (nothing is imported), and every way one module can
reach another counts: an import statement at any depth (a lazy one inside a function too), a
relative one, `importlib.import_module(...)` / `__import__(...)` with a literal name, and a
dotted name in a string that names a module of this tree (`"workers.envs.plugins:X"`, as a
registry or slime's `--*-path` flags load them). Docstrings are prose and are not read.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("pipeline", "workers", "producers", "scripts")  # bottom to top
RANK = {name: i for i, name in enumerate(LAYERS)}
# a dotted name inside a string: `a.b.c`, optionally `:attr`; not part of a longer dotted run
DOTTED = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
IMPORT_CALLS = frozenset({"import_module", "__import__"})


@dataclass(frozen=True)
class Reference:
    source: str  # the importing module's path, relative to the root
    line: int
    target: str  # the module named
    how: str  # import | call | string

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target} ({self.how})"


def module_exists(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def named_module(root: Path, dotted: str) -> str | None:
    """The longest prefix of `dotted` that is a module below a layer package (`workers.x.y:Z` ->
    `workers.x.y`); None for a dotted name that only starts like one (`workers.dead_after_s`, a
    config key)."""
    parts = dotted.split(".")
    if parts[0] not in RANK:
        return None
    for end in range(len(parts), 1, -1):
        prefix = ".".join(parts[:end])
        if module_exists(root, prefix):
            return prefix
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _relative(module: str | None, level: int, package: str) -> str:
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in IMPORT_CALLS and call.args and isinstance(call.args[0], ast.Constant):
        value = call.args[0].value
        return value if isinstance(value, str) else None
    return None


def references(root: Path, path: Path) -> list[Reference]:
    """Every module of the layers that `path` names: imports, import calls, dotted strings."""
    source = path.relative_to(root).as_posix()
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    read = _docstrings(tree)  # string constants not to read as dotted names
    found: list[Reference] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [Reference(source, line, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _relative(node.module, node.level, package) if node.level else (node.module or "")
            found.append(Reference(source, line, name, "import"))
        elif isinstance(node, ast.Call) and (name := _call_name(node)) is not None:
            found.append(Reference(source, line, name, "call"))
            read.add(id(node.args[0]))  # (ast.walk visits the call before its argument)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in read:
            for match in DOTTED.finditer(node.value):
                target = named_module(root, match.group(1))
                if target is not None:
                    found.append(Reference(source, line, target, "string"))
    return [r for r in found if r.target.split(".")[0] in RANK]


def upward(root: Path) -> list[Reference]:
    """The references that run from a lower layer to a higher one."""
    bad = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            bad += [r for r in references(root, path) if RANK[r.target.split(".")[0]] > RANK[layer]]
    return bad


def test_imports_run_down_only():
    bad = upward(REPO)
    assert not bad, "imports that run up (order: " + " < ".join(LAYERS) + "):\n" + "\n".join(map(str, bad))


def test_every_way_up_is_seen(tmp_path):
    """The walker itself: each way a module can reach an upper one is reported, and what only
    looks like one (a config key, a docstring, a downward or sibling name) is not."""
    for layer in LAYERS:
        (tmp_path / layer / "sub").mkdir(parents=True)
        (tmp_path / layer / "__init__.py").write_text("")
        (tmp_path / layer / "sub" / "__init__.py").write_text("")
        (tmp_path / layer / "sub" / "mod.py").write_text("")
    (tmp_path / "pipeline" / "sub" / "bad.py").write_text(
        '"""A docstring may say workers.sub.mod."""\n'
        "import importlib\n"
        "import workers.sub.mod\n"
        "from producers.sub import mod\n"
        "def lazy():\n"
        "    from scripts.sub.mod import thing\n"
        "    importlib.import_module('workers.sub.mod')\n"
        "    __import__('scripts.sub')\n"
        "    return ('workers.sub.mod:Thing', f'see producers.sub.mod.x {thing}', 'workers.timeout_s')\n"
        "from . import mod as sibling\n"
        "from ..sub import mod as same\n"
        "KIND = 'pipeline.sub.mod:Thing'\n"
    )
    (tmp_path / "producers" / "sub" / "fine.py").write_text(
        "import workers.sub.mod\nfrom pipeline.sub import mod\nfrom .. import sub\nPATH = 'workers.sub.mod.x'\n"
    )
    (tmp_path / "workers" / "sub" / "up.py").write_text("def f():\n    from producers.sub import mod\n")
    found = sorted(str(r) for r in upward(tmp_path))
    assert found == [
        "pipeline/sub/bad.py:3 -> workers.sub.mod (import)",
        "pipeline/sub/bad.py:4 -> producers.sub (import)",
        "pipeline/sub/bad.py:6 -> scripts.sub.mod (import)",
        "pipeline/sub/bad.py:7 -> workers.sub.mod (call)",
        "pipeline/sub/bad.py:8 -> scripts.sub (call)",
        "pipeline/sub/bad.py:9 -> producers.sub.mod (string)",
        "pipeline/sub/bad.py:9 -> workers.sub.mod (string)",
        "workers/sub/up.py:2 -> producers.sub (import)",
    ]
