"""The slime side: what slime's `--*-path` flags load, built on the contracts above.

    data_source.py   RedisDataSource (--data-source-path), generate_rollout (--rollout-function-path)
    samples.py       slime's Sample on one side, the wire SampleGroup on the other
    advantages.py    post_process_rewards (--custom-reward-post-process-path)
    eval_entry.py    slime's eval call through the workers
    weight_push.py   what a weight push does to the requests running on the engines
    trained_log.py   the staleness of what was trained recently (the monitor reads it)
    wait_cause.py    why a training step waits, in words

Inside this package `import slime` is slime's own (imports are absolute).
"""

from __future__ import annotations

# Launch scripts written before these modules had a package name the flags' targets one level up
# (the package, then `RedisDataSource`): slime resolves a flag with getattr, so they still load.
# data_source is imported only then: importing a sibling (the monitor reads trained_log) must not
# import samples, which binds slime's classes, or LocalSample without slime, for good.
_FLAG_TARGETS = frozenset({"RedisDataSource", "generate_rollout", "post_process_rewards"})


def __getattr__(name: str) -> object:
    if name in _FLAG_TARGETS:
        from pipeline.slime import data_source

        return getattr(data_source, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
