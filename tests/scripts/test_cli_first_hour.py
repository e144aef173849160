"""The first hour of a new user (issue 14, issue 18 items 7-9): every command run as a user runs
it, as a subprocess, checked for its exit code and its one-line message.

Exit codes (scripts/cli.py): 0 done, 1 internal error, 2 usage or configuration,
3 connection (Redis or engine unreachable, authentication), 130 interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.store.local_redis import free_port

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-pw"


def rollout(*argv: str, env: dict[str, str] | None = None, timeout: float = 60, cwd: Path | None = None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    full.update({"ROLLOUT_REDIS_OUTAGE_S": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "scripts.cli", *argv], env=full, text=True, capture_output=True,
                          timeout=timeout, cwd=cwd or REPO)


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def tasks_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def password_redis():
    """A redis-server that wants a password."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    import socket

    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


# ------------------------------------------------------------------ 1. the error boundary


def test_bare_rollout_prints_help_and_exits_2():
    result = rollout()
    assert result.returncode == 2
    assert "usage: rollout" in result.stderr and "Exit codes:" in result.stderr


def test_version():
    result = rollout("--version")
    assert result.returncode == 0
    assert one_line(result.stdout).startswith("rollout ")


def test_unknown_command_is_usage():
    assert rollout("mointor").returncode == 2


def test_typod_config_in_monitor_is_one_line_exit_2(tmp_path):
    cfg = write(tmp_path / "p.yaml", "redis:\n  namspace: x\n")
    result = rollout("monitor", "--config", str(cfg), "--json")
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert line.startswith("rollout monitor: config ") and str(cfg) in line and "namspace" in line


def test_http_redis_url_is_a_config_error():
    result = rollout("monitor", "--json", "--redis-url", "http://localhost:6379")
    assert result.returncode == 2
    assert "redis.url from --redis-url 'http://localhost:6379' is not a Redis URL" in one_line(result.stderr)


def test_redis_down_is_exit_3_with_the_url_redacted():
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    result = rollout("monitor", "--json", env={"ROLLOUT_REDIS_URL": url})
    assert result.returncode == 3
    line = one_line(result.stderr)
    assert "cannot read redis://:***@127.0.0.1" in line and PASSWORD not in result.stderr + result.stdout


def test_wrong_password_is_exit_3(password_redis):
    result = rollout("monitor", "--json", "--redis-url", f"redis://:wrong@127.0.0.1:{password_redis}/0")
    assert result.returncode == 3
    line = one_line(result.stderr)  # at once: a wrong password does not wait out the outage budget
    assert "invalid username-password pair" in line and "wrong" not in line


def test_debug_shows_the_traceback(tmp_path):
    cfg = write(tmp_path / "p.yaml", "redis:\n  namspace: x\n")
    result = rollout("--debug", "monitor", "--config", str(cfg), "--json")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and result.stderr.strip().splitlines()[-1].startswith("rollout monitor: config")


def test_classify_exit_codes():
    from redis.exceptions import AuthenticationError
    from redis.exceptions import ConnectionError as RedisConnectionError

    from pipeline.config import ConfigError
    from scripts.cli import classify

    assert classify(ConfigError("x")) == 2
    assert classify(FileNotFoundError("tasks.jsonl")) == 2
    assert classify(RedisConnectionError("down")) == 3
    assert classify(AuthenticationError("wrong")) == 3
    assert classify(ConnectionRefusedError(111, "refused")) == 3
    assert classify(KeyError("bug")) == 1
    assert classify(KeyboardInterrupt()) == 130


