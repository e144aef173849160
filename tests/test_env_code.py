"""`code` environment and its sandbox: passing, failing, runaway programs contained."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, EpisodeRecord
from workers.envs.code import CodeEnvironment, extract_program
from workers.envs.sandbox import Limits, probe_isolation, run_python

FAST = Limits(wall_s=3.0, cpu_s=1, memory_mb=256, nproc=16)
ISOLATION = probe_isolation()


async def test_passing_and_failing_programs():
    ok = await run_python("print(input()[::-1])", "abc\n", FAST)
    assert ok.ok and ok.stdout.strip() == "cba"
    bad = await run_python("raise SystemExit(3)", "", FAST)
    assert bad.returncode == 3 and not bad.ok


async def test_empty_environment_and_private_temp_dir():
    result = await run_python("import os, sys; print(sorted(os.environ)); print(os.getcwd())", "", FAST)
    env_names, cwd = result.stdout.strip().splitlines()
    assert "PATH" not in env_names and "HOME" not in env_names
    assert os.path.basename(cwd).startswith("sandbox-") and not os.path.exists(cwd)  # removed afterwards


async def test_infinite_loop_is_killed_by_the_cpu_limit_and_sleep_by_the_wall_clock():
    started = time.monotonic()
    # a generous wall clock (the machine may be busy): only RLIMIT_CPU can end the spin
    spin = await run_python("while True: pass", "", Limits(cpu_s=1, wall_s=60.0))
    assert not spin.ok and not spin.timed_out
    sleeper = await run_python("import time; time.sleep(60)", "", Limits(wall_s=1.0))
    assert sleeper.timed_out and not sleeper.ok
    assert time.monotonic() - started < 70  # bounded, not a speed goal


async def test_memory_hog_is_contained():
    result = await run_python("x = bytearray(1 << 31)\nprint('allocated')", "", FAST)
    assert "allocated" not in result.stdout and "MemoryError" in result.stderr


async def test_file_size_limit():
    result = await run_python("open('big', 'wb').write(b'x' * (32 << 20))", "", Limits(file_size_mb=1))
    assert not result.ok and "File too large" in result.stderr


async def test_output_flood_is_cut():
    result = await run_python("while True: print('x' * 1000)", "", Limits(output_bytes=10_000))
    assert result.output_exceeded and len(result.stdout) <= 10_000


@pytest.mark.skipif(not ISOLATION.own_uid, reason="RLIMIT_NPROC per run needs root (a fresh uid per run)")
async def test_fork_bomb_is_contained_and_its_children_die():
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid(); time.sleep(60)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    print('capped at', n)\n"
    )
    result = await run_python(bomb, "", FAST)
    assert "capped at" in result.stdout
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


@pytest.mark.skipif(not ISOLATION.network, reason="no network namespace on this platform")
async def test_network_is_blocked():
    program = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('blocked', exc.errno)\n"
    )
    result = await run_python(program, "", FAST)
    assert result.stdout.startswith("blocked")


# ------------------------------------------------------------------ the environment


def _episode(task: Task, text: str, status: Status = Status.COMPLETED) -> EpisodeRecord:
    messages = [{"role": "user", "content": "write it"}, {"role": "assistant", "content": text}]
    return EpisodeRecord(task=task, messages=messages, response_text=text, status=status, turns=1)


IO_TASK = Task(
    id="c1",
    env="code",
    prompt="Read n, print n*2.",
    metadata={"tests": [{"input": "1\n", "output": "2\n"}, {"input": "5\n", "output": "10"}, {"input": "-3", "output": "-6"}]},
)
ASSERT_TASK = Task(
    id="c2", env="code", prompt="def add(a, b)", metadata={"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
)


async def _verify(options: dict, task: Task, text: str, status: Status = Status.COMPLETED):
    env = CodeEnvironment("code", EnvConfig(kind="code", options={"limits": {"wall_s": 5.0}, **options}))
    session = await env.start(task)
    return await session.verify(_episode(task, text, status))


async def test_code_reward_fraction_and_all_pass():
    half_right = "Here:\n```python\nn = int(input())\nprint(n * 2 if n > 0 else n)\n```"
    fraction = await _verify({}, IO_TASK, half_right)
    assert fraction.reward == pytest.approx(2 / 3) and fraction.components["passed"] == 2
    assert fraction.components["failures"][0].startswith("test 2")
    all_pass = await _verify({"reward": "all_pass"}, IO_TASK, half_right)
    assert all_pass.reward == 0.0
    right = await _verify({"reward": "all_pass"}, ASSERT_TASK, "```py\ndef add(a, b):\n    return a + b\n```")
    assert right.reward == 1.0 and right.components["isolation"] == ISOLATION.summary


async def test_no_code_block_scores_zero_and_bad_tests_fail_the_episode():
    missing = await _verify({}, ASSERT_TASK, "I would write a function that adds.")
    assert missing.reward == 0.0 and missing.components["error"] == "no code block"
    env = CodeEnvironment("code", EnvConfig(kind="code"))
    with pytest.raises(EnvError, match="metadata.tests"):
        await env.start(Task(id="c3", env="code", prompt="x", metadata={"tests": [42]}))


def test_extract_program_takes_the_last_python_block():
    text = "```bash\nls\n```\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
