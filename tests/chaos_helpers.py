"""Shared pieces of the run-level chaos tests: the slime-side trainer thread and the
worker-liveness waits. Each test brings its own producer, workers and faults."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Optional

from pipeline.keys import Keys
from pipeline.slime import RedisDataSource, generate_rollout


class Trainer(threading.Thread):
    """slime's loop: generate_rollout -> (train) -> save -> `after_step`, recording what each step trained.

    Stops before a step when `done(self)` is true, or after `max_steps`.
    """

    def __init__(
        self,
        redis_url: str,
        ns: str,
        *,
        batch: int,
        n: int,
        eta: int,
        max_steps: int,
        done: Callable[[Trainer], bool],
        after_step: Optional[Callable[[int], None]] = None,
        wait_timeout_s: float = 90.0,
    ):
        super().__init__(daemon=True)
        self.args = SimpleNamespace(
            pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=batch, n_samples_per_prompt=n,
            pipeline_eta=eta, pipeline_wait_timeout_s=wait_timeout_s, pipeline_publish_engine=False,
            # keep (and count) stale groups: a requeued task is re-admitted under the producer's current
            # epoch, which would blur the per-epoch exactly-once count these tests are about
            pipeline_stale_policy="keep",
            # this loop pushes weights (`after_step`) before the next rollout, as slime's train.py does
            pipeline_trainer_loop="sync",
        )
        self.max_steps, self.done, self.after_step = max_steps, done, after_step
        self.groups: list[list[Any]] = []  # every trained group's samples, in training order
        self.steps = 0
        self.error: BaseException | None = None

    @property
    def trained_groups(self) -> list[str]:
        return [group[0].metadata["pipeline"]["group_id"] for group in self.groups]

    def trained(self) -> list[tuple[str, int]]:
        return [trained_key(g) for g in self.trained_groups]

    def trained_tasks(self, epoch: int = 0) -> set[str]:
        return {t for t, e in self.trained() if e == epoch}

    def run(self) -> None:
        source = RedisDataSource(self.args)
        try:
            for rid in range(self.max_steps):
                if self.done(self):
                    return
                self.groups += generate_rollout(self.args, rid, source).samples
                time.sleep(0.05)  # the optimizer step
                source.save(rid)
                self.steps = rid + 1
                if self.after_step is not None:
                    self.after_step(rid)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            source.close()

    def join_and_check(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), "trainer did not finish"
        if self.error is not None:
            raise self.error


def trained_key(group_id: str) -> tuple[str, int]:
    """(task id, epoch) from a job id `{task}:{epoch}` or `{task}:{epoch}r{requeue}`."""
    task, tail = group_id.rsplit(":", 1)
    return task, int(tail.split("r")[0])


async def live_workers(redis, keys: Keys) -> list[str]:
    return [w.decode() for w in await redis.zrange(keys.workers, 0, -1)]


async def wait_workers(redis, keys: Keys, count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while len(await live_workers(redis, keys)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers heart-beating after {timeout}s"
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------ lost replies

class LossyProxy:
    """A loopback TCP proxy in front of a redis-server that loses replies.

    Every chunk a client sends is forwarded; each reply chunk the server sends back is, with
    probability `rate`, not forwarded: the proxy drops both connections instead. The server
    has executed the command (its reply exists), the client never hears of it and, through
    redis-py's retry, sends it again: the fault a write must be safe against. `down(s)` also
    refuses new connections and cuts open ones for `s` seconds (a Redis restart, as clients
    see it). Runs its own event loop in a thread, so sync code and subprocesses can use it.
    """

    def __init__(self, target_port: int, *, rate: float = 0.01, seed: int = 0, host: str = "127.0.0.1"):
        import random as _random

        self.target = (host, target_port)
        self.rate = rate
        self.rng = _random.Random(seed)
        self.port = 0
        self.replies = 0  # reply chunks seen
        self.dropped = 0  # reply chunks lost (connections dropped)
        self.refused = 0
        self._down_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._lose: list[list] = []  # [pattern, times left]: lose the reply to a request containing it
        self.stalled = False  # hold every reply (a half-open connection, as the client sees it)

    def lose_reply_to(self, pattern: bytes, times: int = 1) -> None:
        """Lose the reply to the next `times` requests whose bytes contain `pattern` (b"EXEC", ...)."""
        self._lose.append([pattern, times])

    def _should_lose(self, request: bytes) -> bool:
        for rule in self._lose:
            if rule[1] > 0 and rule[0] in request:
                rule[1] -= 1
                return True
        return bool(self.rate) and self.rng.random() < self.rate

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LossyProxy:
        self._thread = threading.Thread(target=self._run, daemon=True, name="lossy-proxy")
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def down(self, seconds: float) -> None:
        """Refuse new connections and cut the open ones for `seconds`."""
        self._down_until = time.monotonic() + seconds

        def cut() -> None:
            for w in list(self._writers):
                w.transport.abort()

        assert self._loop is not None
        self._loop.call_soon_threadsafe(cut)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._down_until:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        def drop() -> None:
            writer.transport.abort()
            up_writer.transport.abort()

        last = [b""]  # the latest request chunk of this connection

        async def client_to_server() -> None:
            while data := await reader.read(65536):
                last[0] = data
                up_writer.write(data)
                await up_writer.drain()

        async def server_to_client() -> None:
            while data := await up_reader.read(65536):
                self.replies += 1
                while self.stalled:
                    await asyncio.sleep(0.05)
                if self._should_lose(last[0]):
                    self.dropped += 1
                    return
                writer.write(data)
                await writer.drain()

        try:
            pumps = [asyncio.ensure_future(client_to_server()), asyncio.ensure_future(server_to_client())]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pumps:
                p.cancel()
        except Exception:  # noqa: BLE001 - any error: the connection is gone, as with a real fault
            pass
        finally:
            drop()
            self._writers -= {writer, up_writer}

    def close(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)

    def __enter__(self) -> LossyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
