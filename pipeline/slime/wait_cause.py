"""Why a training step waits for groups, in words (the trainer's wait line, pipeline/slime/data_source.py).

Counts alone (`ready=0 pending=0 held=0`) leave the user to guess; one look at Redis tells
which part holds the step:
- a due group still generating (due-first keeps its place: the step waits for it);
- no workers alive (no heartbeat in `{ns}:workers` within `dead_after_s`) while jobs wait;
- the producer idle or out of tasks: nothing queued, nothing admitted and still open;
- groups in flight: jobs queued or generating, the oldest enqueued N s ago.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from pipeline.keys import Keys

DEAD_AFTER_S = 20.0  # workers.dead_after_s's default: a worker silent this long is not alive


async def wait_cause(redis: aioredis.Redis, keys: Keys, *, due_missing: int = 0,
                     dead_after_s: float = DEAD_AFTER_S) -> str:
    """One clause naming what holds the step (several when several hold it)."""
    seconds, micros = await redis.time()
    now = seconds + micros / 1e6
    pipe = redis.pipeline(transaction=False)
    pipe.zcount(keys.workers, now - dead_after_s, "+inf")
    pipe.zrange(keys.workers, -1, -1, withscores=True)  # the newest heartbeat
    pipe.zcard(keys.queue)  # arq keeps a job here until it finishes: queued or generating
    # the oldest job not taken (score: enqueue time, ms; a job taken by a worker is moved past now)
    pipe.zrange(keys.queue, 0, 0, withscores=True)
    pipe.zcard(keys.open)  # admitted and not yet trained or discarded
    pipe.llen(keys.requeue)
    live, newest, jobs, oldest, open_groups, requeued = await pipe.execute()
    causes = []
    if due_missing:
        causes.append(f"{due_missing} due group(s) still generating (due-first keeps their places)")
    if jobs and not live:
        heard = f"last heartbeat {now - newest[0][1]:.0f}s ago" if newest else "none has registered"
        causes.append(f"no workers alive ({heard}; is `rollout workers` running on namespace {keys.ns}?)")
    if not jobs and not open_groups:
        waiting = f", {requeued} handed-back task(s) not re-admitted" if requeued else ""
        causes.append(f"the producer is idle or out of tasks: nothing queued or admitted{waiting} "
                      f"(is `rollout enqueue` running on namespace {keys.ns}?)")
    elif jobs and live and not due_missing:
        taken_all = not oldest or oldest[0][1] / 1000 > now  # every job is running
        age = "" if taken_all else f", the oldest enqueued {max(0.0, now - oldest[0][1] / 1000):.0f}s ago"
        causes.append(f"{jobs} group(s) in flight on {live} live worker(s){age}")
    elif not jobs and open_groups and not due_missing:
        causes.append(f"{open_groups} admitted group(s) not trained yet and no job queued")
    return "; ".join(causes) or "no cause found in Redis"
