"""What `rollout rm-server` (workers/rm_server.py) admits, and what it shows an operator.

- `Admission`: one environment's verifier pool, admitting a request only when the pool can
  answer it within the latency budget. The estimate for a new request is
  `ceil((in flight + 1) / workers) x service time`: the requests already admitted (reading
  their body, waiting for a worker or being verified) pass through `workers` verifications at a
  time, each taking the observed service time (an exponential average of the time a request
  holds a worker; before the first, a stated prior). The issue's `(queue + 1) x service /
  workers`, rounded up to whole rounds of the pool, so that it bounds the wait of requests that
  take the average time rather than averaging it. A request that finds a worker free is always
  admitted: its own verification is no longer than it is, whatever the budget says. The prior
  (`--service-prior-s`, 10 s) is cautious: a cold burst admits `budget / prior x workers`
  requests (6 with the defaults) until the first answer replaces it with a measured time.
  It is an estimate: a burst of slow answers that arrives while the average was set by fast
  ones is admitted on the fast figure.
- `ServerStats`: the counters (answered by status, busy 503s by reason, 400s, undecided,
  failed measurements), a latency histogram per environment, served as Prometheus text
  (`GET /<token>/metrics`) and summed up in a periodic log line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Union

from prometheus_client import Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.config import EnvConfig
from workers.envs.math import MathOptions
from workers.envs.nemo_skills import NemoSkillsOptions
from workers.envs.options import parse_options

log = logging.getLogger("workers.rm_server")

SMOOTHING = 0.3  # weight of the newest service time in the average: a few answers move it
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
BUSY_LATENCY = "latency_budget"  # the pool could not answer within --latency-budget-s
BUSY_PENDING = "max_pending"  # --max-pending requests were in flight


def verifier_workers(name: str, config: EnvConfig, fallback: int) -> int:
    """How many verifications of environment `name` run at once: the checker processes of the
    kinds that check in a local pool (math, nemo_skills: `processes`; 1 with `check_in:
    inline`, which runs in the server's event loop); else `fallback` (--max-pending): their
    verifier's concurrency is not known here, so only --max-pending bounds what they admit."""
    options: Union[MathOptions, NemoSkillsOptions]
    if config.kind == "math":
        options = parse_options(name, config, MathOptions)
    elif config.kind == "nemo_skills":
        options = parse_options(name, config, NemoSkillsOptions)
    else:
        return fallback
    return 1 if options.check_in == "inline" else max(1, options.processes)


class Admission:
    """One environment's verifier pool: how many requests are in flight, how long one holds a
    worker, and whether another can be answered within `budget_s` (module doc)."""

    def __init__(self, workers: int, budget_s: float, prior_s: float):
        self.workers = workers
        self.budget_s = budget_s
        self.service_s = prior_s  # until the first verification is observed
        self.observed = 0
        self.in_flight = 0  # admitted, not answered
        self._slots: Union[asyncio.Semaphore, None] = None  # made on the server's loop, at first use

    def estimate_s(self) -> float:
        """When a request admitted now would be answered, from the requests in flight."""
        return math.ceil((self.in_flight + 1) / self.workers) * self.service_s

    def over_budget_s(self) -> float:
        """How far past the budget a request admitted now would be answered (0: admit it)."""
        if self.in_flight < self.workers:  # a worker is free: only its own verification is ahead of it
            return 0.0
        return max(0.0, self.estimate_s() - self.budget_s)

    @contextlib.asynccontextmanager
    async def worker(self) -> AsyncIterator[None]:
        """Hold one of the pool's workers; the time held is the service time observed."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            started = time.monotonic()
            try:
                yield
            finally:
                self.observe(time.monotonic() - started)

    def observe(self, service_s: float) -> None:
        """One verification's time: the first replaces the prior, later ones move the average."""
        self.observed += 1
        self.service_s = service_s if self.observed == 1 else self.service_s + SMOOTHING * (service_s - self.service_s)


class ServerStats:
    """The rm-server's counters and latencies (module doc). Counters are keyed by environment
    (only configured names: an unknown one is a 404 before any is counted) or HTTP status."""

    def __init__(self) -> None:
        self.answered: collections.Counter[int] = collections.Counter()  # HTTP status -> requests answered
        self.busy: collections.Counter[tuple[str, str]] = collections.Counter()  # (env, reason) -> 503s
        self.bad_requests: collections.Counter[str] = collections.Counter()  # env -> 400s
        self.undecided: collections.Counter[str] = collections.Counter()  # env -> answers scored 0 undecided
        self.measurements_failed: collections.Counter[str] = collections.Counter()  # env -> 422s, unreadable golds
        self.admissions: dict[str, Admission] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram("rollout_rm_latency_seconds", "seconds from a request's arrival to its answer, "
                                 "by environment", ["env"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.registry.register(_Counters(self))
        self._window = _Window()

    def answer(self, status: int, env: Union[str, None], seconds: float) -> None:
        """One answered request: counted by status, its latency recorded under its environment."""
        self.answered[status] += 1
        if env is not None:
            self.latency.labels(env=env).observe(seconds)
            if status == 400:
                self.bad_requests[env] += 1
        self._window.add(seconds)

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def log_line(self) -> Union[str, None]:
        """What was answered since the last line, and each pool's state; None when nothing was
        answered and nothing is in flight (an idle server logs nothing)."""
        window = self._window.take(self.answered, self.busy)
        in_flight = sum(a.in_flight for a in self.admissions.values())
        if window is None and not in_flight:
            return None
        pools = "; ".join(f"{env}: {a.in_flight} in flight, {a.service_s:.3g}s x {a.workers} workers"
                          for env, a in sorted(self.admissions.items()))
        return f"rm-server: {window or 'nothing answered'} (since the last line); {pools}"

    async def log_every(self, interval_s: float) -> None:
        """`log_line` every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            line = self.log_line()
            if line is not None:
                log.info("%s", line)


class _Window:
    """Answers since the last log line: counts by status, busy by reason, latency mean and max."""

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._answered: collections.Counter[int] = collections.Counter()
        self._busy: collections.Counter[str] = collections.Counter()

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    def take(self, answered: collections.Counter[int], busy: collections.Counter[tuple[str, str]]) -> Union[str, None]:
        if not self.count:
            return None
        by_reason: collections.Counter[str] = collections.Counter()
        for (_env, reason), n in busy.items():
            by_reason[reason] += n
        statuses = ", ".join(f"{status}: {n - self._answered[status]}" for status, n in sorted(answered.items())
                             if n > self._answered[status])
        refused = ", ".join(f"{reason} {n - self._busy[reason]}" for reason, n in sorted(by_reason.items())
                            if n > self._busy[reason])
        line = (f"{self.count} answered ({statuses}); busy 503: {refused or 'none'}; latency mean "
                f"{self.total_s / self.count:.3g}s, max {self.max_s:.3g}s")
        self._answered, self._busy = collections.Counter(answered), by_reason
        self.count, self.total_s, self.max_s = 0, 0.0, 0.0
        return line


class _Counters(Collector):
    """The counters and gauges, read from `ServerStats` at each scrape."""

    def __init__(self, stats: ServerStats):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield _family(CounterMetricFamily, "rollout_rm_answered", "requests answered, by HTTP status", ["status"],
                      {(str(k),): v for k, v in s.answered.items()})
        yield _family(CounterMetricFamily, "rollout_rm_busy", "requests answered 503 with Retry-After at once, by "
                      f"environment and reason ({BUSY_LATENCY}, {BUSY_PENDING})", ["env", "reason"], {key: n for key, n in s.busy.items()})
        yield _family(CounterMetricFamily, "rollout_rm_bad_requests", "requests answered 400 (the caller's body or "
                      "label), by environment", ["env"], _by_env(s.bad_requests))
        yield _family(CounterMetricFamily, "rollout_rm_undecided", "answers the verifier gave up on, scored 0 "
                      "(on_undecided: zero), by environment", ["env"], _by_env(s.undecided))
        yield _family(CounterMetricFamily, "rollout_rm_measurements_failed", "failed measurements (422) and golds "
                      "the verifier cannot read (400 task_error), by environment", ["env"],
                      _by_env(s.measurements_failed))
        pools = s.admissions.items()
        yield _family(GaugeMetricFamily, "rollout_rm_in_flight", "requests admitted and not answered, by "
                      "environment", ["env"], {(e,): a.in_flight for e, a in pools})
        yield _family(GaugeMetricFamily, "rollout_rm_service_seconds", "the service time admission assumes (the "
                      "average time a request holds a verifier worker; the prior before any)", ["env"],
                      {(e,): a.service_s for e, a in pools})
        yield _family(GaugeMetricFamily, "rollout_rm_verifier_workers", "verifications run at once, by environment",
                      ["env"], {(e,): a.workers for e, a in pools})
        yield _family(GaugeMetricFamily, "rollout_rm_latency_budget_seconds", "a request is admitted only if its "
                      "estimated answer time is within this", ["env"], {(e,): a.budget_s for e, a in pools})


def _by_env(counter: collections.Counter[str]) -> dict[tuple[str, ...], float]:
    return {(env,): n for env, n in counter.items()}


def _family(kind: type[Union[CounterMetricFamily, GaugeMetricFamily]], name: str, doc: str, labels: list[str],
            values: dict[tuple[str, ...], float]) -> Metric:
    family = kind(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), float(value))
    return family
