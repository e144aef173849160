"""Run untrusted Python (model-written programs) in a sandbox process.

Every run gets: its own process (and session, so the whole group can be killed),
rlimits (CPU seconds, address space, file size, process count), a wall-clock
timeout, an empty environment (but for single-thread settings of BLAS libraries), a
fresh temporary working directory, bounded captured output, and as much namespace
isolation as the platform allows:

| level (`Isolation.summary`) | when | what the program gets |
|---|---|---|
| `netns+pidns+mntns+root+uid` | Linux, root (or CAP_SYS_ADMIN), `unshare` on PATH | new network namespace (loopback only, down: no TCP/UDP, no abstract unix sockets of the host) + new IPC namespace (no SysV IPC or POSIX message queues shared with the host or other runs) + new PID namespace with its own `/proc` (it sees its own processes only; the whole tree dies with the sandbox's init) + new mount namespace with a **private root**: one size-capped tmpfs (`tmpfs_mb`) holding `/tmp`, `/var/tmp`, `/run`, `/dev/shm`, read-only binds of `/usr` (and the interpreter's prefix when elsewhere), of the few files of `/etc` an interpreter reads (`_ETC`), `/dev/{null,zero,full,random,urandom}`, the run's work dir; the host's other files (the repository, /home, /opt, /work, data sets with expected outputs) are not there, nothing persists between runs, the host's unix sockets are gone + a fresh unprivileged uid per run (RLIMIT_NPROC then bounds that run alone; it cannot signal, trace or read other runs) + no_new_privs (setuid binaries give nothing) |
| `netns+pidns+mntns+root` | Linux, not root, unprivileged user namespaces allowed | the same via a user namespace (`--map-root-user`): the program is uid 0 of that namespace with every capability dropped (bounding set, locked securebits), so it cannot unmount its way out; as the worker's uid outside, it could write the worker's files if it could reach them, which the private root prevents. RLIMIT_NPROC is set on kernels >= 5.14, where it counts per user namespace (older kernels count every process of the worker's uid, so it is not set there) |
| `netns+pidns+mntns(+uid)` | the private root fails (no pivot_root number for this machine, a bind refused) | private size-capped tmpfs over `/tmp`, `/var/tmp`, `/dev/shm`, `/run` and an own `/proc` only: the host's other world-readable files are visible (a warning is logged) |
| `netns+pidns(+uid)` | the mount namespace or its tmpfs mounts are refused | as above without the private tmpfs and `/proc`: the host's `/tmp`, `/dev/shm`, `/run` and process list are visible (a warning is logged) |
| `rlimits-only` | macOS, locked-down containers, no `unshare` | rlimits, session kill, empty env, temp dir: the program HAS network access and sees the host's files and /proc. The code environment refuses to start below `netns+pidns+mntns+root` unless `require_isolation: false` |

`probe_isolation()` tells which one this host gets (cached; one trial run) and logs it once.

The sandbox's first process is `_BOOTSTRAP` (a tiny init): it makes the mounts, forks the
program's process (rlimits, uid drop, exec) and waits for it, then writes how the program
ended (exit code or signal, CPU seconds used) to a private status pipe. That is how a kill by
RLIMIT_CPU is reported as a CPU time limit rather than as `unshare`'s own error.

`run_python(source, stdin, limits)` runs `source` as `main.py` (stdin/stdout tests).
`run_python(source, limits=..., test=code)` runs it under `_HARNESS` (assert tests): see the
threat model there. A harness run passes only when the harness reports the per-run sentinel
over its private channel; the exit code alone never passes it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import msgspec

from pipeline.aio import wait_for

log = logging.getLogger(__name__)

_UNSHARE = ["unshare", "--net", "--ipc", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
_USERNS = ["--user", "--map-root-user"]
# Masked with a fresh tmpfs in every run (symlinks such as /var/run -> /run follow their target).
_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
# The program's whole environment. Single-threaded numeric libraries: a pool of BLAS threads
# started at import would count against RLIMIT_NPROC and fail the harness's no-threads check.
_PROGRAM_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Per-run uids, far above any real account; distinct per worker process and run.
_UID_BASE = 2_000_000_000 + (os.getpid() % 100_000) * 1000
_uid_counter = itertools.count()

# The sandbox's first process (pid 1 of its PID namespace when there is one). As root of the
# namespaces it mounts the private tmpfs, then forks the program's process, which sets the
# rlimits, drops to the run's uid and execs. The init stays behind only to reap, and writes
# the program's fate to the status pipe, which the program's process closes before exec.
# An init ignores signals it has no handler for when they come from inside its namespace,
# so the program cannot kill it to hide how it ended.
_BOOTSTRAP = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
status = cfg["status_fd"]
def report(kind, value, tb):  # the sandbox itself failed (a mount, the uid drop, exec): say so, not "exit 1"
    os.write(status, (json.dumps({"error": "%s: %s" % (kind.__name__, value)}) + "\n").encode())
    os._exit(125)
sys.excepthook = report
if cfg["mounts"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(source, target, fstype, flags, data):
        args = [None if x is None else x.encode() for x in (source, target, fstype, data)]
        if libc.mount(args[0], args[1], args[2], flags, args[3]) != 0:
            raise OSError(ctypes.get_errno(), "mount " + target)
    work = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    if cfg["root"]:
        # A new root: one size-capped tmpfs holding /tmp, /var/tmp, /run, /dev/shm, read-only
        # binds of what Python needs (/usr, the interpreter's prefix, some of /etc), a few device nodes,
        # its own /proc and the work dir; the host's other files (/work, /home, /opt, data sets)
        # are not in it. pivot_root, then the old root is detached: no way back to it.
        new = cfg["workdir"]  # the mount point (its files stay reachable through `work`): the host's /tmp stays
        # visible to this process until pivot_root, so an interpreter prefix under /tmp binds too
        mount("tmpfs", new, "tmpfs", 2 | 4, "size=%dk,mode=755" % cfg["tmpfs_kb"])
        def ro_bind(path):
            if os.path.isdir(path):
                os.makedirs(new + path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(new + path), exist_ok=True)
                open(new + path, "w").close()
            mount(path, new + path, None, 4096 | 16384, None)
            kept = os.statvfs(new + path).f_flag  # a user namespace may not clear the source's flags
            flags = 4096 | 32 | 1 | (kept & (2 | 4 | 8 | 1024 | 2048)) | ((1 << 21) if kept & 4096 else 0)
            mount(None, new + path, None, flags, None)
        for path in cfg["root_dirs"]:
            if os.path.isdir(path) and not os.path.exists(new + path):
                ro_bind(path)
        os.makedirs(new + "/etc", exist_ok=True)
        for name in sorted(os.listdir("/etc")):  # what an interpreter reads there; not the rest (configs, keys)
            if name in cfg["etc"] or name.startswith("python3"):
                path = "/etc/" + name
                if os.path.islink(path):
                    os.symlink(os.readlink(path), new + path)
                elif os.path.exists(path):
                    ro_bind(path)
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            if os.path.islink("/" + name):
                os.symlink(os.readlink("/" + name), new + "/" + name)
            elif os.path.isdir("/" + name):
                ro_bind("/" + name)
        for path in ("/tmp", "/var/tmp", "/run", "/dev/shm"):
            os.makedirs(new + path, exist_ok=True)
            os.chmod(new + path, 0o1777)
        for node in ("null", "zero", "full", "random", "urandom"):
            open(new + "/dev/" + node, "w").close()
            mount("/dev/" + node, new + "/dev/" + node, None, 4096, None)
        for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            os.symlink(target, new + "/dev/" + link)
        os.makedirs(new + "/proc")
        mount("proc", new + "/proc", "proc", 2 | 4 | 8, None)
        os.makedirs(new + cfg["workdir"], exist_ok=True)
        mount("/proc/self/fd/%d" % work, new + cfg["workdir"], None, 4096, None)
        os.mkdir(new + "/.old")
        os.chdir(new)
        if cfg["pivot_root"] is None or libc.syscall(cfg["pivot_root"], b".", b".old") != 0:
            raise OSError(ctypes.get_errno(), "pivot_root")
        os.chdir("/")
        if libc.umount2(b"/.old", 2) != 0:  # MNT_DETACH
            raise OSError(ctypes.get_errno(), "umount old root")
        os.rmdir("/.old")
    else:
        for target in cfg["tmpfs"]:
            if os.path.isdir(target):
                mount("tmpfs", os.path.realpath(target), "tmpfs", 2 | 4, "size=%dk,mode=1777" % cfg["tmpfs_kb"])
        os.makedirs(cfg["workdir"], exist_ok=True)  # the work dir lived under a path now masked: bind it back
        mount("/proc/self/fd/%d" % work, cfg["workdir"], None, 4096, None)
    os.close(work)
    os.chdir(cfg["workdir"])
pid = os.fork()
if pid == 0:
    os.set_inheritable(status, False)  # gone once exec succeeds; open until then to report a failure
    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value + cfg["grace"].get(name, 0)))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    elif cfg["mounts"]:  # root of a user namespace: no capabilities past exec (no umount, chroot, mount)
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last one)
        libc.prctl(28, 0x2F, 0, 0, 0)  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, all locked
    if cfg["mounts"]:
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries stay unprivileged
    os.execve(cfg["python"], [cfg["python"], "-I", "-B", *cfg["argv"]], cfg["env"])
for fd in cfg["program_fds"]:  # the program's alone (the harness channel)
    os.close(fd)
while True:
    try:
        reaped, code, usage = os.wait4(-1, 0)
    except ChildProcessError:
        break
    if reaped == pid:
        break
fate = {"cpu_s": usage.ru_utime + usage.ru_stime}
if os.WIFSIGNALED(code):
    fate["signal"] = os.WTERMSIG(code)
else:
    fate["exit"] = os.WEXITSTATUS(code)
os.write(status, (json.dumps(fate) + "\n").encode())
os._exit(fate.get("exit", 128 + fate.get("signal", 0)))
"""

