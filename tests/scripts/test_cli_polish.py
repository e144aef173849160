"""Issue 14 item 8, the small things of a user's first hour, each through the CLI as a
subprocess (exit code and what it prints): `rollout --version`, bare `rollout`, no
transformers "PyTorch was not found" advisory, `rollout engine --help` with its knobs, servers
bound to 127.0.0.1 unless told otherwise, GSM8K labels ("... #### 72") scored right by the
simulator and by the math environment, and `rollout demo --eta N`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

from pipeline.store.local_redis import free_port

REPO = Path(__file__).resolve().parents[2]
ADVISORY = "PyTorch was not found"
GSM8K_QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
                 "How many clips did Natalia sell altogether in April and May?"
GSM8K_LABEL = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n" \
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_", "TRANSFORMERS_"))}
    env.update({"COLUMNS": "200", "PYTHONUNBUFFERED": "1", "ROLLOUT_REDIS_OUTAGE_S": "1"})
    env.update(extra or {})
    return env


def rollout(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.cli", *argv], env=_env(env), text=True,
                          capture_output=True, timeout=timeout, cwd=REPO, check=False)


def _lines(text: str) -> list[str]:
    return [line for line in text.strip().splitlines() if line.strip()]


# ------------------------------------------------------------------ 1. --version, bare rollout


def test_version_is_the_installed_package_version():
    for flag in ("--version", "-V"):
        result = rollout(flag)
        assert result.returncode == 0, result.stderr
        assert _lines(result.stdout) == [f"rollout {dist_version('rollout-pipeline')}"]
        assert result.stderr == ""


def test_bare_rollout_prints_the_help_on_stderr_and_exits_2():
    result = rollout()
    assert result.returncode == 2
    assert result.stdout == ""
    lines = _lines(result.stderr)
    assert lines[0] == "usage: rollout [--version] [--debug] <command> [options]"
    assert any(line.split()[:1] == ["engine"] for line in lines)  # the command list
    help_ = rollout("--help")
    assert help_.returncode == 0 and help_.stdout.strip() == result.stderr.strip()


# ------------------------------------------------------------------ 2. no "PyTorch was not found"


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict[str, str]:
    """Environment variables that make a Python process see no PyTorch (as on a machine without
    it): a sitecustomize that blocks `import torch` and transformers' `find_spec("torch")`."""
    site = tmp_path_factory.mktemp("no-torch")
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def test_transformers_without_torch_would_print_the_advisory(no_torch):
    """The control: without the CLI, importing transformers here prints the advisory (else the
    tests below would pass for nothing)."""
    result = subprocess.run([sys.executable, "-c", "import transformers"], env=_env(no_torch), text=True,
                            capture_output=True, timeout=120, cwd=REPO, check=False)
    if ADVISORY not in result.stderr:
        pytest.skip(f"this transformers prints no {ADVISORY!r} advisory without torch")


def _start_engine(tmp_path: Path, env: dict[str, str], *argv: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    err = tmp_path / f"engine-{port}.err"
    with err.open("w") as err_fh:
        proc = subprocess.Popen([sys.executable, "-m", "scripts.cli", "engine", "--port", str(port), *argv],
                                env=_env(env), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=err_fh)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the tokenizer is loaded, before serving
    if not line:
        proc.wait(10)
        pytest.fail(f"rollout engine exited {proc.returncode}: {err.read_text()[-2000:]}")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"rollout engine did not come up: {err.read_text()[-2000:]}")
            time.sleep(0.1)
    return proc, line.strip(), err


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_engine_loads_its_tokenizer_without_the_pytorch_advisory(tmp_path, no_torch):
    test_transformers_without_torch_would_print_the_advisory(no_torch)
    proc, line, err = _start_engine(tmp_path, no_torch)
    try:
        assert line.startswith("simulated SGLang engine on http://127.0.0.1:")
    finally:
        _stop(proc)
    assert ADVISORY not in err.read_text(), err.read_text()


def test_commands_import_no_transformers_and_keep_its_real_warnings(no_torch):
    """Commands that need no tokenizer never import transformers (so it cannot warn), and the CLI
    switches off only transformers' advisories: its verbosity (real warnings) stays its default."""
    code = (
        "import importlib, os, sys\n"
        "import scripts.cli as cli\n"
        "for target, _ in cli.COMMANDS.values():\n"
        "    importlib.import_module(target.split(':')[0])\n"
        "assert 'transformers' not in sys.modules, 'a command module imports transformers at load'\n"
        "from transformers.utils import logging\n"
        "print(os.environ.get('TRANSFORMERS_NO_ADVISORY_WARNINGS'), os.environ.get('TRANSFORMERS_VERBOSITY'),\n"
        "      logging.get_verbosity() == logging.WARNING)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=_env(no_torch), text=True, capture_output=True,
                            timeout=120, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "None", "True"]
    assert ADVISORY not in result.stderr
    for argv in (("prepare", "--help"), ("monitor", "--help"), ("workers", "--help"), ("demo", "--help")):
        result = rollout(*argv, env=no_torch)
        assert result.returncode == 0 and ADVISORY not in result.stderr, argv


# ------------------------------------------------------------------ 3. rollout engine --help, 127.0.0.1

ENGINE_KNOBS = ("--host", "--port", "--tasks", "--accuracy", "--tool-use", "--malformed-rate", "--seed",
                "--length-mu", "--length-sigma", "--max-filler-tokens", "--token-latency-s", "--latency-sigma",
                "--slots", "--context-length", "--startup-s", "--weight-version", "--tokenizer")


