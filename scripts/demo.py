"""`rollout demo`: the whole pipeline on this machine, with embedded defaults, in about a minute.

One process tree:
- a private redis-server on a free port (own session, so Ctrl-C drains clients first),
  or fakeredis's TCP server in a subprocess where no redis-server is installed;
- the SIMULATED SGLang engine (workers/sim/engine.py) with a long-tail response length
  and per-token latency, answering from the real local test tokenizer;
- a bundled task set (scripts/demo_tasks.jsonl): arithmetic checked by math-verify
  (`math`) and a calculator tool-use environment (`tools`);
- the producer (producers/enqueue.py) admitting jobs under the staleness bound;
- a worker pool (`rollout workers` in a child process: arq workers running episodes);
- a trainer loop calling the real `pipeline.slime.data_source.generate_rollout` and
  `RedisDataSource` (no slime needed): each step takes B whole groups, "trains" for a
  simulated step time, acknowledges them (`save`) and moves the engine's weight
  version, so the policy version advances and staleness is real.

The live view is the monitor's snapshot; the summary at the end is the trainer's own
figures beside the pipeline's counters. `--short` is the profile the tests run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.aio import wait_for
from pipeline.config import ENV_NAMESPACE, check_redis_url, parse_config
from pipeline.keys import Counter, Keys
from pipeline.ops.monitor import MonitorSnapshot, snapshot
from pipeline.store.fake_redis import FakeRedisServer
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import ENV_REDIS_URL, connect, redact

TASKS_FILE = Path(__file__).with_name("demo_tasks.jsonl")
DEFAULT_NAMESPACE = "demo"


@dataclass(frozen=True)
class Profile:
    steps: int = 20  # training steps
    batch: int = 8  # groups per step (B)
    n: int = 4  # samples per group
    eta: int = 2  # staleness bound
    worker_processes: int = 2
    concurrency: int = 12  # groups per worker process
    train_step_s: float = 1.5  # simulated optimizer step
    # the simulated engine plays this model on this GPU (measured step times, workers/sim/physics.py),
    # its clock `time_scale` x real time so that the demo takes about a minute on a laptop
    model: str = "Qwen/Qwen3-8B"
    gpu: str = "h100_sxm"
    time_scale: float = 6.0
    length_sigma: float = 1.0  # lognormal response length: the long tail
    accuracy: float = 0.6


PROFILES = {
    "default": Profile(),
    "short": Profile(steps=3, batch=4, n=2, eta=1, worker_processes=1, concurrency=8, train_step_s=0.2,
                     time_scale=8.0),
}


# ------------------------------------------------------------------ config


def pipeline_config(profile: Profile, redis_url: str, ns: str, engine_url: str, tokenizer: str) -> dict[str, Any]:
    """The pipeline YAML the worker pool and producer run with (written next to the run)."""
    return {
        "redis": {"url": redis_url, "namespace": ns},
        "engine": {"url": engine_url, "tokenizer": tokenizer, "request_timeout_s": 60.0},
        "rollout": {
            "n_samples_per_prompt": profile.n, "rollout_batch_size": profile.batch, "eta": profile.eta,
            "max_response_tokens": 1024, "max_turns": 4, "sampling": {"temperature": 1.0},
        },
        "workers": {
            "concurrency": profile.concurrency, "job_timeout_s": 120.0, "heartbeat_s": 1.0,
            "dead_after_s": 5.0, "drain_grace_s": 5.0, "poll_delay_s": 0.05,
        },
        "environments": {
            # inline: a sympy check of a short number is quick; no process pool per worker
            "math": {"kind": "workers.envs.math:MathEnvironment"},  # answers checked in a process pool (the default)
            "tools": {"kind": "calculator", "max_turns": 4},
        },
    }


def trainer_args(profile: Profile, redis_url: str, ns: str) -> SimpleNamespace:
    """What slime's `args` would carry (--custom-config-path keys and its own flags)."""
    return SimpleNamespace(
        pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=profile.batch,
        n_samples_per_prompt=profile.n, pipeline_eta=profile.eta, pipeline_stale_policy="requeue",
        pipeline_wait_timeout_s=120.0, pipeline_wait_log_s=10.0, pipeline_publish_engine=False,
        pipeline_trainer_loop="sync",  # the demo's trainer pushes weights after each step, before the next rollout
    )


# ----------------------------------------------------------------- trainer


@dataclass
class TrainerReport:
    steps_done: int = 0
    groups: int = 0
    samples: int = 0
    wait_s: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    staleness: list[int] = field(default_factory=list)
    rewards: dict[str, list[float]] = field(default_factory=dict)
    error: str = ""


