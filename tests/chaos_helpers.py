"""Shared pieces of the run-level chaos tests: the slime-side trainer thread and the
worker-liveness waits. Each test brings its own producer, workers and faults."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

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
        done: Callable[["Trainer"], bool],
        after_step: Optional[Callable[[int], None]] = None,
    ):
        super().__init__(daemon=True)
        self.args = SimpleNamespace(
            pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=batch, n_samples_per_prompt=n,
            pipeline_eta=eta, pipeline_wait_timeout_s=90.0, pipeline_publish_engine=False,
            # keep (and count) stale groups: a requeued task is re-admitted under the producer's current
            # epoch, which would blur the per-epoch exactly-once count these tests are about
            pipeline_stale_policy="keep",
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