# Runs assert tests against the program (argv: channel fd, program path, "pidns" or "-").
#
# Threat model. The program is adversarial and runs in this same interpreter, so the harness
# trusts nothing it can reach after the program's code first runs. The worker grants a pass only
# when the harness writes "pass <sentinel>" on the channel (a socket inherited as an fd), where
# the sentinel is a per-run secrets.token_hex that the worker sends, together with the test
# code, only after the harness said "ready", i.e. after the program was imported. Hence:
# - exit status means nothing: sys.exit(0), os._exit(0), atexit hooks, SystemExit raised from a
#   __del__, a signal handler or a timer all end the run without the sentinel (the harness ends
#   with os._exit right after "pass", so no atexit or finaliser runs after it either);
# - the tests are not in any file, argv, environment or memory of the sandbox while the
#   program's top level runs: open(__file__), inspect, sys.argv, /proc/self/cmdline and the
#   stack show the program and this harness, never the asserts, so a table of answers cannot
#   be built in advance;
# - before the tests run the harness takes back what the program may have planted: every other
#   process of the sandbox is killed (PID namespace), any extra thread fails the run, signal
#   handlers and interval timers are reset, trace/profile hooks cleared, builtins restored from
#   a copy taken before the import, gc callbacks dropped, the sys hooks reset; a new audit hook
#   cannot be added (the harness's own hook refuses it);
# - the channel fd is not inherited across exec, and the program's processes are gone before
#   the sentinel exists.
# What the "exec" mode does NOT stop (documented in docs/environments.md): the program shares
# this interpreter, so one written against this harness can impersonate it: find the channel
# fd (it is on the command line) and speak the protocol during its own import, or walk the
# stack (or use ctypes) from a function the test calls to reach the sentinel; and an object
# with a rigged __eq__ satisfies `assert f(x) == y`. Nothing inside one process can tell the
# harness's code from the program's. The "eval" mode closes this for asserts of one value:
# the harness only evaluates an expression and returns its value as plain data (exact builtin
# types, so no rigged __eq__ gets out); the worker compares it with an expected value that
# never enters the sandbox. Impersonating the harness then gains nothing: a forged reply
# still has to carry the right value.
_HARNESS = r"""
def _harness():
    # One function, no helpers: every function and module attribute used after the import is
    # taken here, before it, so a program that rebinds os.write or signal.signal changes nothing.
    import builtins, gc, json, os, signal, sys, threading, types
    fd, path, in_pidns = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "pidns"
    write, read, exit_, listdir, kill = os.write, os.read, os._exit, os.listdir, os.kill
    compile_, exec_, len_, type_, str_, int_, setattr_ = compile, exec, len, type, str, int, setattr
    settrace, setprofile, thread_settrace, thread_setprofile = sys.settrace, sys.setprofile, threading.settrace, threading.setprofile
    setitimer, set_handler, active_count = signal.setitimer, signal.signal, threading.active_count
    timers = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
    signals = [n for n in signal.valid_signals() if n not in (signal.SIGKILL, signal.SIGSTOP)]
    SIG_DFL, SIGKILL = signal.SIG_DFL, signal.SIGKILL
    gc_callbacks, builtins_dict, saved_builtins = gc.callbacks, builtins.__dict__, dict(builtins.__dict__)
    sys_hooks = [(name, getattr(sys, "__" + name + "__")) for name in ("excepthook", "displayhook", "stdin", "stdout", "stderr")]
    on_linux = sys.platform.startswith("linux")
    dumps, eval_, hex_, repr_, TypeError_ = json.dumps, eval, hex, repr, TypeError
    plain = {type(None): "n", bool: "b", int: "i", float: "f", complex: "c", str: "s", bytes: "y",
             list: "l", tuple: "t", set: "set", frozenset: "fset", dict: "d"}
    os.set_inheritable(fd, False)

    def encode(x, depth):  # plain data only, by exact type: a subclass or a rigged __eq__ does not get through
        tag = plain.get(type_(x))
        if tag is None or depth > 100:
            raise TypeError_("not plain data (" + str_(type_(x).__name__) + ")")
        if tag in ("n", "b", "s"):
            return [tag, x]
        if tag == "i":
            return [tag, hex_(x)]
        if tag == "f":
            return [tag, repr_(x)]
        if tag == "c":
            return [tag, repr_(x.real), repr_(x.imag)]
        if tag == "y":
            return [tag, x.hex()]
        if tag == "d":
            return [tag, [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(x)]]
        return [tag, [encode(v, depth + 1) for v in x]]

    def refuse_new_hooks(event, args):
        if event == "sys.addaudithook":
            raise RuntimeError("no audit hooks in the sandbox")

    sys.addaudithook(refuse_new_hooks)
    with open(path, "rb") as handle:
        source = handle.read()
    module = types.ModuleType("solution")  # imported, not run: `if __name__ == "__main__":` blocks stay out
    module.__file__ = os.path.abspath(path)
    module.__builtins__ = builtins
    sys.modules["solution"] = module
    sys.argv = [path]
    verdict, passed = b"", False
    try:
        exec_(compile_(source, path, "exec", dont_inherit=True), module.__dict__)
    except BaseException as exc:
        verdict = b"fail import: " + str_(type_(exc).__name__).encode("utf-8", "replace")
    if not verdict:  # take back what the program's top level may have planted
        settrace(None)
        setprofile(None)
        thread_settrace(None)
        thread_setprofile(None)
        for timer in timers:
            setitimer(timer, 0)
        for signum in signals:
            try:
                set_handler(signum, SIG_DFL)
            except (OSError, ValueError):
                pass
        gc_callbacks.clear()
        builtins_dict.clear()
        builtins_dict.update(saved_builtins)
        for name, value in sys_hooks:
            setattr_(sys, name, value)
        if in_pidns:
            try:
                kill(-1, SIGKILL)  # every other process of the sandbox (never its init)
            except OSError:
                pass
        if (len_(listdir("/proc/self/task")) if on_linux else active_count()) != 1:
            verdict = b"fail the program left threads running"
    if not verdict:
        message = b"ready\n"
        while message:
            message = message[write(fd, message):]
        header = b""
        while not header.endswith(b"\n"):
            chunk = read(fd, 1)
            if not chunk:
                exit_(1)
            header += chunk
        size, payload = int_(header), b""
        while len_(payload) < size:
            chunk = read(fd, size - len_(payload))
            if not chunk:
                exit_(1)
            payload += chunk
        sentinel, _, rest = payload.partition(b"\n")
        kind, _, test = rest.partition(b"\n")
        try:
            if kind == b"eval":
                value = eval_(compile_(test, "<test>", "eval", dont_inherit=True), module.__dict__)
                try:
                    verdict, passed = b"value " + dumps(encode(value, 0)).encode(), True
                except TypeError_ as exc:  # ours: encode raises nothing else, runs no code of the program
                    verdict = b"fail the value is " + str_(exc).encode("utf-8", "replace")
            else:
                exec_(compile_(test, "<test>", "exec", dont_inherit=True), module.__dict__)
                verdict, passed = b"pass " + sentinel, True
        except BaseException as exc:
            verdict = b"fail " + str_(type_(exc).__name__).encode("utf-8", "replace")
    if not passed:
        verdict = verdict[:300]
    verdict += b"\n"
    while verdict:
        verdict = verdict[write(fd, verdict):]
    exit_(0 if passed else 1)  # no atexit, no finalisers

_harness()
"""


