"""Run untrusted Python (model-written programs) in a sandbox process.

Every run gets: its own process (and session, so the whole group can be killed),
rlimits (CPU seconds, address space, file size, process count), a wall-clock
timeout, an empty environment, a fresh temporary working directory, bounded
captured output, and as much namespace isolation as the platform allows:

| platform | isolation |
|---|---|
| Linux, root (or CAP_SYS_ADMIN) | new network namespace (loopback only, down) + new PID namespace (the whole tree dies with its first process) + a fresh unprivileged uid per run (RLIMIT_NPROC then bounds that run alone, and it cannot signal or read other runs) |
| Linux, unprivileged user namespaces allowed | network + PID namespaces via a user namespace; same uid as the worker, so RLIMIT_NPROC is not set (it would count the worker's own processes) |
| elsewhere (macOS, locked-down containers) | rlimits, session kill, empty env, temp dir only: the program HAS network access. Set `require_isolation: true` to refuse to run instead |

`probe_isolation()` tells which one this host gets (cached; one `unshare` call).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

_UNSHARE = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
_USERNS = ["--user", "--map-root-user"]
# Per-run uids, far above any real account; distinct per worker process and run.
_UID_BASE = 2_000_000_000 + (os.getpid() % 100_000) * 1000
_uid_counter = itertools.count()

# Runs as the sandbox's first process: limits, drop the uid, then exec the program.
_BOOTSTRAP = """
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
for name, value in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + cfg["grace"].get(name, 0)))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
os.execve(cfg["python"], [cfg["python"], "-I", "-B", "main.py"], {})
"""


class Limits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_size_mb: int = 16
    nproc: int = 32  # processes + threads of the run's uid (root only; see the table above)
    output_bytes: int = 1 << 20  # per stream; more ends the run
    # Interpreter for the program. Under a fresh uid it must be reachable by an unprivileged
    # user: the system python3, not a venv under /root. Empty = the system python3 if any.
    python: str = ""


@dataclass(frozen=True)
class Isolation:
    network: bool
    pid_namespace: bool
    own_uid: bool

    @property
    def summary(self) -> str:
        parts = [name for name, on in (("netns", self.network), ("pidns", self.pid_namespace), ("uid", self.own_uid)) if on]
        return "+".join(parts) or "rlimits-only"


@dataclass(frozen=True)
class RunResult:
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool = False
    output_exceeded: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


@functools.lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """What this host gives a sandboxed run (tries the namespaces once)."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return Isolation(network=False, pid_namespace=False, own_uid=False)
    root = os.geteuid() == 0
    prefix = _UNSHARE if root else [*_UNSHARE[:1], *_USERNS, *_UNSHARE[1:]]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return Isolation(network=ok, pid_namespace=ok, own_uid=root)


def _command(isolation: Isolation, config: dict) -> list[str]:
    launcher = [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(config)]
    if not isolation.network:
        return launcher
    prefix = _UNSHARE if isolation.own_uid else [*_UNSHARE[:1], *_USERNS, *_UNSHARE[1:]]
    return [*prefix, "--", *launcher]


@functools.lru_cache(maxsize=8)
def sandbox_python(configured: str) -> str:
    if configured:
        return configured
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable


def _bootstrap_config(limits: Limits, uid: int | None) -> dict:
    rlimits = {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.file_size_mb << 20,
        "RLIMIT_CORE": 0,
    }
    if uid is not None:  # only a fresh uid makes the process count this run's alone
        rlimits["RLIMIT_NPROC"] = limits.nproc
    # CPU: SIGXCPU at the soft limit, SIGKILL one second later.
    return {"limits": rlimits, "grace": {"RLIMIT_CPU": 1}, "uid": uid, "python": sandbox_python(limits.python)}


async def run_python(source: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Run `source` as `main.py` in a fresh sandbox; never raises for what the program does."""
    isolation = probe_isolation()
    uid = _UID_BASE + next(_uid_counter) % 1000 if isolation.own_uid else None
    workdir = Path(tempfile.mkdtemp(prefix="sandbox-"))
    try:
        (workdir / "main.py").write_text(source)
        if uid is not None:
            for path in (workdir, workdir / "main.py"):
                os.chown(path, uid, uid)
        workdir.chmod(0o700)
        return await _run(_command(isolation, _bootstrap_config(limits, uid)), workdir, stdin, limits, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(command: list[str], workdir: Path, stdin: str, limits: Limits, uid: int | None) -> RunResult:
    proc = await asyncio.create_subprocess_exec(
        *command,
        cwd=workdir,
        env={},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group: one killpg ends the tree
    )
    stdout = _Capped(limits.output_bytes)
    stderr = _Capped(limits.output_bytes)
    timed_out = False
    try:
        await asyncio.wait_for(_communicate(proc, stdin, stdout, stderr), limits.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        _kill_tree(proc.pid, uid)
        returncode = await proc.wait()
    return RunResult(
        returncode=returncode,
        stdout=stdout.text(),
        stderr=stderr.text(),
        timed_out=timed_out,
        output_exceeded=stdout.exceeded or stderr.exceeded,
    )


class _Capped:
    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.exceeded = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.exceeded = True
        self.data += chunk[: max(room, 0)]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


async def _communicate(proc: asyncio.subprocess.Process, stdin: str, *sinks: _Capped) -> None:
    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(stdin.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # the program did not read its input
            pass

    async def drain(stream: asyncio.StreamReader | None, sink: _Capped) -> None:
        assert stream is not None
        while chunk := await stream.read(65536):
            sink.add(chunk)
            if sink.exceeded:  # stop a program that floods its output
                _kill_tree(proc.pid, None)
                return

    await asyncio.gather(feed(), drain(proc.stdout, sinks[0]), drain(proc.stderr, sinks[1]))
    await proc.wait()


def _kill_tree(pgid: int, uid: int | None) -> None:
    """SIGKILL the run's process group, and (fresh uid) every process of that uid.

    In a PID namespace the kernel kills the rest when its first process dies; the uid
    sweep catches children that left the group with setsid() when there is none.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        for pid in _pids_of_uid(uid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids
