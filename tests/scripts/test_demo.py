"""`rollout demo --short` end to end, as a user runs it: its summary against the pipeline's own
counters in Redis, and a clean shutdown on Ctrl-C (SIGINT)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis as redis_sync

from pipeline.keys import Counter
from pipeline.state import PipelineState
from pipeline.store.buffer import GroupBuffer
from scripts.demo import PROFILES

SHORT = PROFILES["short"]


def _demo(*argv: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "scripts.cli", "demo", *argv], env=env, text=True, **popen)


async def test_short_demo_summary_matches_the_buffer_counters(redis, redis_url, keys, tmp_path):
    summary_path = tmp_path / "summary.json"
    proc = _demo("--short", "--redis-url", redis_url, "--namespace", keys.ns, "--summary-json", str(summary_path),
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=150)
    assert proc.returncode == 0, out
    s = json.loads(summary_path.read_text())
    counters = await PipelineState(redis, keys).counters()

    assert s["steps"] == SHORT.steps and not s["interrupted"] and not s["error"]
    assert s["groups_trained"] == SHORT.steps * SHORT.batch == counters[Counter.ACCEPTED]
    assert s["samples_trained"] == s["groups_trained"] * SHORT.n
    assert s["staleness_max"] <= s["eta"] == SHORT.eta  # requeue policy: nothing staler was trained
    assert s["stale_rejected"] == counters.get(Counter.STALE, 0)
    assert s["episodes"] == counters[Counter.EPISODES] >= s["samples_trained"]
    assert s["episodes_failed"] == counters.get(Counter.EPISODES_FAILED, 0)
    assert s["dead_letters"] == await redis.xlen(keys.dead) == counters.get(Counter.DEAD, 0)
    assert set(s["reward_mean"]) == {"math", "tools"}
    assert all(0.0 <= r <= 1.0 for r in s["reward_mean"].values())
    assert s["groups_per_s"] == pytest.approx(s["groups_trained"] / s["duration_s"], rel=1e-2)
    assert 0.0 <= s["trainer_wait_ratio"] <= 1.0
    # every trained or discarded group came through the buffer once; what is left is not yet consumed
    ready, pending = await GroupBuffer(redis, keys).depth()
    assert pending == 0  # every step was saved (acknowledged)
    discarded = counters.get(Counter.STALE, 0) + counters.get(Counter.FILTERED, 0)
    assert counters[Counter.BUFFERED] == counters[Counter.ACCEPTED] + discarded + ready
    assert await redis.zcard(keys.workers) == 0  # the pool drained and left
    assert counters.get(Counter.RUNNING, 0) == 0
    assert "staleness max vs eta" in out and "groups/s" in out


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(pattern: str, proc: subprocess.Popen, lines: list[str], deadline_s: float) -> re.Match:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"{pattern!r} not seen: {''.join(lines)[-2000:]}")


def _wait_until_training(port: int, deadline_s: float) -> None:
    """Workers heart-beating and the trainer past its first step: every part is running."""
    client = redis_sync.Redis(port=port)
    deadline = time.monotonic() + deadline_s
    try:
        while time.monotonic() < deadline:
            if client.zcard("demo:workers") and int(client.get("demo:version") or 0) >= 1:
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise AssertionError("the demo never reached its second training step")


def test_ctrl_c_shuts_everything_down():
    proc = _demo("--steps", "200", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    try:
        match = _wait_for(r"redis redis://127\.0\.0\.1:(\d+)/0 namespace demo; run directory (\S+)", proc, lines, 60)
        port, workdir = int(match.group(1)), match.group(2)
        _wait_until_training(port, 90)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(lines) + out
    assert "interrupted" in out
    assert not _port_open(port), "redis-server still running after Ctrl-C"
    leftovers = subprocess.run(["pgrep", "-f", workdir], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"processes of the demo still running: {leftovers}"


def test_short_demo_runs_on_fakeredis_where_no_redis_server_is_installed(tmp_path):
    """The README's demo command on a machine without redis-server: fakeredis's TCP server
    (with Lua and the INFO that arq's worker asks for) carries the whole pipeline."""
    summary_path = tmp_path / "summary.json"
    proc = _demo("--short", "--private-redis", "fake", "--summary-json", str(summary_path),
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-3000:]
    s = json.loads(summary_path.read_text())
    assert s["steps"] == SHORT.steps and not s["error"] and not s["interrupted"], s
    assert s["groups_trained"] == SHORT.steps * SHORT.batch and s["staleness_max"] <= SHORT.eta, s
    assert s["dead_letters"] == 0 and set(s["reward_mean"]) == {"math", "tools"}, s