class Limits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_size_mb: int = 16
    nproc: int = 32  # processes + threads of the run (see the table above for when it is set)
    output_bytes: int = 1 << 20  # per stream; more ends the run
    tmpfs_mb: int = 16  # the private root (all of /tmp, /var/tmp, /dev/shm, /run), or each masking tmpfs
    # Interpreter for the program. Under a fresh uid it must be reachable by an unprivileged
    # user: the system python3, not a venv under /root. Empty = the system python3 if any.
    python: str = ""


@dataclass(frozen=True)
class Isolation:
    network: bool
    pid_namespace: bool
    own_uid: bool
    mount_namespace: bool = False  # private /tmp, /var/tmp, /dev/shm, /run and /proc
    private_root: bool = False  # a new root: only /usr, /etc and the interpreter of the host's files
    nproc: bool = False  # RLIMIT_NPROC bounds the run's own processes

    @property
    def summary(self) -> str:
        parts = [
            name
            for name, on in (
                ("netns", self.network),
                ("pidns", self.pid_namespace),
                ("mntns", self.mount_namespace),
                ("root", self.private_root),
                ("uid", self.own_uid),
            )
            if on
        ]
        return "+".join(parts) or "rlimits-only"


@dataclass(frozen=True)
class RunResult:
    returncode: int  # the program's: negative = killed by that signal
    stdout: str
    stderr: str
    timed_out: bool = False
    output_exceeded: bool = False
    reason: str = ""  # why the program ended, when it did not exit by itself ("cpu time limit (SIGXCPU)")
    passed: Union[bool, None] = None  # `test` runs: the harness reported the run's sentinel
    harness: str = ""  # harness runs: what the harness said when it did not pass ("fail AssertionError", ...)
    value: Any = None  # `evaluate` runs: the expression's value (plain data)
    evaluated: bool = False  # `evaluate` runs: a value came back
    sandbox_error: str = ""  # the sandbox failed (not the program): the run says nothing about it

    @property
    def ok(self) -> bool:
        if self.passed is not None:
            return self.passed and not self.timed_out and not self.output_exceeded
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


