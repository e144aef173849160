"""fakeredis's TCP server in its own process: the demo's Redis on a machine without `redis-server`.

Only for trying the pipeline on one machine: it keeps everything in memory, serves every
client from threads of one Python process, and is several times slower than a real Redis.
Two gaps of fakeredis are closed here: Lua scripts need `lupa` (the `fakeredis[lua]`
dependency), and arq's worker logs `INFO` at start, which fakeredis does not implement, so
this module registers a minimal `INFO` reply.

    python -m pipeline.store.fake_redis PORT      # serve until killed
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

from pipeline.store.local_redis import free_port, stop_process, wait_for_pong

_INFO = (
    "# Server\r\nredis_version:7.0.0\r\nredis_mode:standalone\r\nexecutable:fakeredis\r\n"
    "# Clients\r\nconnected_clients:0\r\n# Memory\r\nused_memory:0\r\nused_memory_human:0B\r\n"
)


def _register_info() -> None:
    # fakeredis registers commands with this decorator on its socket class; INFO is not among them.
    from fakeredis._commands import command
    from fakeredis._socket._fakesocket import FakeSocket

    @command((), (bytes,))
    def info(self: object, *sections: bytes) -> bytes:
        return _INFO.encode()

    FakeSocket.info = info  # type: ignore[attr-defined]


def serve(port: int) -> None:
    import lupa  # noqa: F401 - fail here, not at the first EVAL, when Lua support is missing
    from fakeredis import TcpFakeServer

    _register_info()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    server.daemon_threads = True
    server.serve_forever()


class FakeRedisServer:
    """Same surface as `LocalRedis` (url, start, close, context manager) for the demo."""

    def __init__(self, *, detached: bool = False):
        self.port = free_port()
        self.detached = detached  # own session: a terminal's Ctrl-C does not stop it before its clients drain
        self.proc: subprocess.Popen | None = None
        # a file, not a pipe: socketserver prints a traceback per broken client connection, and
        # a pipe nobody drains would fill up and stall the server mid-run
        self._log = tempfile.TemporaryFile(prefix="rollout-fakeredis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> FakeRedisServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.store.fake_redis", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=self.detached,
        )
        wait_for_pong(self.port, self.proc, self._log_tail, what="fakeredis server")
        return self

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        self._log.close()

    def __enter__(self) -> FakeRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m pipeline.store.fake_redis PORT")
    try:
        serve(int(sys.argv[1]))
    except KeyboardInterrupt:
        pass
