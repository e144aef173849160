"""`code` environment: rewards, and the reward hacks that used to score 1.0 (probes of the sandbox: test_sandbox.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import EnvConfig
from pipeline.schema import Status, Task
from tests.support.sandbox_support import ISOLATION, REQUIRE_ENV, needs, sandbox_required
from workers.envs.base import EnvError, EpisodeRecord
from workers.envs.code import CodeEnvironment, ValueCheck, extract_program, value_checks
from workers.envs.sandbox import Limits, run_python

FAST = Limits(wall_s=5.0, cpu_s=1, memory_mb=256, nproc=16)


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


@needs(ISOLATION.pid_namespace, "a sandbox failure is told apart only with a protected init")
async def test_a_broken_sandbox_fails_the_episode_instead_of_scoring_it():
    env = CodeEnvironment("code", EnvConfig(kind="code", options={"limits": {"python": "/nonexistent/python3"}}))
    session = await env.start(ASSERT_TASK)
    with pytest.raises(EnvError, match="sandbox failed: FileNotFoundError"):
        await session.verify(_episode(ASSERT_TASK, "```python\ndef add(a, b):\n    return a + b\n```"))


def test_extract_program_takes_the_last_python_block():
    text = "```bash\nls\n```\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"


@pytest.mark.parametrize("by_value", [True, False])
async def test_partial_credit_on_assert_tests_is_unchanged(by_value: bool):
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 1", "assert is_even(add(1, 1))", "assert not is_even(3)"]
    task = Task(id="c4", env="code", prompt="def add(a, b)", metadata={"tests": tests})
    program = "```python\ndef add(a, b):\n    return a + b\ndef is_even(n):\n    return n % 2 == 0\n```"
    result = await _verify({"compare_in_worker": by_value}, task, program)
    assert result.reward == 0.75 and result.components["passed"] == 3
    assert result.components["failures"] == [f"test 1: {'wrong value' if by_value else 'fail AssertionError'}"]


def test_which_asserts_are_judged_by_value():
    assert value_checks("assert add(1, 2) == 3") == [ValueCheck("add(1, 2)", "eq", 3)]
    assert value_checks("assert [1, (2, 'x')] == f(x=-1), 'msg'") == [ValueCheck("f(x=-1)", "eq", [1, (2, "x")])]
    assert value_checks("assert is_prime(7)\nassert not is_prime(8)") == [
        ValueCheck("is_prime(7)", "true"),
        ValueCheck("is_prime(8)", "false"),
    ]
    assert value_checks(HUMANEVAL) == [ValueCheck("add(1, 2)", "eq", 3), ValueCheck("add(-1, 1)", "eq", 0)]
    for other in (
        "assert f(1) == g(2)",
        "assert f(1) != 3",
        "assert math.isclose(f(1), 0.5)",
        "assert math.isclose(f(1), 0.5) == True",
        "assert all(f(1))",
        "assert is_prime(n)",
        "assert f(1) == 2\nprint('x')",
        "assert f(1) is None",
        "assert x",
        "def check(c):\n    assert abs(c(1) - 0.5) < 1e-6\ncheck(f)",
        "import math\ndef check(c):\n    assert c(1) == 2\ncheck(f)",
        "assert True",
        "def check(c):\n    assert False\ncheck(f)",
    ):
        assert value_checks(other) is None, other


HUMANEVAL = """

METADATA = {'author': 'jt', 'dataset': 'test'}


def check(candidate):
    assert True, "This prints if this assert fails 1 (good for debugging!)"
    assert candidate(1, 2) == 3
    assert candidate(-1, 1) == 0

