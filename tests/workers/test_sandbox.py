"""The sandbox (`workers/envs/sandbox.py`), probed by programs that try to get out.

Every probe prints "blocked ..." when the sandbox held and "ESCAPED ..." when it did not.
Probes that need a namespace are skipped where `probe_isolation()` says this host has none
(the skip reason names the level in effect), except under ROLLOUT_REQUIRE_SANDBOX=1 (CI), where
they run and fail (tests/support/sandbox_support.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import uuid

from pipeline.config import EnvConfig
from pipeline.schema import Task
from tests.support.sandbox_support import ISOLATION, needs
from workers.envs.base import EpisodeRecord, MeasurementFailed
from workers.envs.math import MathEnvironment, MathOptions
from workers.envs.sandbox import _ETC, Limits, run_python

FAST = Limits(wall_s=5.0, cpu_s=1, memory_mb=256, nproc=16)
# skipped locally where this host lacks them; run (and failing) under ROLLOUT_REQUIRE_SANDBOX=1
needs_mounts = needs(ISOLATION.mount_namespace, "no private mount namespace here")
needs_root = needs(ISOLATION.private_root, "no private root here")
needs_netns = needs(ISOLATION.network, "no network namespace here")


async def test_passing_and_failing_programs():
    ok = await run_python("print(input()[::-1])", "abc\n", FAST)
    assert ok.ok and ok.stdout.strip() == "cba"
    bad = await run_python("raise SystemExit(3)", "", FAST)
    assert bad.returncode == 3 and not bad.ok


async def test_empty_environment_and_private_temp_dir():
    result = await run_python("import os, sys; print(sorted(os.environ)); print(os.getcwd())", "", FAST)
    env_names, cwd = result.stdout.strip().splitlines()
    assert "PATH" not in env_names and "HOME" not in env_names
    assert "'OPENBLAS_NUM_THREADS'" in env_names  # BLAS thread pools would trip the harness's no-threads check
    assert os.path.basename(cwd).startswith("sandbox-") and not os.path.exists(cwd)  # removed afterwards


# ------------------------------------------------------------------ filesystem: nothing shared, nothing kept


@needs_mounts
async def test_tmp_var_tmp_and_dev_shm_are_private_to_each_run():
    name = f"probe-{uuid.uuid4().hex}"
    writer = (
        "for d in ('/tmp', '/var/tmp', '/dev/shm', '/run'):\n"
        f"    open(d + '/{name}', 'w').write('secret')\n"
        "print('written')\n"
    )
    reader = (
        "import os\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', '/run'):\n"
        f"    print('ESCAPED' if os.path.exists(d + '/{name}') else 'blocked', d)\n"
    )
    first = await run_python(writer, "", FAST)
    assert first.stdout.strip() == "written", first
    second = await run_python(reader, "", FAST)
    assert second.stdout.split() == ["blocked", "/tmp", "blocked", "/var/tmp", "blocked", "/dev/shm", "blocked", "/run"], second
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run"):  # nor did it land on the host
        assert not os.path.exists(f"{folder}/{name}")


@needs_mounts
async def test_the_hosts_tmp_files_are_not_visible():
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="host-secret-") as handle:
        os.chmod(handle.name, 0o644)  # permissions would let any uid read it: only the mount hides it
        program = f"import os\nprint('ESCAPED' if os.path.exists({handle.name!r}) else 'blocked', sorted(os.listdir('/tmp')))"
        result = await run_python(program, "", FAST)
    assert result.stdout.startswith("blocked"), result


@needs_mounts
async def test_private_tmpfs_is_size_capped():
    program = (
        "try:\n"
        "    with open('/dev/shm/fill', 'wb') as f:\n"
        "        for _ in range(64):\n"
        "            f.write(b'x' * (1 << 20))\n"
        "    print('ESCAPED')\n"
        "except OSError as exc:\n"
        "    print('blocked', exc.errno)\n"
    )
    result = await run_python(program, "", Limits(tmpfs_mb=4, file_size_mb=128))
    assert result.stdout.startswith("blocked"), result


@needs_root
async def test_the_hosts_other_files_are_not_in_the_sandbox():
    # a data set left world-readable on the host (its expected outputs would be a reward hack)
    folder = tempfile.mkdtemp(dir="/var/lib", prefix="sandbox-probe-")
    data = os.path.join(folder, "tasks.jsonl")
    with open(data, "w") as handle:
        handle.write('{"input": "1", "output": "2"}\n')
    os.chmod(folder, 0o755)
    os.chmod(data, 0o644)
    here = os.path.abspath(__file__)  # this repository
    program = (
        "import os\n"
        f"for path in ({data!r}, {here!r}, '/home', '/opt', '/root', '/srv'):\n"
        "    try:\n"
        "        seen = bool(os.listdir(path)) if os.path.isdir(path) else os.path.exists(path)\n"
        "    except OSError:\n"
        "        seen = False\n"
        "    print('ESCAPED' if seen else 'blocked', path)\n"
        "print(sorted(os.listdir('/')))\n"
        "print(sorted(os.listdir('/etc')))\n"
    )
    try:
        result = await run_python(program, "", FAST)
    finally:
        os.unlink(data)
        os.rmdir(folder)
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[:-2]] == ["blocked"] * 6, result
    assert set(eval(lines[-2])) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "tmp", "usr", "var"}
    etc = set(eval(lines[-1]))  # what an interpreter needs, not the host's configuration
    assert "shadow" not in etc and etc - {name for name in etc if name.startswith("python3")} <= set(_ETC)


@needs_root
async def test_system_dirs_are_read_only_and_setuid_gives_nothing():
    program = (
        "import os\n"
        "for path in ('/usr/sandbox-probe', '/etc/sandbox-probe'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('ESCAPED', path)\n"
        "    except OSError as exc:\n"
        "        print('blocked', exc.errno)\n"
        "status = open('/proc/self/status').read()\n"
        "print('blocked' if 'NoNewPrivs:\\t1' in status else 'ESCAPED', 'no_new_privs')\n"
        "caps = [l.split()[1] for l in status.splitlines() if l.startswith(('CapEff', 'CapPrm', 'CapBnd'))]\n"
        "print('blocked' if os.getuid() != 0 or set(caps) == {'0000000000000000'} else 'ESCAPED', 'capabilities', caps)\n"
    )
    result = await run_python(program, "", FAST)
    assert [line.split()[0] for line in result.stdout.strip().splitlines()] == ["blocked"] * 4, result


# ------------------------------------------------------------------ processes: its own /proc, nothing of the host


@needs_mounts  # its own /proc needs the PID and the mount namespace
async def test_proc_lists_only_the_sandboxs_own_processes():
    program = (
        "import os\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print(pids)\n"
        f"print('ESCAPED' if os.path.exists('/proc/{os.getpid()}/environ') else 'blocked')\n"
    )
    result = await run_python(program, "", FAST)
    pids, verdict = result.stdout.strip().splitlines()
    assert pids == "[1, 2]"  # the sandbox's init and the program
    assert verdict == "blocked"


@needs_mounts
async def test_the_init_is_the_sandboxs_not_the_hosts():
    program = "print(open('/proc/1/cmdline', 'rb').read().split(b'\\0')[:3])"
    result = await run_python(program, "", FAST)
    assert "-I" in result.stdout and "worker" not in result.stdout  # our bootstrap, not the host's pid 1


@needs_mounts
async def test_network_and_ipc_namespaces_are_not_the_hosts():
    program = "import os\nfor ns in ('net', 'ipc', 'pid', 'mnt'):\n    print(os.readlink('/proc/self/ns/' + ns))"
    result = await run_python(program, "", FAST)
    inside = result.stdout.split()
    outside = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "ipc", "pid", "mnt")]
    assert len(inside) == 4 and all(a != b for a, b in zip(inside, outside)), (inside, outside)


# ------------------------------------------------------------------ network: no TCP, no host unix sockets

_CONNECT = (
    "import socket\n"
    "family, address = {family}, {address!r}\n"
    "try:\n"
    "    s = socket.socket(family, socket.SOCK_STREAM)\n"
    "    s.settimeout(2)\n"
    "    s.connect(address)\n"
    "    print('ESCAPED', s.recv(16))\n"
    "except OSError as exc:\n"
    "    print('blocked', exc.errno, exc)\n"
)


async def _serve(sock: socket.socket):
    async def greet(reader, writer):
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(greet, sock=sock)


@needs_netns
async def test_tcp_to_a_loopback_server_of_the_host_is_refused():
    listener = socket.create_server(("127.0.0.1", 0))
    server = await _serve(listener)
    try:
        port = listener.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        result = await run_python(_CONNECT.format(family="socket.AF_INET", address=("127.0.0.1", port)), "", FAST)
        outside = await run_python(_CONNECT.format(family="socket.AF_INET", address=("1.1.1.1", 53)), "", FAST)
    finally:
        server.close()
    assert result.stdout.startswith("blocked"), result
    assert outside.stdout.startswith("blocked"), outside


@needs_mounts
async def test_a_host_unix_socket_in_tmp_is_unreachable():
    folder = tempfile.mkdtemp(dir="/tmp", prefix="host-sock-")
    path = os.path.join(folder, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    os.chmod(folder, 0o777)
    os.chmod(path, 0o777)  # any uid may connect: only the mount namespace stands in the way
    server = await _serve(listener)
    try:
        result = await run_python(_CONNECT.format(family="socket.AF_UNIX", address=path), "", FAST)
    finally:
        server.close()
        os.unlink(path)
        os.rmdir(folder)
    assert result.stdout.startswith("blocked"), result


@needs_netns
async def test_a_host_abstract_unix_socket_is_unreachable():
    name = f"\0sandbox-probe-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen()
    server = await _serve(listener)
    try:
        result = await run_python(_CONNECT.format(family="socket.AF_UNIX", address=name), "", FAST)
    finally:
        server.close()
    assert result.stdout.startswith("blocked"), result


# ------------------------------------------------------------------ runaway programs are stopped


async def test_cpu_loop_is_stopped_by_the_cpu_limit_and_reported_as_such():
    started = time.monotonic()
    # a generous wall clock (the machine may be busy): only RLIMIT_CPU can end the spin
    spin = await run_python("while True: pass", "", Limits(cpu_s=1, wall_s=60.0))
    assert not spin.ok and not spin.timed_out
    assert spin.reason.startswith("cpu time limit"), spin
    assert "unshare" not in spin.stderr
    sleeper = await run_python("import time; time.sleep(60)", "", Limits(wall_s=1.0))
    assert sleeper.timed_out and not sleeper.ok and sleeper.reason.startswith("wall time limit")
    assert time.monotonic() - started < 70  # bounded, not a speed goal


async def test_cpu_limit_ignoring_sigxcpu_is_killed_at_the_hard_limit():
    program = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    result = await run_python(program, "", Limits(cpu_s=1, wall_s=60.0))
    assert not result.ok and not result.timed_out
    assert result.reason.startswith("cpu time limit") and "SIGKILL" in result.reason, result


async def test_memory_bomb_is_stopped():
    result = await run_python("x = bytearray(1 << 31)\nprint('ESCAPED')", "", FAST)
    assert "ESCAPED" not in result.stdout and "MemoryError" in result.stderr


async def test_file_size_limit():
    result = await run_python("open('big', 'wb').write(b'x' * (32 << 20))", "", Limits(file_size_mb=1))
    assert not result.ok and "File too large" in result.stderr


async def test_an_oversized_value_is_stopped():
    result = await run_python("def f():\n    return 'x' * (4 << 20)", "", Limits(output_bytes=1 << 20), evaluate="f()")
    assert not result.evaluated and "too large" in result.harness and not result.timed_out


async def test_output_flood_is_stopped():
    result = await run_python("while True: print('x' * 1000)", "", Limits(output_bytes=10_000))
    assert result.output_exceeded and len(result.stdout) <= 10_000 and result.reason.startswith("output limit")


@needs(ISOLATION.nproc, "RLIMIT_NPROC per run not available")
async def test_fork_bomb_is_stopped_and_its_children_die():
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid(); time.sleep(60)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    print('blocked at', n)\n"
    )
    result = await run_python(bomb, "", FAST)
    assert "blocked at" in result.stdout, result
    assert int(result.stdout.split()[-1]) < FAST.nproc
    # every forked sleeper was killed with the run (PID namespace / uid sweep); the kernel
    # tears a namespace's processes down asynchronously, so allow it a moment (they sleep 60 s)
    deadline = time.monotonic() + 10
    while (leftovers := _sandbox_pids()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert leftovers == []


def _sandbox_pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) >= 2_000_000_000]


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


# ------------------------------------------------------------------ untrusted answers never stall the event loop
# (math: issue 12 item 10; here with the other "adversarial input vs. the worker" checks)


async def test_math_checks_default_to_the_process_pool_and_an_adversarial_answer_does_not_stall_the_loop():
    assert MathOptions().check_in == "process"
    env = MathEnvironment("m", EnvConfig(kind="math", options={"processes": 1, "parse_timeout_s": 2}))
    assert env.options.check_in == "process"
    task = Task(id="slow", env="m", prompt="?", label="3")
    answer = "\\boxed{(x+1)^{2000}}"  # sympy expands it for seconds: inline, the loop would stall that long
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": answer}]
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        started = time.monotonic()
        session = await env.start(task)
        try:
            verification = await session.verify(EpisodeRecord(task=task, messages=messages, response_text=answer, turns=1))
            reward: float | None = verification.reward
        except MeasurementFailed as undecided:  # sympy ran past math-verify's 2 s: undecided, never a 0
            assert "math-verify gave up: timed out" in str(undecided)
            reward = None
        took = time.monotonic() - started
    finally:
        ticking.cancel()
        await env.aclose()
    assert reward in (0.0, None)  # wrong when decided; a failed measurement when math-verify gave up
    assert took > 1.0  # the check really was slow (inline, the loop would stall that whole time) ...
    assert max(gaps) < took / 3, (max(gaps), took)  # ... and the loop went on meanwhile (loose: CI may be busy)
