"""The monitor's figures for machines: a Prometheus collector and a wandb logger.

Both are fed by `pipeline.ops.monitor.snapshot`, so a scrape, a wandb point and the
terminal view always show the same numbers. Pipeline counters are exported as
Prometheus counters (`rollout_<name>_total`) so rates come from `rate()`; the
window rates of the snapshot are exported as gauges beside them.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.aio import LoopThread
from pipeline.keys import Counter
from pipeline.store.redis_conn import connect, redact

if TYPE_CHECKING:
    from pipeline.ops.monitor import MonitorSnapshot, Target

GAUGE_COUNTERS = {Counter.RUNNING}  # counters hash fields that go up and down


def figures(snap: MonitorSnapshot) -> dict[str, float]:
    """Every figure of a snapshot under a flat, stable name (wandb keys, --once table)."""
    f: dict[str, float] = {
        "queue/ready": snap.queue.ready,
        "queue/deferred": snap.queue.deferred,
        "queue/running": snap.queue.running,
        "jobs/running_counter": snap.running_counter,
        "buffer/ready": snap.buffer_ready,
        "buffer/pending": snap.buffer_pending,
        "dead_letters": snap.dead_letters,
        "requeue_waiting": snap.requeue_waiting,
        "stale/share": snap.stale_share,
        "workers/live": snap.workers_live,
        "workers/known": len(snap.workers),
        "policy_version": snap.policy_version,
        "throughput/groups_per_min": snap.throughput.groups_per_min,
        "throughput/episodes_per_min": snap.throughput.episodes_per_min,
        "throughput/tokens_per_s": snap.throughput.tokens_per_s,
    }
    if snap.admission_headroom is not None:
        f["admission/headroom"] = snap.admission_headroom
    if snap.staleness_max is not None:
        f["staleness/max"] = snap.staleness_max
    for lag, groups in snap.staleness_hist.items():  # trained in the last steps, lag at the step that trained them
        f[f"staleness/trained_hist/{lag}"] = groups
    if snap.waiting_staleness_max is not None:
        f["staleness/waiting_max"] = snap.waiting_staleness_max
    for env, stats in snap.envs.items():
        f[f"env/{env}/reward_mean"] = stats.reward_mean
        f[f"env/{env}/failure_rate"] = stats.failure_rate
    for name, value in snap.counters.items():
        f[f"counters/{name}"] = value
    for name, value in snap.eval_rounds.items():  # background evaluation rounds
        f[f"eval_rounds/{name}"] = value
    for name, per_dataset in _eval_figures(snap).items():
        for dataset, number in per_dataset.items():
            f[f"eval/{dataset}/{name}"] = number
    return f


EVAL_FIGURES = {
    "rollout": "slime's eval call (rollout id) that started it",
    "version": "the (newest) policy version its results are reported under",
    "tasks": "its tasks",
    "failed": "its tasks with no result",
    "mixed": "its tasks with tokens of several versions (reported under the version of most)",
    "pass_at_1": "pass@1 over its tasks with a result",
    "reward_mean": "mean reward of its measured (not failed) samples",
}


def _eval_figures(snap: MonitorSnapshot) -> dict[str, dict[str, float]]:
    """Figure name -> dataset -> value, of each dataset's last eval round (the monitor's eval view)."""
    out: dict[str, dict[str, float]] = {"rollout": {}, "version": {}, "tasks": {}, "failed": {}, "mixed": {},
                                        "pass_at_1": {}, "reward_mean": {}}
    for dataset, r in snap.eval_results.items():
        out["rollout"][dataset] = r.rollout_id
        if r.versions:
            out["version"][dataset] = max(r.versions)
        out["tasks"][dataset], out["failed"][dataset], out["mixed"][dataset] = r.tasks, r.failed, r.mixed
        if r.pass_at_1 is not None:
            out["pass_at_1"][dataset] = r.pass_at_1
        if r.reward_mean is not None:
            out["reward_mean"][dataset] = r.reward_mean
    return out


# ------------------------------------------------------------------ Prometheus


def _metric_name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


class _Families:
    """Builds labelled metric families; every one carries the pipeline namespace."""

    def __init__(self, namespace: str):
        self.ns = namespace
        self.out: list[Metric] = []

    def gauge(self, name: str, doc: str, value: float | None) -> None:
        family = GaugeMetricFamily(f"rollout_{name}", doc, labels=["namespace"])
        if value is not None:
            family.add_metric([self.ns], float(value))
        self.out.append(family)

    def labelled(self, name: str, doc: str, label: str, values: Mapping[Any, float]) -> None:
        family = GaugeMetricFamily(f"rollout_{name}", doc, labels=["namespace", label])
        for key, value in values.items():
            family.add_metric([self.ns, str(key)], float(value))
        self.out.append(family)

    def counter(self, name: str, doc: str, value: float) -> None:
        family = CounterMetricFamily(f"rollout_{_metric_name(name)}", doc, labels=["namespace"])
        family.add_metric([self.ns], float(value))
        self.out.append(family)


def prometheus_families(snap: MonitorSnapshot) -> list[Metric]:
    m = _Families(snap.namespace)
    m.gauge("up", "1 when the monitor could read the pipeline's Redis", 1)
    m.labelled("queue_jobs", "arq jobs by state", "state", msgspec.structs.asdict(snap.queue))
    m.labelled("buffer_groups", "groups ready for the trainer / handed out and not acked", "state",
               {"ready": snap.buffer_ready, "pending": snap.buffer_pending})
    m.gauge("dead_letters", "entries in the dead-letter stream", snap.dead_letters)
    m.gauge("requeue_waiting", "tasks handed back by the trainer, not yet re-admitted", snap.requeue_waiting)
    m.labelled("eval_rounds", "background evaluation rounds: running, queued (in flight); skipped, reported, failed, "
               "started (so far)", "state", snap.eval_rounds)
    for name, values in _eval_figures(snap).items():
        m.labelled(f"eval_last_round_{name}", f"each eval dataset's last round reported: {EVAL_FIGURES[name]}",
                   "dataset", values)
    m.gauge("stale_share", "share of groups the trainer read that were rejected as stale (all time)", snap.stale_share)
    m.labelled("workers", "workers by liveness", "state",
               {"live": snap.workers_live, "dead": len(snap.workers) - snap.workers_live})
    m.labelled("worker_heartbeat_age_seconds", "seconds since each worker's last heartbeat", "worker",
               {w.id: w.age_s for w in snap.workers})
    m.labelled("worker_load", "groups running in each worker", "worker", {w.id: w.load for w in snap.workers})
    m.gauge("policy_version", "policy version (training steps done)", snap.policy_version)
    m.gauge("admission_headroom", "groups producers may still admit", snap.admission_headroom)
    m.gauge("groups_per_minute", "groups pushed per minute (recent window)", snap.throughput.groups_per_min)
    m.gauge("episodes_per_minute", "episodes per minute (recent window)", snap.throughput.episodes_per_min)
    m.gauge("tokens_per_second", "response tokens per second (recent window)", snap.throughput.tokens_per_s)
    m.labelled("trained_staleness_groups", "groups trained in the last steps, by their staleness at the step that "
               "trained them", "staleness", snap.staleness_hist)
    m.gauge("staleness_max", "largest staleness of the groups waiting for the trainer and of those trained in the "
            "last steps", snap.staleness_max)
    m.labelled("waiting_staleness_groups", "groups the trainer has not read yet, by staleness if read now",
               "staleness", snap.waiting_staleness_hist)
    m.gauge("waiting_staleness_max", "largest staleness among the groups the trainer has not read yet",
            snap.waiting_staleness_max)
    m.labelled("env_reward_mean", "mean reward of recent groups", "env",
               {e: s.reward_mean for e, s in snap.envs.items()})
    m.labelled("env_failure_rate", "failed episodes / episodes in recent groups", "env",
               {e: s.failure_rate for e, s in snap.envs.items()})
    for name, value in sorted(snap.counters.items()):
        if name in GAUGE_COUNTERS:
            m.gauge(f"{_metric_name(name)}_groups", f"counter '{name}' (a gauge)", value)
        else:
            m.counter(name, f"pipeline counter '{name}'", value)
    return m.out


class PipelineCollector(Collector):
    """Takes a snapshot at every scrape (on a private event loop thread)."""

    def __init__(self, target: Target, timeout_s: float = 10.0):
        self.target = target
        self.timeout_s = timeout_s
        self._loop = LoopThread("rollout-monitor-prometheus")
        self._redis = connect(target.redis_url, retries=2)
        self._lock = threading.Lock()  # the HTTP server may serve scrapes concurrently

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            try:
                snap = self._loop.run(self.target.snapshot(self._redis), timeout=self.timeout_s)
            except Exception as exc:  # a scrape must answer even when Redis is down
                print(f"rollout monitor: scrape failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                down = GaugeMetricFamily("rollout_up", "1 when the monitor could read Redis", labels=["namespace"])
                down.add_metric([self.target.keys.ns], 0.0)
                yield down
                return
        yield from prometheus_families(snap)

    def close(self) -> None:
        try:
            self._loop.run(self._redis.aclose(), timeout=5)
        finally:
            self._loop.close()


def start_prometheus(target: Target, host: str, port: int) -> tuple[Any, PipelineCollector]:
    """Serve `/metrics` on host:port in a background thread. Returns (server, collector)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    collector = PipelineCollector(target)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, collector