def _kernel_counts_nproc_per_userns() -> bool:
    try:
        major, minor = (int(part) for part in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def _prefix(isolation: Isolation) -> list[str]:
    if not isolation.network:
        return []
    unshare = _UNSHARE if isolation.mount_namespace else _UNSHARE[:-2]
    return unshare if isolation.own_uid else [*unshare[:1], *_USERNS, *unshare[1:]]


@functools.lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """What this host gives a sandboxed run (one trial run of the real bootstrap, cached)."""
    none = Isolation(network=False, pid_namespace=False, own_uid=False)
    isolation = none
    if shutil.which("unshare") is not None and sys.platform.startswith("linux"):
        root = os.geteuid() == 0
        nproc = root or _kernel_counts_nproc_per_userns()
        # best first: a private root; tmpfs over the host's writable places; no mount namespace
        for mounts, private_root in ((True, True), (True, False), (False, False)):
            candidate = Isolation(
                network=True,
                pid_namespace=True,
                own_uid=root,
                mount_namespace=mounts,
                private_root=private_root,
                nproc=nproc,
            )
            if _trial(candidate):
                isolation = candidate
                break
    if isolation == none:
        log.warning(
            "code sandbox: isolation level rlimits-only (no usable `unshare` namespaces here): programs have "
            "network access and see the host's /tmp and /proc; the code environment refuses to start unless "
            "its options say require_isolation: false"
        )
    elif not isolation.mount_namespace:
        log.warning(
            "code sandbox: isolation level %s (no mount namespace here): programs share the host's /tmp, "
            "/var/tmp, /dev/shm, /run and see its /proc",
            isolation.summary,
        )
    elif not isolation.private_root:
        log.warning(
            "code sandbox: isolation level %s (no private root here): programs can read the host's "
            "world-readable files (data sets included) outside /tmp, /var/tmp, /dev/shm and /run",
            isolation.summary,
        )
    else:
        log.info("code sandbox: isolation level %s", isolation.summary)
    return isolation


def _trial(isolation: Isolation) -> bool:
    workdir = Path(tempfile.mkdtemp(prefix="sandbox-probe-"))
    read_end, write_end = os.pipe()
    try:
        (workdir / "main.py").write_text("import os\nprint(os.getcwd(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
        uid = _UID_BASE + 999 if isolation.own_uid else None
        if uid is not None:
            for path in (workdir, workdir / "main.py"):
                os.chown(path, uid, uid)
        config = _bootstrap_config(Limits(), uid, isolation, workdir, write_end, ["main.py"])
        command = [*_prefix(isolation), "--", sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(config)]
        done = subprocess.run(command, cwd=workdir, capture_output=True, timeout=20, env={}, pass_fds=(write_end,))
        expected = f"{workdir} [1, 2]" if isolation.mount_namespace else None  # its own /proc
        ok = done.returncode == 0 and (expected is None or done.stdout.decode().strip() == expected)
        if not ok:
            log.info("code sandbox: %s unavailable: %s", isolation.summary, done.stderr.decode(errors="replace")[-300:])
        return ok
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("code sandbox: %s unavailable: %s", isolation.summary, exc)
        return False
    finally:
        os.close(read_end)
        os.close(write_end)
        shutil.rmtree(workdir, ignore_errors=True)


# The private root's /etc: what the loader, the interpreter and time/user look-ups read (plus /etc/python3*).
_ETC = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives",
    "passwd", "group", "nsswitch.conf", "hosts", "host.conf", "os-release", "mime.types",
)
# pivot_root(2) has no libc wrapper: its syscall number per machine.
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}


