"""A trainer process for the run-shaped chaos tests: slime's train.py loop around the real data
source, in its own process so that a test can SIGKILL it anywhere and start it again.

    python -m tests.support.chaos_trainer --redis-url U --namespace NS --workdir D --tasks tasks.jsonl \
        --batch B --n N --eta E [--max-steps S] [--train-step-s T]

train.py's order: `data_source.load(checkpoint)` at start (when `D/ckpt` holds one), then per
step `generate_rollout` -> train (a short sleep) -> the model checkpoint (`D/ckpt`, written
atomically) -> `data_source.save(rid)`, which writes the step to the ledger (`D/ledger`,
`pipeline_ledger_dir`) before it acknowledges it. It stops (exit 0) before a step once the
ledger holds an epoch-0 group of every task in `--tasks`, or after `--max-steps` (exit 3).
Each batch got is appended to `D/got.jsonl` (`rid`, group ids: a replayed step appears
twice), and while it trains (got, not saved) `D/training` holds its rollout id. Each finished step is
appended to `D/steps.jsonl` (`rid`, wall time `t`, group ids), fsync'ed,
for the step-rate checks; what was trained is read back from the ledger, not from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def ledger_rows(ledger_dir: Path) -> list[dict]:
    """Every trained sample's (rollout_id, group_id, task_id, epoch, attempt), read from the Parquet files."""
    from pipeline.ops.ledger import Ledger

    if not ledger_dir.is_dir() or not Ledger(ledger_dir).steps():
        return []
    table = Ledger(ledger_dir).read_range(columns=["rollout_id", "group_id", "task_id", "epoch", "attempt"])
    return table.to_pylist()  # type: ignore[no-any-return]


def _done(ledger_dir: Path, task_ids: set[str]) -> bool:
    return task_ids <= {row["task_id"] for row in ledger_rows(ledger_dir) if row["epoch"] == 0}


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")
        log.flush()
        os.fsync(log.fileno())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chaos_trainer")
    for flag in ("--redis-url", "--namespace", "--workdir", "--tasks"):
        p.add_argument(flag, required=True)
    for flag in ("--batch", "--n", "--eta"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--wait-timeout-s", type=float, default=120.0)
    p.add_argument("--train-step-s", type=float, default=0.05, help="the simulated optimizer step")
    a = p.parse_args(argv)

    from pipeline.slime.data_source import RedisDataSource, generate_rollout

    workdir = Path(a.workdir)
    ledger_dir, ckpt, steps_log = workdir / "ledger", workdir / "ckpt", workdir / "steps.jsonl"
    task_ids = {json.loads(line)["id"] for line in Path(a.tasks).read_text().splitlines() if line.strip()}
    args = SimpleNamespace(
        pipeline_redis_url=a.redis_url, pipeline_namespace=a.namespace, rollout_batch_size=a.batch,
        n_samples_per_prompt=a.n, pipeline_eta=a.eta, pipeline_wait_timeout_s=a.wait_timeout_s,
        pipeline_publish_engine=False, pipeline_ledger_dir=str(ledger_dir),
        # keep (and count) stale groups: a requeued task is re-admitted under the producer's current
        # epoch, which would blur the per-epoch exactly-once count these tests are about
        pipeline_stale_policy="keep",
        pipeline_trainer_loop="sync",  # weights pushed after each step, before the next rollout (train.py)
    )
    source = RedisDataSource(args)
    start = int(ckpt.read_text()) + 1 if ckpt.exists() else 0
    source.load(start - 1)
    try:
        for rid in range(start, a.max_steps):
            if _done(ledger_dir, task_ids):
                return 0
            batch = generate_rollout(args, rid, source).samples
            groups = [group[0].metadata["pipeline"]["group_id"] for group in batch]
            _append(workdir / "got.jsonl", {"rid": rid, "groups": groups})
            (workdir / "training").write_text(str(rid))  # a test may SIGKILL us now: got, not yet saved
            time.sleep(a.train_step_s)  # the optimizer step
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(str(rid))
            os.replace(tmp, ckpt)  # the model checkpoint, then the data source's save (train.py)
            source.save(rid)
            _append(steps_log, {"rid": rid, "t": time.time(), "groups": groups})
        return 0 if _done(ledger_dir, task_ids) else 3
    finally:
        source.close()


if __name__ == "__main__":
    sys.exit(main())