def serve_prometheus(target: Target, host: str, port: int) -> int:
    server, collector = start_prometheus(target, host, port)
    print(f"rollout monitor: Prometheus metrics of ns={target.keys.ns} on {redact(target.redis_url)} "
          f"at http://{host}:{port}/metrics (Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        collector.close()
    return 0


# ----------------------------------------------------------------------- wandb


class WandbLogger:
    """Logs `figures(snapshot)` to a wandb run. wandb is an optional extra, imported lazily."""

    def __init__(self, *, project: str, namespace: str, mode: str | None = None, run_dir: str | None = None):
        try:
            import wandb
        except ImportError:
            raise SystemExit(
                "rollout monitor --wandb: wandb is not installed; install it with "
                "`pip install 'rollout-pipeline[wandb]'` (or `pip install wandb`)"
            ) from None
        mode = mode or os.environ.get("WANDB_MODE", "online")
        self.run = wandb.init(
            # $WANDB_MODE may hold any string: wandb.init checks it (its annotation is a Literal)
            project=project, name=f"monitor-{namespace}", mode=cast(Any, mode), dir=run_dir, job_type="pipeline-monitor",
            config={"namespace": namespace}, reinit=True,
        )

    def log(self, snap: MonitorSnapshot) -> None:
        self.run.log(figures(snap))

    def close(self) -> None:
        self.run.finish()