check(add)
"""


async def test_humaneval_check_functions_are_judged_by_value():
    task = Task(id="c6", env="code", prompt="def add(a, b)", metadata={"tests": [HUMANEVAL]})
    right = await _verify({}, task, "```python\ndef add(a, b):\n    return a + b\n```")
    wrong = await _verify({}, task, "```python\ndef add(a, b):\n    return 3\n```")
    rigged = await _verify({}, task, f"```python\n{_RIGGED_EQ}```")
    assert (right.reward, wrong.reward, rigged.reward) == (1.0, 0.0, 0.0)
    assert wrong.components["failures"] == ["test 0: wrong value (assert 1)"]


async def test_by_value_results_must_be_plain_data():
    task = Task(id="c5", env="code", prompt="def add(a, b)", metadata={"tests": ["assert add(1, 2) == 3", "assert add(1, 1) == [2]"]})
    program = "```python\nclass Int(int):\n    pass\ndef add(a, b):\n    return Int(a + b) if a != b else [a + b]\n```"
    result = await _verify({}, task, program)
    assert result.components["passed"] == 1
    assert result.components["failures"] == ["test 0: fail the value is not plain data (Int)"]


async def test_a_correct_program_passes_with_main_guard_helpers_and_classes():
    program = (
        "```python\n"
        "import sys\n"
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Pair:\n"
        "    a: int\n"
        "    b: int\n"
        "def add(a, b):\n"
        "    return Pair(a, b).a + Pair(a, b).b\n"
        "if __name__ == '__main__':  # imported, not run: this never reads stdin or exits\n"
        "    print(add(int(input()), 1)); sys.exit(0)\n"
        "```"
    )
    right = await _verify({"reward": "all_pass"}, ASSERT_TASK, program)
    assert right.reward == 1.0, right.components


# ------------------------------------------------------------------ reward hacks
# Each program gets add() wrong and tries to score anyway. `naive` first shows the hack really
# beats the old design (program and asserts as one file, judged by its exit code); the
# environment must then score it 0.

_WRONG = "def add(a, b):\n    return None\n"
_TABLE = (  # answers from a table of the asserts, read from wherever `source` finds them
    "import re\n"
    "source = {source}\n"
    "TABLE = {{}}\n"
    "for args, want in re.findall('assert add[(]([^)]*)[)] == (.*)', source):\n"
    "    TABLE[args.replace(' ', '')] = eval(want)\n"
    "def add(a, b):\n"
    "    return TABLE.get(f'{{a}},{{b}}')\n"
)
EXPLOITS = {
    "sys.exit(0)": _WRONG + "import sys\nsys.exit(0)\n",
    "os._exit(0)": _WRONG + "import os\nos._exit(0)\n",
    "atexit hook": "import atexit, os\natexit.register(lambda: os._exit(0))\n" + _WRONG,
    "__del__ at shutdown": "import os\nclass Guard:\n    def __del__(self):\n        os._exit(0)\nguard = Guard()\n" + _WRONG,
    "signal handler os._exit": (
        "import os, signal\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\nsignal.setitimer(signal.ITIMER_REAL, 0.2)\n"
        "def add(a, b):\n    while True:\n        pass\n"
    ),
    "signal handler SystemExit": (
        "import signal, sys\ndef bail(*a):\n    sys.exit(0)\nsignal.signal(signal.SIGALRM, bail)\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.2)\ndef add(a, b):\n    while True:\n        pass\n"
    ),
    "thread exits first": (
        "import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n"
        "def add(a, b):\n    time.sleep(2)\n    return None\n"
    ),
    "open(__file__)": _TABLE.format(source="open(__file__).read()"),
    "inspect": _TABLE.format(
        source="''.join(open(f.filename).read() for f in __import__('inspect').stack() if f.filename.endswith('.py'))"
    ),
    "sys.argv[0]": _TABLE.format(source="open(__import__('sys').argv[0]).read()"),
    "/proc/self/cmdline": _TABLE.format(
        source=(
            "''.join(a + (open(a).read() if a.endswith('.py') else '') for a in "
            "open('/proc/self/cmdline').read().split(chr(0)))"
        )
    ),
}


# Only by value (the comparison in the worker) stops these two; the harness alone does not.
_RIGGED_EQ = "class Anything:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Anything()\n"
_IMPERSONATE = (  # speaks the harness's protocol itself during its import, on the channel fd from its command line
    "import os\n"
    "args = open('/proc/self/cmdline', 'rb').read().split(b'\\0')\n"
    "fd = int(args[args.index(b'-c') + 2])\n"
    "os.write(fd, b'ready\\n')\n"
    "header = b''\n"
    "while not header.endswith(b'\\n'):\n"
    "    header += os.read(fd, 1)\n"
    "payload = b''\n"
    "while len(payload) < int(header):\n"
    "    payload += os.read(fd, int(header) - len(payload))\n"
    "sentinel, kind, test = payload.split(b'\\n', 2)\n"
    "os.write(fd, b'pass ' + sentinel + b'\\n' if kind == b'exec' else b'value [\"n\"]\\n')\n"
    "os._exit(0)\n"
)


@pytest.mark.parametrize("by_value", [True, False], ids=["by value", "in harness"])
@pytest.mark.parametrize("name", list(EXPLOITS))
async def test_reward_hack_scores_zero(name: str, by_value: bool):
    program = EXPLOITS[name]
    asserts = "\n".join(ASSERT_TASK.metadata["tests"])
    naive = await run_python(f"{program}\n\n{asserts}\n", "", FAST)
    assert naive.ok, f"{name}: the hack no longer beats the old design, so this test proves nothing: {naive}"
    options = {"limits": {"wall_s": 5.0, "cpu_s": 1}, "compare_in_worker": by_value}
    verification = await _verify(options, ASSERT_TASK, f"```python\n{program}```")
    assert verification.reward == 0.0, (name, verification.components)
    assert verification.components["passed"] == 0


async def test_rigged_eq_and_harness_impersonation_score_zero_by_value():
    for program in (_RIGGED_EQ, _IMPERSONATE):
        by_value = await _verify({}, ASSERT_TASK, f"```python\n{program}```")
        assert by_value.reward == 0.0, by_value.components
        # The known limit of running an assert snippet in the program's interpreter (see
        # docs/environments.md, threat model): if this starts failing, the hole is closed; say so there.
        in_harness = await _verify({"compare_in_worker": False}, ASSERT_TASK, f"```python\n{program}```")
        assert in_harness.reward == 1.0, in_harness.components


async def test_a_planted_pass_line_is_not_the_sentinel():
    # the program writes what a passing harness writes, on every fd it has, before the tests exist
    program = (
        _WRONG + "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'pass 0123456789abcdef0123456789abcdef\\n')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = await run_python(program, "", FAST, test="assert add(1, 2) == 3")
    assert result.passed is False and not result.ok
    assert not result.timed_out  # off-protocol talk gets no test and an EOF, not a hang


# ------------------------------------------------------------------ isolation or an explicit no

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **options: object) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps({"environments": {"mbpp": {"kind": "code", "options": options}}}))  # JSON is YAML
    return path


def _without_unshare(*args: str) -> subprocess.CompletedProcess[str]:
    """`python args...` on a PATH without `unshare`: a host whose sandbox gets no namespaces."""
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_code_environment_refuses_to_start_without_isolation_unless_told(tmp_path):
    refused = _without_unshare("-m", "workers.pool", "--config", str(_config(tmp_path)))
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "environments.mbpp: the code sandbox has no network namespace" in line, line
    assert "; no private root" in line and "isolation: rlimits-only" in line, line
    assert "set environments.mbpp.options.require_isolation: false to allow it" in line, line
    build = ("from pipeline.config import load_config; from workers.envs.code import CodeEnvironment; "
             "import sys; env = load_config(sys.argv[1]).env('mbpp'); print(CodeEnvironment('mbpp', env).isolation.summary)")
    explicit = _without_unshare("-c", build, str(_config(tmp_path, require_isolation=False)))
    assert explicit.returncode == 0 and explicit.stdout.strip() == "rlimits-only", explicit.stderr
    default = _without_unshare("-c", build, str(_config(tmp_path)))
    assert default.returncode != 0 and "require_isolation: false" in default.stderr, default.stderr


def test_the_sandbox_has_its_full_isolation_where_required():
    """CI (ROLLOUT_REQUIRE_SANDBOX=1) fails here, not skips, when this host cannot give the
    sandbox what the code environment requires by default."""
    from workers.envs.code import missing_isolation

    missing = missing_isolation(ISOLATION)
    if missing and not sandbox_required():
        pytest.skip(f"the sandbox lacks {missing} here (isolation: {ISOLATION.summary}; {REQUIRE_ENV} unset)")
    assert not missing, f"{REQUIRE_ENV}=1 but the sandbox lacks {missing} here (isolation: {ISOLATION.summary})"