def test_internal_error_says_so_in_one_line(monkeypatch, capsys):
    from scripts import cli

    def broken(argv):
        raise KeyError("oops")

    monkeypatch.setitem(cli.COMMANDS, "broken", ("scripts.cli:_broken_for_test", "x"))
    monkeypatch.setattr(cli, "_broken_for_test", broken, raising=False)
    assert cli.main(["broken"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("rollout broken: internal error: KeyError") and "--debug" in line


# ------------------------------------------------------------------ 2. config bounds and environment checks


@pytest.mark.parametrize("yaml_text,key", [
    ("rollout:\n  rollout_batch_size: 0\n", "rollout.rollout_batch_size"),
    ("rollout:\n  n_samples_per_prompt: 0\n", "rollout.n_samples_per_prompt"),
    ("rollout:\n  eta: -3\n", "rollout.eta"),
    ("workers:\n  concurrency: -1\n", "workers.concurrency"),
    ("workers:\n  heartbeat_s: 0\n", "workers.heartbeat_s"),
    ("engine:\n  request_timeout_s: 0\n", "engine.request_timeout_s"),
    ("workers:\n  heartbeat_s: 5\n  dead_after_s: 6\n", "workers.dead_after_s"),
])
def test_numbers_out_of_bounds_are_refused_at_worker_start(tmp_path, yaml_text, key):
    cfg = write(tmp_path / "p.yaml", yaml_text)
    result = rollout("workers", "--config", str(cfg))
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert line.startswith(f"rollout workers: config {cfg}") and (key in line or f"$.{key}" in line), line


MATH_ENV = "environments:\n  m:\n    kind: math\n    options: {check_in: inline}\n"


def test_misspelled_kind_fails_worker_start(tmp_path):
    cfg = write(tmp_path / "p.yaml", "environments:\n  m:\n    kind: maths\n")
    result = rollout("workers", "--config", str(cfg))
    assert result.returncode == 2
    assert "environments.m.kind" in one_line(result.stderr) and "did you mean 'math'" in result.stderr


def test_unknown_options_key_fails_worker_start(tmp_path):
    cfg = write(tmp_path / "p.yaml", "environments:\n  m:\n    kind: math\n    options: {chek_in: inline}\n")
    result = rollout("workers", "--config", str(cfg))
    assert result.returncode == 2
    assert "environments.m.options.chek_in" in one_line(result.stderr)


def test_prepare_refuses_a_math_row_without_answer(tmp_path):
    tasks_file(tmp_path / "d.jsonl", [{"prompt": "1+1?", "label": "2"}, {"prompt": "2+2?"}])
    cfg = write(tmp_path / "p.yaml", MATH_ENV + "    dataset: {source: jsonl, files: [d.jsonl]}\n")
    result = rollout("prepare", "--config", str(cfg), "--output", str(tmp_path / "t.jsonl"))
    assert result.returncode == 2
    assert "d.jsonl:2: task" in result.stderr and "no label" in result.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_prepare_refuses_a_misspelled_kind(tmp_path):
    tasks_file(tmp_path / "d.jsonl", [{"prompt": "1+1?", "label": "2"}])
    cfg = write(tmp_path / "p.yaml", "environments:\n  m:\n    kind: maths\n    dataset: {source: jsonl, files: [d.jsonl]}\n")
    result = rollout("prepare", "--config", str(cfg), "--output", str(tmp_path / "t.jsonl"))
    assert result.returncode == 2 and "environments.m.kind" in result.stderr


def test_enqueue_checks_kinds_and_tasks_before_admitting(tmp_path, redis_url, namespace):
    tasks = tasks_file(tmp_path / "t.jsonl", [
        {"id": "a", "env": "m", "prompt": "1+1?", "label": "2"},
        {"id": "b", "env": "m", "prompt": "2+2?"},
    ])
    cfg = write(tmp_path / "p.yaml", MATH_ENV)
    env = {"ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_NAMESPACE": namespace}
    result = rollout("enqueue", "--tasks", str(tasks), "--config", str(cfg), "--without-trainer", env=env)
    assert result.returncode == 2
    assert f"{tasks}:2: task 'b' (m, kind math): no label" in result.stderr
    bad_kind = write(tmp_path / "k.yaml", "environments:\n  m:\n    kind: maths\n")
    result = rollout("enqueue", "--tasks", str(tasks), "--config", str(bad_kind), "--without-trainer", env=env)
    assert result.returncode == 2 and "environments.m.kind" in one_line(result.stderr)
    import redis as redis_sync

    assert redis_sync.Redis.from_url(redis_url).exists(f"{namespace}:queue") == 0  # nothing admitted


def test_trainer_settings_bounds():
    from types import SimpleNamespace

    from pipeline.config import ConfigError, TrainerSettings

    with pytest.raises(ConfigError, match="rollout_batch_size"):
        TrainerSettings.from_args(SimpleNamespace(rollout_batch_size=0))
    with pytest.raises(ConfigError, match="pipeline_eta|eta"):
        TrainerSettings.from_args(SimpleNamespace(pipeline_eta=-1))


# ------------------------------------------------------------------ 3. one way to name the pipeline


def _monitor_ns(*argv: str, env: dict[str, str]) -> str:
    result = rollout("monitor", "--json", *argv, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["namespace"]


def test_flag_beats_env_beats_config_file(tmp_path, redis_url):
    cfg = write(tmp_path / "p.yaml", f"redis:\n  url: redis://127.0.0.1:{free_port()}/0\n  namespace: fromfile\n")
    env = {"ROLLOUT_REDIS_URL": redis_url}  # the file's URL is dead: the env var must win
    assert _monitor_ns("--config", str(cfg), env=env) == "fromfile"
    assert _monitor_ns("--config", str(cfg), env={**env, "ROLLOUT_NAMESPACE": "fromenv"}) == "fromenv"
    assert _monitor_ns("--config", str(cfg), "--namespace", "fromflag",
                       env={**env, "ROLLOUT_NAMESPACE": "fromenv"}) == "fromflag"


def test_load_config_precedence_for_every_command(tmp_path):
    from pipeline.config import load_config

    cfg = write(tmp_path / "p.yaml", "redis:\n  url: redis://file:1/0\n  namespace: fromfile\n")
    env = {"ROLLOUT_REDIS_URL": "redis://env:2/0", "ROLLOUT_NAMESPACE": "fromenv"}
    assert load_config(cfg, environ={}).redis.namespace == "fromfile"
    loaded = load_config(cfg, environ=env)
    assert (loaded.redis.url, loaded.redis.namespace) == ("redis://env:2/0", "fromenv")
    flagged = load_config(cfg, {"redis.namespace": "fromflag"}, environ=env)
    assert flagged.redis.namespace == "fromflag" and load_config(None, environ={}).redis.namespace == "rollout"


def test_enqueue_and_workers_take_namespace_and_redis_url_flags():
    for command in ("enqueue", "workers", "monitor"):
        out = rollout(command, "--help").stdout
        assert "--namespace" in out and "--redis-url" in out, command


# ------------------------------------------------------------------ 4. demo secrets


def test_demo_never_writes_the_password_and_honours_the_env_var(tmp_path, password_redis):
    url = f"redis://:{PASSWORD}@127.0.0.1:{password_redis}/0"
    summary = tmp_path / "s.json"
    result = rollout("demo", "--short", "--eta", "2", "--keep", "--summary-json", str(summary), env={
        "ROLLOUT_REDIS_URL": url, "TMPDIR": str(tmp_path)}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert PASSWORD not in result.stdout + result.stderr
    run_dirs = list(tmp_path.glob("rollout-demo-*"))
    assert run_dirs, "the run directory (--keep) is under $TMPDIR"
    for path in [p for d in run_dirs for p in d.rglob("*") if p.is_file()] + [summary]:
        assert PASSWORD.encode() not in path.read_bytes(), path
    assert "namespace demo-" in result.stdout  # a fresh namespace on a Redis that is not the demo's own
    figures = json.loads(summary.read_text())
    assert figures["steps"] == 3 and figures["eta"] == 2 and figures["staleness_max"] <= 2  # --eta is the run's bound


def test_demo_wrong_password_is_one_line_exit_3(tmp_path, password_redis):
    result = rollout("demo", "--short", "--redis-url", f"redis://:wrong@127.0.0.1:{password_redis}/0",
                     env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 3
    assert "wrong" not in result.stderr and "cannot connect" in one_line(result.stderr)
    assert not list(tmp_path.glob("rollout-demo-*"))  # nothing left behind


def test_demo_has_an_eta_option():
    out = rollout("demo", "--help").stdout
    assert "--eta" in out


# ------------------------------------------------------------------ 5. enqueue: summary, --json, what it waits for


def _math_tasks(path: Path, count: int) -> Path:
    return tasks_file(path, [{"id": f"t{i}", "env": "m", "prompt": f"{i}+1?", "label": str(i + 1)} for i in range(count)])


def test_enqueue_prints_a_summary_and_json(tmp_path, redis_url, namespace):
    tasks = _math_tasks(tmp_path / "t.jsonl", 6)
    cfg = write(tmp_path / "p.yaml", MATH_ENV + "rollout: {rollout_batch_size: 100, eta: 0, n_samples_per_prompt: 2}\n")
    args = ("enqueue", "--tasks", str(tasks), "--config", str(cfg), "--without-trainer", "--redis-url", redis_url)
    result = rollout(*args, "--namespace", namespace)
    assert result.returncode == 0, result.stderr
    assert "ProducerStats(" not in result.stdout + result.stderr
    assert f"-> namespace {namespace}" in result.stdout and "admitted      6 fresh task(s)" in result.stdout
    result = rollout(*args, "--namespace", namespace + "-j", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["admitted"] == 6 and data["namespace"] == namespace + "-j" and isinstance(data["elapsed_s"], float)


def test_enqueue_says_it_waits_for_the_trainer_and_for_which_version(tmp_path, redis_url, namespace):
    tasks = _math_tasks(tmp_path / "t.jsonl", 10)
    cfg = write(tmp_path / "p.yaml", MATH_ENV + "rollout: {rollout_batch_size: 2, eta: 1, n_samples_per_prompt: 2}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "scripts.cli", "enqueue", "--tasks", str(tasks), "--config",
                             str(cfg), "--without-trainer", "--progress", "0.2"], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = ""
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and proc.stderr is not None:
            line = proc.stderr.readline()
            seen += line
            if "waiting for the trainer to reach policy version" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert "waiting for the trainer to reach policy version 1 (now 0)" in seen, seen + err
    assert "admitted 4 fresh" in seen  # (eta + 1) x B
    assert proc.returncode == 0 and "admitted      4 fresh task(s)" in out


# ------------------------------------------------------------------ 6. small things


def test_serve_binds_localhost_by_default():
    from scripts.monitor import build_parser

    assert build_parser().parse_args(["--serve", "9400"]).host == "127.0.0.1"


def test_no_pytorch_warning_on_commands():
    for argv in (("engine", "--help"), ("monitor", "--help"), ("prepare", "--help")):
        result = rollout(*argv)
        assert result.returncode == 0 and "PyTorch" not in result.stderr, argv
    import scripts.cli  # noqa: F401 - sets the variables for children too

    assert os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS") == "1"


QUICKSTART = REPO / "docs" / "quickstart-local.md"


def test_quickstart_local_trainer_loop_moves_the_engine_version():
    import re

    text = QUICKSTART.read_text()
    loop = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    compile(loop, "trainer.py", "exec")
    assert len(loop.strip().splitlines()) <= 32
    for needed in ("RedisDataSource(args)", "generate_rollout(args, step, source)", "source.save(step)",
                   "/update_weight_version", 'pipeline_trainer_loop="sync"'):
        assert needed in loop, needed
    assert "waiting for the trainer to publish the engines' policy version" in text


def _recorded_session() -> list[tuple[str, list[str], int]]:
    text = QUICKSTART.read_text()
    block = text.split("A session of the first hour, recorded", 1)[1].split("```console\n", 1)[1].split("```", 1)[0]
    steps: list[tuple[str, list[str], int]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], [], -1))
        elif line.startswith("[exit ") and steps:
            command, expected, _ = steps[-1]
            steps[-1] = (command, expected, int(line[6:-1]))
        elif line.strip() and steps:
            steps[-1][1].append(line)
    return steps


def test_quickstart_recorded_session_replays(tmp_path):
    """Each `$ command` of the recorded session prints lines starting with the recorded ones
    and exits with the recorded code."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "rollout").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m scripts.cli "$@"\n')
    (shim / "rollout").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(PATH=f"{shim}:{env['PATH']}", PYTHONPATH=str(REPO), ROLLOUT_REDIS_OUTAGE_S="1")
    steps = _recorded_session()
    assert len(steps) >= 6
    for command, expected, code in steps:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, text=True, capture_output=True,
                                timeout=60)
        lines = [line.strip() for line in (result.stdout + result.stderr).splitlines()]
        assert "Traceback" not in result.stderr, command
        assert result.returncode == code, (command, result.returncode, result.stderr)
        for want in expected:
            assert any(line.startswith(want.strip()) for line in lines), (command, want, lines)


def test_monitor_shows_the_stale_rejection_share(redis_url, namespace):
    import redis as redis_sync

    client = redis_sync.Redis.from_url(redis_url)
    client.hset(f"{namespace}:counters", mapping={"stale": 30, "accepted": 10})
    result = rollout("monitor", "--json", env={"ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_NAMESPACE": namespace})
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["stale_rejected"] == 30 and snap["stale_share"] == 0.75
    table = rollout("monitor", "--once", env={"ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_NAMESPACE": namespace})
    assert table.returncode == 0 and "30 (75% of groups read)" in table.stdout


async def test_monitor_staleness_of_what_waits_for_the_trainer(redis, redis_url, keys):
    """Groups already handed to the trainer do not count as waiting; the waiting ones are seen
    from the current policy version."""
    from pipeline.state import PipelineState
    from pipeline.store.buffer import GroupBuffer
    from pipeline.synthetic import make_group

    buffer = GroupBuffer(redis, keys)
    await buffer.ensure_group()
    for i in range(3):
        await buffer.push(make_group(f"old-{i}", n=2, admission_version=0))
    await buffer.read("trainer", 3, block_ms=100)  # handed out: trained long ago
    for i, v in enumerate((4, 5)):
        await buffer.push(make_group(f"new-{i}", n=2, admission_version=v))
    await PipelineState(redis, keys).set_version(5)
    result = rollout("monitor", "--json", "--redis-url", redis_url, "--namespace", keys.ns)
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["waiting_staleness_hist"] == {"0": 1, "1": 1} and snap["waiting_staleness_max"] == 1
    table = rollout("monitor", "--once", "--redis-url", redis_url, "--namespace", keys.ns)
    assert table.returncode == 0 and "the 2 groups the trainer has not read yet" in table.stdout, table.stdout