@functools.lru_cache(maxsize=8)
def _root_dirs(python: str) -> list[str]:
    """What the private root binds read-only: /usr and the interpreter's prefix when elsewhere (/etc: `_ETC`)."""
    dirs = ["/usr"]
    for path in (python, os.path.realpath(python)):
        prefix = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if prefix not in ("/", "") and not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
            dirs.append(prefix)
    return dirs


@functools.lru_cache(maxsize=8)
def sandbox_python(configured: str) -> str:
    if configured:
        return configured
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable


def _bootstrap_config(
    limits: Limits,
    uid: Union[int, None],
    isolation: Isolation,
    workdir: Path,
    status_fd: int,
    argv: list[str],
    program_fds: tuple[int, ...] = (),
) -> dict:
    rlimits = {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.file_size_mb << 20,
        "RLIMIT_CORE": 0,
    }
    if isolation.nproc:  # a fresh uid, or a user namespace the kernel counts apart
        rlimits["RLIMIT_NPROC"] = limits.nproc
    # CPU: SIGXCPU at the soft limit, SIGKILL one second later.
    return {
        "limits": rlimits,
        "grace": {"RLIMIT_CPU": 1},
        "uid": uid,
        "python": sandbox_python(limits.python),
        "argv": argv,
        "status_fd": status_fd,
        "mounts": isolation.mount_namespace,
        "tmpfs": list(_TMPFS),
        "root": isolation.private_root,
        "root_dirs": _root_dirs(sandbox_python(limits.python)),
        "etc": list(_ETC),
        "pivot_root": _PIVOT_ROOT.get(platform.machine()),
        "tmpfs_kb": limits.tmpfs_mb << 10,
        "workdir": str(workdir),
        "env": dict(_PROGRAM_ENV),
        "program_fds": program_fds,
    }


