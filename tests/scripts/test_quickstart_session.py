"""The normal run of docs/quickstart-local.md, replayed (issue 27's Must-show): prepare, engine,
workers, enqueue, the doc's own trainer loop and the monitor, each run as the doc runs it, on a
private redis-server and the simulated engine, with the doc's own data, YAML and trainer.py.

The doc records each command's output ("A normal run, recorded"); a recorded line holds run
figures (times, ids, rewards), so the replay checks the key lines: each KEY_LINES pattern must
match a line of the doc's block for that command *and* a line the replay printed. A code
change that drops or rewords one of them fails here, and so does a doc that stops showing it.

`ROLLOUT_RECORD_SESSION=<dir>` writes each command's output there (to refresh the doc).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.store.local_redis import LocalRedis, free_port

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart-local.md"
DOC_PORT = "30000"
MARKER = "A normal run, recorded"

# command (as the doc writes it, up to its options) -> patterns of its key lines
KEY_LINES: dict[str, list[str]] = {
    "rollout prepare": [r"wrote 2 tasks to tasks\.jsonl \(0 invalid rows skipped\)",
                        r"│ gsm +│ +2 │ +2 │ +0 │"],
    "rollout engine": [r"simulated SGLang engine on http://127\.0\.0\.1:\d+ \(no model, time scale 1\.0; tokenizer "],
    "rollout workers": [r"workers\.settings INFO worker \S+ ready: queue myexp:queue, 8 groups at once",
                        r"workers\.groups INFO group done: task gsm/\w+, env gsm, reward mean \d\.\d{3}, \d+ tokens, "
                        r"\d+\.\ds \(4 episodes, 0 failed\)"],
    "rollout enqueue": [r"waiting for the trainer to reach policy version 1 \(now 0\)",
                        r"admitted +6 fresh task\(s\), 0 requeued; epochs finished: 3"],
    "ROLLOUT_WAIT_LOG_S=5 python trainer.py": [
        r"pipeline\.slime INFO rollout 0: waiting for groups \(0/2, ready=\d+ pending=\d+ held=\d+\): "
        r"(no workers alive|the producer is idle|\d+ group\(s\) in flight|\d+ due group)",
        r"^step 0: 2 groups, mean reward \d\.\d\d$", r"^step 2: 2 groups, mean reward \d\.\d\d$"],
    "rollout monitor --once": [r"pipeline 'myexp'  ·  policy version 2", r"│ gsm +│ +6 │ +24 │",
                               r"trained: the 6 groups of the last 3 step\(s\)", r"│ live  │"],
}


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def recorded_run(text: str) -> dict[str, str]:
    """The doc's recorded normal run: command -> its output block."""
    section = text.split(MARKER, 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for block in _blocks(section, "console"):
        first, _, rest = block.partition("\n")
        assert first.startswith("$ "), block
        out[first[2:]] = rest
    return out


def _command_for(key: str, recorded: dict[str, str]) -> str:
    matches = [c for c in recorded if c.startswith(key)]
    assert len(matches) == 1, (key, list(recorded))
    return matches[0]


def _matches(pattern: str, text: str) -> bool:
    return any(re.search(pattern, line.rstrip()) for line in text.splitlines())


def test_the_doc_records_every_key_line():
    recorded = recorded_run(QUICKSTART.read_text())
    assert len(recorded) == len(KEY_LINES)
    for key, patterns in KEY_LINES.items():
        block = recorded[_command_for(key, recorded)]
        for pattern in patterns:
            assert _matches(pattern, block), (key, pattern)


def _setup(tmp: Path, text: str, engine_port: int) -> None:
    """mydata.jsonl, pipeline.yaml and trainer.py exactly as the doc gives them (the port aside)."""
    (tmp / "mydata.jsonl").write_text(_blocks(text, "json")[0])
    (tmp / "pipeline.yaml").write_text(_blocks(text, "yaml")[0].replace(DOC_PORT, str(engine_port)))
    (tmp / "trainer.py").write_text(_blocks(text, "python")[0].replace(DOC_PORT, str(engine_port)))


class Session:
    def __init__(self, tmp: Path, env: dict[str, str], engine_port: int):
        self.tmp, self.env, self.engine_port = tmp, env, engine_port
        self.background: dict[str, subprocess.Popen] = {}
        self.outputs: dict[str, str] = {}

    def _argv(self, command: str) -> str:
        return command.replace(DOC_PORT, str(self.engine_port))

    def run(self, command: str, timeout: float) -> None:
        result = subprocess.run(["bash", "-c", self._argv(command)], cwd=self.tmp, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        self.outputs[command] = result.stdout
        assert result.returncode == 0, (command, result.stdout[-3000:])

    def start(self, command: str) -> None:
        log = open(self.tmp / f"{len(self.background)}.log", "w")  # noqa: SIM115 - closed in stop()
        self.background[command] = subprocess.Popen(
            ["bash", "-c", "exec env " + self._argv(command)], cwd=self.tmp, env=self.env, text=True,  # env: VAR=1 cmd
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.background[command].log = log  # type: ignore[attr-defined]

    def wait(self, command: str, timeout: float) -> None:
        self.background[command].wait(timeout)

    def until_printed(self, command: str, pattern: str, timeout: float) -> None:
        """Until the background command's output has a line matching `pattern`."""
        proc, deadline = self.background[command], time.monotonic() + timeout
        while not _matches(pattern, Path(proc.log.name).read_text()):  # type: ignore[attr-defined]
            assert proc.poll() is None, (command, Path(proc.log.name).read_text()[-3000:])  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, (command, "never printed", pattern)
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.background.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the session this test started for it
        for command, proc in self.background.items():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            proc.log.close()  # type: ignore[attr-defined]
            self.outputs[command] = Path(proc.log.name).read_text()  # type: ignore[attr-defined]


@pytest.mark.skipif(sys.platform != "linux", reason="bash and process groups")
def test_the_recorded_normal_run_replays(tmp_path):
    text = QUICKSTART.read_text()
    recorded = recorded_run(text)
    commands = {key: _command_for(key, recorded) for key in KEY_LINES}
    engine_port = free_port()
    _setup(tmp_path, text, engine_port)
    with LocalRedis() as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
        shim = tmp_path / "bin"  # `rollout` and `python` as a user's shell finds them: this checkout's
        shim.mkdir()
        (shim / "rollout").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m scripts.cli "$@"\n')
        (shim / "rollout").chmod(0o755)
        (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shim / "python").chmod(0o755)
        env.update(PATH=f"{shim}{os.pathsep}{env['PATH']}", ROLLOUT_REDIS_URL=server.url, ROLLOUT_NAMESPACE="myexp", PYTHONUNBUFFERED="1", COLUMNS="100",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
        session = Session(tmp_path, env, engine_port)
        started = time.monotonic()
        try:
            session.run(commands["rollout prepare"], timeout=60)
            trainer = commands["ROLLOUT_WAIT_LOG_S=5 python trainer.py"]
            # a terminal each; the workers' terminal last, once the trainer has said it waits for
            # them (the doc's recorded wait took a slow machine's start-up; a fast one may not wait
            # ROLLOUT_WAIT_LOG_S at all, and the line would never be printed)
            for key in ("rollout engine", "rollout enqueue"):
                session.start(commands[key])
            session.start(trainer)
            session.until_printed(trainer, KEY_LINES["ROLLOUT_WAIT_LOG_S=5 python trainer.py"][0], timeout=60)
            session.start(commands["rollout workers"])
            session.wait(trainer, timeout=240)
            assert session.background[trainer].returncode == 0
            session.wait(commands["rollout enqueue"], timeout=60)  # it ends once all 3 epochs are admitted
            session.run(commands["rollout monitor --once"], timeout=60)
        finally:
            session.stop()
        elapsed = time.monotonic() - started
    record = os.environ.get("ROLLOUT_RECORD_SESSION")
    if record:
        for i, (command, output) in enumerate(session.outputs.items()):
            Path(record, f"{i}.txt").write_text(f"$ {command}\n{output}")
    for key, patterns in KEY_LINES.items():
        output = session.outputs[commands[key]]
        for pattern in patterns:
            assert _matches(pattern, output), (key, pattern, output[-3000:])
        assert "Traceback" not in output, (key, output[-3000:])
    assert elapsed < 240
