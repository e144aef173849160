"""Start a private `redis-server` on a free loopback port (tests, demo, benchmarks).

Never touches a shared Redis: each instance gets its own port and directory.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_pong(
    port: int, proc: subprocess.Popen, log_tail: Callable[[], str], *, what: str, timeout: float = 10.0
) -> None:
    """Wait until a server process just started on `port` answers PING; its log tail if it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")  # RESP, not inline: fakeredis parses only RESP
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} on port {port} not ready after {timeout}s")


def server_pid(port: int, timeout: float = 2.0) -> int | None:
    """The process id a Redis server on `port` reports (`INFO server`), None if it says none."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
        reply = b""
        while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    for line in reply.decode(errors="replace").split("\r\n"):
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    return None


class PortTaken(RuntimeError):
    """A server started on a port that another server holds (picked free, taken since)."""


def check_own_port(port: int, proc: subprocess.Popen, what: str) -> None:
    """Raise PortTaken if the server answering on `port` is not `proc`: a port picked free may be
    taken before the server binds it; the PONG then was the other server's, and ours exits."""
    pid = server_pid(port)
    if pid != proc.pid:
        stop_process(proc, kill=True)
        raise PortTaken(f"{what}: port {port} is answered by process {pid}, not by the one just started")


def stop_process(proc: subprocess.Popen, *, kill: bool = False, grace_s: float = 10.0) -> None:
    """SIGTERM (or SIGKILL) a server process and reap it; SIGKILL if it outlives the grace."""
    if kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LocalRedis:
    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        data_dir: str | None = None,
        detached: bool = False,
        appendfsync: str = "always",
    ):
        """`port`: fixed (a restart keeps it; default a free one). `appendonly`: persist to an AOF in
        `data_dir`, fsynced per `appendfsync` ("always", "everysec", "no"); a `start()` after a
        SIGKILL (`stop(kill=True)`) replays it."""
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not found on PATH (Debian: apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self._may_move = port is None  # a port we picked may be picked again until the first start
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.detached = detached  # own session: a terminal's Ctrl-C does not stop it before its clients drain
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="rollout-redis-")
        self.dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync if self.appendonly else "everysec",
            "--logfile", str(self.dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=self.detached
        )
        wait_for_pong(self.port, self.proc, self._log_tail, what="redis-server")
        try:
            check_own_port(self.port, self.proc, "redis-server")
        except PortTaken:
            if not self._may_move:
                raise
            self.port, self._may_move = free_port(), False
            return self.start()
        self._may_move = False  # clients have the URL now: a restart keeps the port
        return self

    def _log_tail(self) -> str:
        log = self.dir / "redis.log"
        return log.read_text()[-2000:] if log.exists() else ""

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is not None:
            stop_process(self.proc, kill=kill)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