async def run_python(
    source: str,
    stdin: str = "",
    limits: Limits = Limits(),
    test: Union[str, None] = None,
    evaluate: Union[str, None] = None,
) -> RunResult:
    """Run `source` in a fresh sandbox; never raises for what the program does.

    Without `test`/`evaluate`: as `main.py`, with `stdin`. Otherwise the harness imports the
    program (stdin empty), then, in its namespace, either runs `test` (statements, e.g.
    asserts): `RunResult.passed` says whether the harness reported this run's sentinel; or
    evaluates the expression `evaluate` and hands its value back as plain data
    (`RunResult.value`, `RunResult.evaluated`): None, bool, int, float, complex, str, bytes
    and lists, tuples, sets, frozensets and dicts of them, by exact type. The caller compares
    that value with an expected one that never enters the sandbox.
    """
    if test is not None and evaluate is not None:
        raise ValueError("run_python: test or evaluate, not both")
    request: Union[tuple[str, str], None] = None
    if test is not None:
        request = ("exec", test)
    elif evaluate is not None:
        request = ("eval", evaluate)
    isolation = probe_isolation()
    uid = _UID_BASE + next(_uid_counter) % 1000 if isolation.own_uid else None
    workdir = Path(tempfile.mkdtemp(prefix="sandbox-"))
    status_read, status_write = os.pipe()
    channel, child_end = socket.socketpair() if request is not None else (None, None)
    pending = [status_write, *([child_end.detach()] if child_end is not None else [])]  # the child's ends

    def release() -> None:  # once the child holds them (or never will): close our copies exactly once
        while pending:
            os.close(pending.pop())

    try:
        (workdir / "main.py").write_text(source)
        if uid is not None:
            for path in (workdir, workdir / "main.py"):
                os.chown(path, uid, uid)
        workdir.chmod(0o700)
        argv = ["main.py"]
        if request is not None:  # kill(-1) is only for a PID namespace: outside one it would reach the worker's processes
            argv = ["-c", _HARNESS, str(pending[-1]), "main.py", "pidns" if isolation.pid_namespace else "-"]
        config = _bootstrap_config(limits, uid, isolation, workdir, status_write, argv, tuple(pending[1:]))
        command = [*_prefix(isolation), *(["--"] if isolation.network else []), sys.executable, "-I", "-S", "-c", _BOOTSTRAP]
        command.append(json.dumps(config))
        return await _run(
            command,
            workdir,
            stdin if request is None else "",
            limits,
            uid,
            list(pending),
            release,
            status_read,
            channel,
            request,
            init_protected=isolation.pid_namespace,
        )
    finally:
        release()
        os.close(status_read)
        if channel is not None:
            channel.close()
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(
    command: list[str],
    workdir: Path,
    stdin: str,
    limits: Limits,
    uid: Union[int, None],
    pass_fds: list[int],
    release: Callable[[], None],
    status_read: int,
    channel: Union[socket.socket, None],
    request: Union[tuple[str, str], None],
    init_protected: bool = False,
) -> RunResult:
    proc = await asyncio.create_subprocess_exec(
        *command,
        cwd=workdir,
        env={},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group: one killpg ends the tree
        pass_fds=pass_fds,
    )
    release()  # the child holds them now; EOF on our ends follows its exit
    stdout = _Capped(limits.output_bytes)
    stderr = _Capped(limits.output_bytes)
    sentinel = secrets.token_hex(16)
    said = bytearray()
    jobs = [_communicate(proc, stdin, stdout, stderr)]
    if channel is not None and request is not None:
        jobs.append(_converse(channel, sentinel, request, said, limits.output_bytes + 4096))
    timed_out = False
    try:
        await wait_for(asyncio.gather(*jobs), limits.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        _kill_tree(proc.pid, uid)
        outer = await proc.wait()
    fate = _read_fate(status_read)
    returncode, reason = _explain(fate, outer, limits)
    # (without a protected init the program could forge that account: then it is the program's failure)
    sandbox_error = str(fate.get("error", ""))[:500] if init_protected else ""
    if not fate and init_protected and not timed_out and not (stdout.exceeded or stderr.exceeded):
        # a PID namespace's init cannot be killed from inside: no account means the sandbox broke
        sandbox_error = f"the sandbox's init reported nothing (exit {outer}): {stderr.text().strip()[-300:]}"
    if timed_out:
        reason = f"wall time limit ({limits.wall_s:g}s)"
    elif stdout.exceeded or stderr.exceeded:
        reason = f"output limit ({limits.output_bytes} bytes)"
    passed = harness = value = None
    evaluated = False
    if request is not None and request[0] == "eval":
        value, evaluated, harness = _read_value(bytes(said), returncode)
    elif request is not None:
        lines = bytes(said).decode("utf-8", errors="replace").splitlines()
        passed = lines == ["ready", f"pass {sentinel}"] and returncode == 0
        harness = lines[-1][:300] if lines and not passed else ""
        if not passed and lines[-1:] == [f"pass {sentinel}"]:
            harness = "harness protocol violated"
    return RunResult(
        returncode=returncode,
        stdout=stdout.text(),
        stderr=stderr.text(),
        timed_out=timed_out,
        output_exceeded=stdout.exceeded or stderr.exceeded,
        reason=reason,
        passed=passed,
        harness=harness or "",
        value=value,
        evaluated=evaluated,
        sandbox_error=sandbox_error,
    )


async def _converse(channel: socket.socket, sentinel: str, request: tuple[str, str], said: bytearray, cap: int) -> None:
    """Send the test and the sentinel once the harness says it imported the program; record its replies."""
    loop = asyncio.get_running_loop()
    channel.setblocking(False)
    sent = False
    while True:
        if len(said) >= cap:  # a reply this long is no answer: the harness's next write fails at once
            channel.shutdown(socket.SHUT_RDWR)
            return
        chunk = await loop.sock_recv(channel, 65536)
        if not chunk:
            return
        said += chunk
        if not sent and b"\n" in said:
            sent = True
            try:
                if bytes(said).startswith(b"ready\n"):
                    payload = f"{sentinel}\n{request[0]}\n{request[1]}".encode()
                    await loop.sock_sendall(channel, b"%d\n" % len(payload) + payload)
                else:  # not the harness's protocol: no test, no sentinel; EOF ends the harness's wait
                    channel.shutdown(socket.SHUT_WR)
            except OSError:
                return


def _read_value(said: bytes, returncode: int) -> tuple[Any, bool, str]:
    """(value, evaluated, why not) from an `evaluate` run's channel."""
    ready, _, rest = said.partition(b"\n")
    line, newline, extra = rest.partition(b"\n")
    if ready != b"ready":
        return None, False, (ready or b"the harness reported nothing").decode("utf-8", "replace")[:300]
    if line.startswith(b"value ") and not newline:
        return None, False, "the value is too large (limits.output_bytes)"
    if not line.startswith(b"value ") or not newline or extra or returncode != 0:
        return None, False, line.decode("utf-8", "replace")[:300] or "the harness reported nothing"
    try:
        return _decode(json.loads(line[6:]), 0), True, ""
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError, MemoryError):
        return None, False, "unreadable value"


