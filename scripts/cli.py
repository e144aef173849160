"""`rollout <command>`: one entry point; each command lives in its own module.

Commands are resolved by dotted path when invoked, so `rollout --help` imports
nothing heavy and no package imports another at module load.

One error boundary for every command: an ordinary mistake prints one line, `rollout
<command>: <what and where>`, and exits with the code of its class; `--debug` (anywhere
on the line, or `ROLLOUT_DEBUG=1`) prints the traceback too.

| exit | class |
|---|---|
| 0 | done |
| 1 | internal error (a bug: the line says so; `--debug` for the traceback) |
| 2 | usage or configuration: bad flag, bad config key or value, bad tasks file, unknown kind |
| 3 | connection: Redis or the engine unreachable, authentication refused |
| 4 | a check ran and its verdict is FAIL (`rollout check-signal`) |
| 5 | a check cannot run on this machine (`rollout check-signal`: torch, slime's snapshot or megatron-core missing): nothing checked |
| 130 | interrupted (Ctrl-C) |
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import traceback

from pipeline.usage import ENV_DEBUG  # one name for the switch: commands that report their own errors read it

# transformers without PyTorch logs "PyTorch was not found. Models won't be available..." when it
# is first imported (by the commands that load a tokenizer: engine, workers, demo, show), though
# only its tokenizers are used here. That line is one of transformers' "advisory" warnings, which
# its own TRANSFORMERS_NO_ADVISORY_WARNINGS switches off, and nothing else: its other warnings
# and errors still show. Set before any import of transformers; child processes inherit it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2  # usage or configuration
EXIT_CONNECTION = 3  # Redis / engine unreachable, authentication
EXIT_INTERRUPTED = 130

DIST_NAME = "rollout-pipeline"

# command -> ("module:function", one-line help). The function takes argv (list[str]).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("scripts.demo:main", "run the whole pipeline on this machine with embedded defaults"),
    "prepare": ("producers.prepare_tasks:main", "build tasks.jsonl from datasets and environments"),
    "enqueue": ("producers.enqueue:main", "admit tasks as prompt jobs under the staleness bound"),
    "workers": ("workers.pool:main", "start a pool of worker processes"),
    "engine": ("workers.sim.engine:main", "serve the simulated SGLang engine (for demos and tests)"),
    "monitor": ("scripts.monitor:main", "watch queue depth, buffer, workers, staleness"),
    "bench": ("scripts.bench:main", "benchmarks with ratios against their baselines"),
    "plan": ("scripts.bench.sizing:main", "the groups per step (B) that keep the engines full at eta, from the bound's ideal"),
    "smoke": ("scripts.smoke:main", "push synthetic groups through the buffer into the slime data source"),
    "ledger": ("workers.rescore:ledger_main", "list, summarise, export or re-score the ledger of trained groups"),
    "check-signal": ("scripts.check_signal:main", "check on a CPU that your configuration hands the trainer an aligned training signal a policy learns from"),
    "show": ("pipeline.ops.show:main", "render a trained episode (ledger) or a dead letter as a conversation"),
    "rm-server": ("workers.rm_server:main", "serve slime's remote reward model (--rm-url, behind $ROLLOUT_RM_TOKEN off loopback) with the configured environments"),
}


def version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version(DIST_NAME)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: rollout [--version] [--debug] <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_target, help_) in COMMANDS.items()]
    lines += [
        "",
        "Run `rollout <command> --help` for a command's options.",
        "Redis and namespace: --redis-url/--namespace > $ROLLOUT_REDIS_URL/$ROLLOUT_NAMESPACE > config > defaults.",
        "Exit codes: 0 done, 1 internal error, 2 usage or configuration, 3 Redis/engine unreachable, 130 interrupted.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ error classes


def _is_usage_error(exc: BaseException) -> bool:
    from pipeline.config import ConfigError

    if isinstance(exc, ConfigError):
        return True
    mod = type(exc).__module__
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "msgspec" in mod and "ValidationError" in names:
        return True
    if names & {"UnknownEnvironmentKind", "PrepareError", "SchemaError"}:
        return True
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return True  # a path given on the command line or in the config
    return False


def _is_connection_error(exc: BaseException) -> bool:
    try:
        from redis.exceptions import AuthenticationError
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        if isinstance(exc, (RedisConnectionError, RedisTimeoutError, AuthenticationError)):
            return True
        from redis.exceptions import ResponseError

        if isinstance(exc, ResponseError) and any(
            word in str(exc) for word in ("NOAUTH", "WRONGPASS", "invalid password", "invalid username")
        ):
            return True
    except ImportError:  # pragma: no cover - redis is a dependency
        pass
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"ClientConnectorError", "ServerDisconnectedError", "ClientConnectionError", "EngineUnavailable",
                "RedisUnavailable", "ConnectTimeoutError"}:
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                                                  errno.ETIMEDOUT, errno.ECONNRESET):
        return True
    return False


def classify(exc: BaseException) -> int:
    """The exit code of an exception that reached the boundary."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if _is_connection_error(exc):
        return EXIT_CONNECTION
    if _is_usage_error(exc):
        return EXIT_USAGE
    return EXIT_INTERNAL


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text


def describe(exc: BaseException, code: int) -> str:
    """What went wrong, redacted (a password in a URL never reaches the terminal)."""
    from pipeline.store.redis_conn import redact

    text = _first_line(exc)
    if code == EXIT_CONNECTION:
        text = f"cannot connect: {text}"
        if "AuthenticationError" in {c.__name__ for c in type(exc).__mro__} or any(
            word in text for word in ("AuthenticationError", "WRONGPASS", "NOAUTH")
        ):
            text += " (check the password in $ROLLOUT_REDIS_URL)"
    elif code == EXIT_INTERNAL:
        text = f"internal error: {type(exc).__name__}: {text} (rerun with --debug for the traceback)"
    return _redact_urls(text, redact)


def _redact_urls(text: str, redact: object) -> str:
    import re

    return re.sub(r"\b(rediss?|unix)://\S+", lambda m: redact(m.group(0)), text)  # type: ignore[operator]


def _report(command: str, exc: BaseException, debug: bool) -> int:
    code = classify(exc)
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if code == EXIT_INTERRUPTED:
        print(f"rollout {command}: interrupted", file=sys.stderr)
    else:
        print(f"rollout {command}: {describe(exc, code)}", file=sys.stderr)
    return code


# ------------------------------------------------------------------ entry point


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(ENV_DEBUG, "") not in ("", "0")
    if "--debug" in argv:  # anywhere on the line: no command defines its own
        argv = [a for a in argv if a != "--debug"]
        debug = True
        os.environ[ENV_DEBUG] = "1"  # child processes (the worker pool) show tracebacks too
    if not argv:
        print(_usage(), file=sys.stderr)
        return EXIT_USAGE
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return EXIT_OK
    if argv[0] in ("-V", "--version", "version"):
        print(f"rollout {version()}")
        return EXIT_OK
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rollout: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_USAGE
    module_name, func_name = COMMANDS[name][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"rollout {name}: not available in this build ({module_name} is missing)", file=sys.stderr)
            return EXIT_USAGE
        return _report(name, exc, debug)
    try:
        result = getattr(module, func_name)(rest)
    except SystemExit as exc:  # argparse: 2 with its own message; a command's sys.exit(n)
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
    except BaseException as exc:  # noqa: BLE001 - the boundary
        if isinstance(exc, GeneratorExit):
            raise
        return _report(name, exc, debug)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
