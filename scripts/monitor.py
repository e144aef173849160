"""`rollout monitor`: the command line over `pipeline.ops.monitor` (snapshot), `pipeline.ops.monitor_view`
(live terminal view), `pipeline.ops.metrics` (Prometheus endpoint, wandb).

    rollout monitor                  # live terminal view (rich), refreshed every --interval s
    rollout monitor --once           # print the table once and exit
    rollout monitor --json           # one snapshot as JSON, for scripts
    rollout monitor --serve 9400     # Prometheus text endpoint (see pipeline/ops/metrics.py)
    rollout monitor --wandb          # log the figures to a wandb run (offline works)

Where each figure comes from: pipeline/ops/monitor.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from redis.exceptions import RedisError

from pipeline.keys import Keys
from pipeline.ops.monitor import (
    DEFAULT_DEAD_AFTER_S,
    DEFAULT_RECENT_N,
    DEFAULT_WINDOW_S,
    MonitorSnapshot,
    Target,
    to_json,
)
from pipeline.store.redis_conn import connect, redact


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout monitor", description="Watch one pipeline's queue, buffer and workers.")
    p.add_argument("--redis-url", default=None, help="default: $ROLLOUT_REDIS_URL, else the config's redis.url, else local")
    p.add_argument("--namespace", "-n", default=None,
                   help="key prefix of the pipeline (default: $ROLLOUT_NAMESPACE, else the config's, else 'rollout')")
    p.add_argument("--config", default=None, help="pipeline YAML: redis url, namespace and dead_after_s from it")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--window", type=float, default=DEFAULT_WINDOW_S, help="seconds of recent groups for rates")
    p.add_argument("--recent", type=int, default=DEFAULT_RECENT_N, help="recent groups for staleness/reward figures")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    mode.add_argument("--once", action="store_true", help="print the table once and exit")
    mode.add_argument("--serve", type=int, metavar="PORT", help="serve Prometheus text on PORT (/metrics)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address for --serve (default 127.0.0.1: this machine only; 0.0.0.0 for a Prometheus elsewhere)")
    p.add_argument("--wandb", action="store_true", help="log every refresh to a wandb run (pip install '.[wandb]')")
    p.add_argument("--wandb-project", default="rollout-pipeline")
    p.add_argument("--wandb-mode", choices=["online", "offline"], default=None, help="default: $WANDB_MODE or online")
    return p


def resolve_target(args: argparse.Namespace) -> Target:
    """Flags > $ROLLOUT_REDIS_URL / $ROLLOUT_NAMESPACE > --config > defaults, as every command."""
    from pipeline.config import load_config

    overrides = {}
    if args.redis_url:
        overrides["redis.url"] = args.redis_url
    if args.namespace:
        overrides["redis.namespace"] = args.namespace
    cfg = load_config(args.config, overrides)  # ConfigError: exit 2 at the CLI boundary
    return Target(
        redis_url=cfg.redis.resolved_url(), keys=Keys(cfg.redis.namespace),
        dead_after_s=cfg.workers.dead_after_s if args.config else DEFAULT_DEAD_AFTER_S,
        window_s=args.window, recent_n=args.recent,
    )


async def _one_snapshot(target: Target) -> MonitorSnapshot:
    redis = connect(target.redis_url, retries=2)
    try:
        return await target.snapshot(redis)
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target = resolve_target(args)
    try:
        if args.serve is not None:
            from pipeline.ops.metrics import serve_prometheus

            return serve_prometheus(target, args.host, args.serve)
        if not (args.json or args.once):
            from pipeline.ops.monitor_view import run_live

            return asyncio.run(run_live(target, args))
        snap = asyncio.run(_one_snapshot(target))
    except KeyboardInterrupt:
        return 130
    except (RedisError, OSError) as exc:  # exit 3: connection (scripts/cli.py)
        print(f"rollout monitor: cannot read {redact(target.redis_url)} (namespace {target.keys.ns}): {exc}",
              file=sys.stderr)
        return 3
    if args.json:
        print(to_json(snap))
    else:
        from pipeline.ops.monitor_view import print_once

        print_once(snap)
    if args.wandb:  # one point, e.g. from cron
        from pipeline.ops.metrics import WandbLogger

        logger = WandbLogger(project=args.wandb_project, namespace=target.keys.ns, mode=args.wandb_mode)
        logger.log(snap)
        logger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