def _decode(node: Any, depth: int) -> Any:
    """The harness's tagged plain data back into Python values (nothing else can come out)."""
    if depth > 100 or not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise ValueError("bad node")
    tag, args = node[0], node[1:]
    if tag == "n":
        return None
    if tag in ("b", "s"):
        if type(args[0]) is not (bool if tag == "b" else str):
            raise ValueError("bad scalar")
        return args[0]
    if tag == "i":
        return int(args[0], 16)
    if tag == "f":
        return float(args[0])
    if tag == "c":
        return complex(float(args[0]), float(args[1]))
    if tag == "y":
        return bytes.fromhex(args[0])
    items = args[0]
    if not isinstance(items, list):
        raise ValueError("bad container")
    if tag == "d":
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in items}
    values = [_decode(v, depth + 1) for v in items]
    kinds = {"l": list, "t": tuple, "set": set, "fset": frozenset}
    return kinds[tag](values)


def _read_fate(status_read: int) -> dict:
    """The init's account of how the program ended, and `error` when the sandbox itself failed
    ({} when there is none: the init was killed, or never ran)."""
    os.set_blocking(status_read, False)
    fate: dict = {}
    try:
        for line in os.read(status_read, 65536).splitlines():
            fate.update(json.loads(line))
    except (OSError, ValueError, TypeError):
        pass
    return fate