class Trainer(threading.Thread):
    """The slime side, synchronous as in slime: a daemon thread, so a Ctrl-C never waits on it."""

    def __init__(self, profile: Profile, args: SimpleNamespace, engine_url: str):
        super().__init__(name="demo-trainer", daemon=True)
        self.profile = profile
        self.args = args
        self.engine_url = engine_url
        self.report = TrainerReport()
        self.stop_event = threading.Event()

    def run(self) -> None:
        from pipeline.slime.data_source import RedisDataSource

        try:
            source = RedisDataSource(self.args)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            self.report.error = f"{type(exc).__name__}: {exc}"
            return
        try:
            self._train(source)
        except Exception as exc:  # noqa: BLE001
            self.report.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.report.finished = time.monotonic()
            source.close()

    def _train(self, source: Any) -> None:
        from pipeline.slime.data_source import generate_rollout

        report = self.report
        report.started = time.monotonic()
        for rollout_id in range(self.profile.steps):
            if self.stop_event.is_set():
                return
            out = generate_rollout(self.args, rollout_id, source)  # publishes the engines' policy version
            stats = source.last_stats
            report.wait_s += stats.wait_s
            report.staleness += stats.staleness
            for group in out.samples:
                env = group[0].metadata["pipeline"]["env"]
                report.rewards.setdefault(env, []).extend(float(s.reward) for s in group)
            report.groups += len(out.samples)
            report.samples += sum(len(g) for g in out.samples)
            self.stop_event.wait(self.profile.train_step_s)  # the optimizer step
            source.save(rollout_id)  # checkpoint: the step's groups are acknowledged
            self._update_weights(rollout_id + 1)
            report.steps_done += 1

    def _update_weights(self, version: int) -> None:
        """As slime's update_weights: engines now serve policy `version` (integer weight versions)."""
        body = json.dumps({"new_version": str(version)}).encode()
        request = urllib.request.Request(f"{self.engine_url}/update_weight_version", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()


# ------------------------------------------------------------------ summary


@dataclass
class DemoSummary:
    profile: str
    steps: int
    groups_trained: int
    samples_trained: int
    duration_s: float
    groups_per_s: float
    trainer_wait_s: float
    trainer_wait_ratio: float
    staleness_max: int
    eta: int
    reward_mean: dict[str, float]
    episodes: int
    episodes_failed: int
    jobs_failed: int
    stale_rejected: int
    dead_letters: int
    counters: dict[str, int]
    interrupted: bool = False
    error: str = ""


def summarize(
    name: str, profile: Profile, report: TrainerReport, final: MonitorSnapshot, interrupted: bool
) -> DemoSummary:
    duration = max(1e-6, (report.finished or time.monotonic()) - report.started) if report.started else 0.0
    c = final.counters
    return DemoSummary(
        profile=name, steps=report.steps_done, groups_trained=report.groups, samples_trained=report.samples,
        duration_s=round(duration, 3), groups_per_s=round(report.groups / duration, 3) if duration else 0.0,
        trainer_wait_s=round(report.wait_s, 3),
        trainer_wait_ratio=round(report.wait_s / duration, 3) if duration else 0.0,
        staleness_max=max(report.staleness, default=0), eta=profile.eta,
        reward_mean={env: round(sum(r) / len(r), 4) for env, r in sorted(report.rewards.items())},
        episodes=c.get(Counter.EPISODES, 0), episodes_failed=c.get(Counter.EPISODES_FAILED, 0),
        jobs_failed=c.get(Counter.FAILED, 0), stale_rejected=c.get(Counter.STALE, 0),
        dead_letters=final.dead_letters, counters=c, interrupted=interrupted, error=report.error,
    )


def summary_table(s: DemoSummary) -> Table:
    t = Table(title=f"rollout demo ({s.profile}){' - interrupted' if s.interrupted else ''}", title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [
        ("training steps", f"{s.steps} x {s.groups_trained // max(1, s.steps)} groups"),
        ("groups trained", f"{s.groups_trained} ({s.samples_trained} samples)"),
        ("throughput", f"{s.groups_per_s:.2f} groups/s over {s.duration_s:.1f}s"),
        ("trainer wait ratio", f"{s.trainer_wait_ratio:.0%} ({s.trainer_wait_s:.1f}s waiting for groups)"),
        ("staleness max vs eta", f"{s.staleness_max} <= {s.eta}" if s.staleness_max <= s.eta
         else f"{s.staleness_max} > {s.eta}"),
        *((f"reward mean: {env}", f"{value:.3f}") for env, value in s.reward_mean.items()),
        ("episodes (failed)", f"{s.episodes} ({s.episodes_failed})"),
        ("jobs failed / stale groups requeued", f"{s.jobs_failed} / {s.stale_rejected}"),
        ("dead letters", str(s.dead_letters)),
    ]
    for row in rows:
        t.add_row(*row)
    if s.error:
        t.caption = f"[red]trainer error: {s.error}[/red]"
    return t


# -------------------------------------------------------------------- run


def _live_view(progress: Progress, snap: MonitorSnapshot | None) -> Group:
    if snap is None:
        return Group(progress)
    line = (
        f"version {snap.policy_version} · queue {snap.queue.ready} ready / {snap.queue.running} running · "
        f"buffer {snap.buffer_ready} ready / {snap.buffer_pending} pending · "
        f"workers {snap.workers_live} · headroom {snap.admission_headroom} · "
        f"{snap.throughput.groups_per_min:.0f} groups/min · dead {snap.dead_letters}"
    )
    return Group(progress, line)


def start_pool(config_path: Path, profile: Profile, log_path: Path, redis_url: str, ns: str) -> subprocess.Popen:
    """`rollout workers` in its own session: the demo decides when it drains. The Redis URL (maybe
    with a password) travels in the child's environment, never in a file or on its command line."""
    cmd = [sys.executable, "-m", "scripts.cli", "workers", "--config", str(config_path),
           "--processes", str(profile.worker_processes)]
    env = {**os.environ, ENV_REDIS_URL: redis_url, ENV_NAMESPACE: ns}
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_pool(pool: subprocess.Popen, grace_s: float) -> None:
    if pool.poll() is None:
        pool.send_signal(signal.SIGTERM)  # drain: finish or hand back running groups
        try:
            pool.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pool.pid, signal.SIGKILL)
            pool.wait()


async def run_demo(
    name: str, profile: Profile, redis_url: str, ns: str, workdir: Path, console: Console
) -> DemoSummary:
    from producers.enqueue import run_producer
    from workers.sim.engine import SimConfig, load_answers, serve_sim_engine
    from workers.sim.tokenizer import default_tokenizer_path

    tokenizer = default_tokenizer_path()
    sim = SimConfig(accuracy=profile.accuracy, model=profile.model, gpu=profile.gpu, time_scale=profile.time_scale,
                    length_sigma=profile.length_sigma, slots=64, answers=load_answers(str(TASKS_FILE)),
                    weight_version="0", tokenizer_path=tokenizer)
    async with serve_sim_engine(sim) as engine:
        data = pipeline_config(profile, redis_url, ns, engine.url, tokenizer)
        config_path = workdir / "pipeline.yaml"
        # The file carries no Redis URL (it may hold a password): the pool gets it in its environment.
        on_disk = {**data, "redis": {"url": "", "namespace": ns}}
        config_path.write_text(yaml.safe_dump(on_disk, sort_keys=False))
        config = parse_config(data, str(config_path))
        pool = start_pool(config_path, profile, workdir / "workers.log", redis_url, ns)
        stop = asyncio.Event()
        producer = asyncio.create_task(run_producer(config, TASKS_FILE, follow=True, stop_event=stop))
        trainer = Trainer(profile, trainer_args(profile, redis_url, ns), engine.url)
        redis = connect(redis_url)
        interrupted = True
        try:
            trainer.start()
            await _watch(trainer, pool, producer, redis, Keys(ns), profile, console)
            interrupted = False
        finally:
            trainer.stop_event.set()
            stop.set()
            await wait_for(asyncio.gather(producer, return_exceptions=True), timeout=10)
            await asyncio.to_thread(stop_pool, pool, config.workers.drain_grace_s + 10)
            final = await snapshot(redis, Keys(ns))
            await redis.aclose()
        return summarize(name, profile, trainer.report, final, interrupted)


async def _watch(trainer: Trainer, pool: subprocess.Popen, producer: asyncio.Task, redis: Any, keys: Keys,
                 profile: Profile, console: Console) -> None:
    progress = Progress(TextColumn("training steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    task = progress.add_task("steps", total=profile.steps)
    snap = None
    with Live(_live_view(progress, snap), console=console, refresh_per_second=4, transient=False) as live:
        while trainer.is_alive():
            if pool.poll() is not None:
                raise RuntimeError(f"the worker pool exited with {pool.returncode} (see its log)")
            if producer.done() and producer.exception() is not None:
                raise RuntimeError(f"the producer failed: {producer.exception()!r}")
            snap = await snapshot(redis, keys, window_s=10.0)
            progress.update(task, completed=trainer.report.steps_done)
            live.update(_live_view(progress, snap))
            await asyncio.sleep(0.5)
        progress.update(task, completed=trainer.report.steps_done)
        live.update(_live_view(progress, snap))
    console.print()


def _private_redis(choice: str, console: Console) -> contextlib.AbstractContextManager[LocalRedis | FakeRedisServer]:
    """A redis-server on a free port, or fakeredis in a subprocess on a machine without one."""
    if choice == "server" or (choice == "auto" and shutil.which("redis-server")):
        return LocalRedis(detached=True)
    if choice == "auto":
        console.print("[yellow]redis-server not on PATH: using fakeredis (in memory, slower); "
                      "apt-get install redis-server for the real thing[/yellow]")
    return FakeRedisServer(detached=True)


async def _ping(url: str) -> None:
    redis = connect(url, retries=1)
    try:
        await redis.ping()
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout demo", description="Run the whole pipeline on this machine.")
    p.add_argument("--short", action="store_true", help="a few seconds of work (the tests' profile)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the profile's)")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of a private one (default: $ROLLOUT_REDIS_URL when set; "
                        "a password is kept in memory and the environment, never written to disk)")
    p.add_argument("--private-redis", choices=["auto", "server", "fake"], default="auto",
                   help="the private Redis: a redis-server on a free port, fakeredis's TCP server in a "
                        "subprocess, or auto = redis-server when on PATH, else fakeredis (default)")
    p.add_argument("--namespace", default=None,
                   help=f"key prefix (default: {DEFAULT_NAMESPACE!r} on the private Redis, a fresh demo-<hex> on yours)")
    p.add_argument("--eta", type=int, default=None,
                   help="staleness bound (default: the profile's: 2, --short 1); compare --eta 0 (synchronous), 1 and 2 in "
                        "the summary's trainer wait ratio and staleness max")
    p.add_argument("--summary-json", default=None, help="also write the summary to this file")
    p.add_argument("--keep", action="store_true", help="keep the run directory (config, worker log)")
    args = p.parse_args(argv)
    name = "short" if args.short else "default"
    profile = PROFILES[name]
    if args.steps is not None:
        profile = Profile(**{**asdict(profile), "steps": args.steps})
    if args.eta is not None:
        if args.eta < 0:
            p.error("--eta must be >= 0")
        profile = Profile(**{**asdict(profile), "eta": args.eta})
    external_url = args.redis_url or os.environ.get(ENV_REDIS_URL) or None
    if external_url:
        try:
            check_redis_url(external_url, "--redis-url" if args.redis_url else f"${ENV_REDIS_URL}")
        except ValueError as exc:
            print(f"rollout demo: {exc}", file=sys.stderr)
            return 2
    # never the pipeline's own namespace of a shared Redis unless asked for by name
    namespace = args.namespace or (f"demo-{os.urandom(3).hex()}" if external_url else DEFAULT_NAMESPACE)
    if external_url is None and args.private_redis == "server" and shutil.which("redis-server") is None:
        print("rollout demo: redis-server not found on PATH (Debian/Ubuntu: apt-get install redis-server); "
              "use --private-redis fake or --redis-url", file=sys.stderr)
        return 2
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    try:
        with contextlib.ExitStack() as stack:
            redis_url = external_url or stack.enter_context(_private_redis(args.private_redis, console)).url
            if external_url:  # a wrong URL or password: one line (exit 3) before anything starts
                asyncio.run(_ping(redis_url))
            console.print(f"[bold]rollout demo[/bold] ({name}): {profile.steps} steps x {profile.batch} groups x "
                          f"{profile.n} samples, eta={profile.eta}, {profile.worker_processes} worker process(es); engine: "
                          f"{profile.model} on {profile.gpu}, simulated at {profile.time_scale:g}x real time\n"
                          f"redis {redact(redis_url)} namespace {namespace}; run directory {workdir}")
            summary = asyncio.run(run_demo(name, profile, redis_url, namespace, workdir, console))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: producer, workers, engine and redis were shut down[/yellow]")
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        return 130
    except BaseException:  # reported by the CLI's error boundary (a connection error: exit 3)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    console.print(summary_table(summary))
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(asdict(summary), indent=2))
    if summary.error:
        console.print(f"worker log and config kept in {workdir}")
        return 1
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
