"""`rollout <command>`: one entry point; each command lives in its own module.

Commands are resolved by dotted path when invoked, so `rollout --help` imports
nothing heavy and no package imports another at module load.
"""

from __future__ import annotations

import importlib
import sys

# command -> ("module:function", one-line help). The function takes argv (list[str]).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("workers.demo:main", "run the whole pipeline on this machine with embedded defaults"),
    "prepare": ("producers.prepare_tasks:main", "build tasks.jsonl from datasets and environments"),
    "enqueue": ("producers.enqueue:main", "admit tasks as prompt jobs under the staleness bound"),
    "workers": ("workers.pool:main", "start a pool of worker processes"),
    "engine": ("workers.sim.engine:main", "serve the simulated SGLang engine (for demos and tests)"),
    "monitor": ("pipeline.monitor:main", "watch queue depth, buffer, workers, staleness"),
    "bench": ("scripts.bench:main", "benchmarks with ratios against their baselines"),
    "smoke": ("pipeline.smoke:main", "push synthetic groups through the buffer into the slime data source"),
    "ledger": ("pipeline.ledger:main", "list, summarise, export or re-score the ledger of trained groups"),
    "show": ("pipeline.show:main", "render a trained episode (ledger) or a dead letter as a conversation"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: rollout <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_target, help_) in COMMANDS.items()]
    lines += ["", "Run `rollout <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rollout: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"rollout {name}: not available in this build ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    result = getattr(module, func_name)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