def _explain(fate: dict, outer: int, limits: Limits) -> tuple[int, str]:
    """(the program's return code, why it was stopped)."""
    if "exit" in fate:
        return int(fate["exit"]), ""
    if "signal" not in fate:
        return outer, "" if outer == 0 else "sandbox did not report the program's end"
    signum = int(fate["signal"])
    cpu = float(fate.get("cpu_s", 0.0))
    if signum == signal.SIGXCPU:
        return -signum, f"cpu time limit ({limits.cpu_s}s, SIGXCPU)"
    if signum == signal.SIGKILL and cpu >= limits.cpu_s:
        return -signum, f"cpu time limit ({limits.cpu_s}s; SIGKILL at the hard limit after {cpu:.1f}s)"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return -signum, f"killed by {name}"


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

    async def drain(stream: Union[asyncio.StreamReader, None], sink: _Capped) -> None:
        assert stream is not None
        while chunk := await stream.read(65536):
            sink.add(chunk)
            if sink.exceeded:  # stop a program that floods its output
                _kill_tree(proc.pid, None)
                return

    await asyncio.gather(feed(), drain(proc.stdout, sinks[0]), drain(proc.stderr, sinks[1]))
    await proc.wait()


def _kill_tree(pgid: int, uid: Union[int, None]) -> None:
    """SIGKILL the run's process group, and (fresh uid) every process of that uid.

    In a PID namespace the kernel kills the rest when its init dies; the uid
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