def test_engine_help_lists_every_knob_with_help_text():
    result = rollout("engine", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "SIMULATED" in out
    for knob in ENGINE_KNOBS:
        # the option's entry: the flag, its metavar, then help text (not the next option)
        assert re.search(rf"^\s+{knob} [A-Z_]+\s+[^\s-]", out, re.MULTILINE), (knob, out)
    for default in ("(default 127.0.0.1", "(default 0.7)", "(default 3.5)", "(default 256)"):
        assert default in out, default


def test_a_bad_engine_flag_is_a_usage_error():
    result = rollout("engine", "--accuracy", "high")
    assert result.returncode == 2
    assert "argument --accuracy: invalid float value: 'high'" in result.stderr


def _listening_addresses(port: int) -> set[str]:
    """Local addresses listening on `port` (Linux /proc/net/tcp, IPv4)."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            addresses.add(".".join(str(b) for b in reversed(bytes.fromhex(host_hex))))
    return addresses


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_engine_and_monitor_serve_bind_127_0_0_1_by_default(tmp_path, redis_url):
    proc, _line, _err = _start_engine(tmp_path, {})
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", _line).group(1))
        assert _listening_addresses(port) == {"127.0.0.1"}
    finally:
        _stop(proc)
    port = free_port()
    monitor = subprocess.Popen([sys.executable, "-m", "scripts.cli", "monitor", "--serve", str(port),
                                "--redis-url", redis_url], env=_env(), cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert monitor.stdout is not None
        line = monitor.stdout.readline()
        assert f"at http://127.0.0.1:{port}/metrics" in line, line + (monitor.stderr.read() if monitor.poll() else "")
        assert _listening_addresses(port) == {"127.0.0.1"}
    finally:
        _stop(monitor)


# ------------------------------------------------------------------ 4. GSM8K labels


def test_math_environment_reads_gsm8k_labels():
    from workers.envs.math import check_answer, gold_answer

    assert gold_answer(GSM8K_LABEL) == "72"
    assert gold_answer("#### 1,234") == "1234"
    assert gold_answer("(1, 2)") == "(1, 2)" and gold_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert gold_answer("####") == "####"
    assert check_answer("So she sold 72 clips. Answer: 72", GSM8K_LABEL, "any", 5)[:2] == (1.0, "72")
    for wrong in ("24", "48", "73"):  # numbers of the worked solution are not the answer
        assert check_answer(f"Answer: {wrong}", GSM8K_LABEL, "any", 5)[0] == 0.0, wrong
    # the answer line is the last one even when text follows it
    assert check_answer("Answer: 72", "#### 72\nsee step 3", "any", 5)[0] == 1.0
    assert check_answer("Answer: 3", "#### 72\nsee step 3", "any", 5)[0] == 0.0
    assert check_answer("The total is \\boxed{1234}", "... #### 1,234", "boxed", 5)[0] == 1.0


def test_simulator_answers_gsm8k_tasks_with_the_number_after_the_marks(tmp_path):
    """`rollout prepare` keeps a GSM8K answer whole as the label; `rollout engine --tasks` answers
    72 (not the solution text), and the math environment scores that answer 1."""
    from workers.envs.math import check_answer
    from workers.sim.tokenizer import load_test_tokenizer

    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": GSM8K_QUESTION, "answer": GSM8K_LABEL}) + "\n")
    (tmp_path / "pipeline.yaml").write_text(
        "environments:\n  gsm:\n    kind: math\n    options: {check_in: inline}\n"
        "    dataset: {source: jsonl, files: [gsm8k.jsonl], fields: {prompt: question, label: answer}}\n")
    result = rollout("prepare", "--config", str(tmp_path / "pipeline.yaml"), "--output", str(tmp_path / "tasks.jsonl"))
    assert result.returncode == 0, result.stderr
    task = json.loads((tmp_path / "tasks.jsonl").read_text().splitlines()[0])
    assert task["label"] == GSM8K_LABEL

    proc, _line, _err = _start_engine(tmp_path, {}, "--tasks", str(tmp_path / "tasks.jsonl"), "--accuracy", "1.0")
    try:
        url = _line.split(" on ")[1].split()[0]
        tokenizer = load_test_tokenizer()
        ids = tokenizer.apply_chat_template([{"role": "user", "content": task["prompt"]}], tokenize=True,
                                            add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 4096}, "rid": "gsm-1"}).encode()
        request = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
    finally:
        _stop(proc)
    text = answer["text"]
    assert text.rstrip().endswith("Answer: 72"), text[-200:]
    assert "####" not in text
    assert check_answer(text, task["label"], "any", 5)[:2] == (1.0, "72")


# ------------------------------------------------------------------ 5. rollout demo --eta


def test_demo_eta_must_not_be_negative():
    result = rollout("demo", "--eta", "-1")
    assert result.returncode == 2
    assert _lines(result.stderr)[-1].endswith("--eta must be >= 0")


def test_demo_eta_0_is_synchronous_and_the_summary_says_so(tmp_path):
    summary = tmp_path / "s.json"
    result = rollout("demo", "--short", "--eta", "0", "--summary-json", str(summary), env={"TMPDIR": str(tmp_path)},
                     timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = " ".join(result.stdout.split())
    assert "eta=0" in out  # the header
    assert re.search(r"staleness max vs eta\s*│\s*0 <= 0", result.stdout), result.stdout[-2000:]
    assert "trainer wait ratio" in out
    figures = json.loads(summary.read_text())
    assert figures["eta"] == 0 and figures["staleness_max"] == 0 and figures["steps"] == 3
