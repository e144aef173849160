"""`rollout bench --sections learn`: does a policy trained on what the pipeline hands slime learn,
per step as sync does, and sooner per second?

Every run: a fresh redis-server, the simulated engine serving the warm-started tiny LM
(workers/sim/tinylm.py; step times from the Qwen3-0.6B H100 aiconfigurator table at time scale
1), the producer and arq workers on the arithmetic task set (tests/learning.py, `rollout
prepare`, the math environment), and slime's own train.py with the CPU actor running slime's
advantage and loss code (tests/cpu_actor.py). Held-out accuracy is the pipeline's own eval
(pass@1 over the held-out problems, temperature 1) every `eval_interval` steps.

Contenders: sync (eta 0), this pipeline at eta 1, 2, 4, 8, eta 8 with TIS off, and the four
controls at sync: (a) advantages of the wrong sign, (b) the loss mask one token early, (c)
rollout log-probs of another sample, (d) rewards shuffled across groups. Seeds (engine
sampling, trainer init order, control shuffles) run seed-major, so a run cut short still has
whole seeds. Reported: accuracy per step and per second (mean over seeds), steps and seconds to
reach sync's final accuracy, per-step accuracy minus sync's with a bootstrap 95% interval over
seeds, and the engine clock's rate (simulated engine seconds per real second: the engine's clock
runs while it has work, so the rate is its busy share at time scale 1).

The seconds are this machine's, not an H100's: the CPU actor's steps and the tiny model's own
forward passes take real CPU time that no step table describes, and at these 10-token answers
they, not the engine's simulated steps, set the pace.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scripts.bench.report import Figure

REPO = Path(__file__).resolve().parents[2]
MODEL, GPU, TIME_SCALE = "Qwen/Qwen3-0.6B", "h100_sxm", 1.0


@dataclass(frozen=True)
class Contender:
    name: str
    eta: int = 0
    use_tis: bool = True
    use_rollout_logprobs: bool = False  # slime's --use-rollout-logprobs: rollout log-probs are the old policy
    controls: dict[str, bool] = field(default_factory=dict)


CONTENDERS = (
    Contender("sync"), Contender("eta 1", 1), Contender("eta 2", 2), Contender("eta 4", 4), Contender("eta 8", 8),
    Contender("eta 8, TIS off", 8, use_tis=False),
    Contender("(a) wrong-sign advantages", controls={"wrong_sign": True}),
    Contender("(b) loss mask one token off", controls={"mask_shift": True}),
    Contender("(c) foreign rollout log-probs", controls={"foreign_logprobs": True}),
    Contender("(d) rewards shuffled across groups", controls={"shuffled_rewards": True}),
    # (c) above reaches only the TIS weight (slime recomputes the old policy); with
    # --use-rollout-logprobs the rollout log-probs are the old policy of the PPO ratio
    Contender("sync, --use-rollout-logprobs", use_rollout_logprobs=True),
    Contender("(c) foreign rollout log-probs, --use-rollout-logprobs", use_rollout_logprobs=True,
              controls={"foreign_logprobs": True}),
)


@dataclass
class Curve:
    contender: str
    seed: int
    accuracy: dict[int, float]
    seconds: dict[int, float]  # real seconds since slime's loop started (this machine's)
    clock_rate: float  # engine-clock seconds per real second over the run
    wall_s: float
    error: str = ""


def _sim_time(url: str) -> float:
    with urllib.request.urlopen(f"{url}/sim/stats", timeout=10) as reply:
        return float(json.loads(reply.read()).get("sim_time_s", 0.0))


def run_one(contender: Contender, seed: int, *, steps: int, eval_interval: int, workdir: Path, setup: Any) -> Curve:
    import pytest
    from cpu_actor import Controls  # type: ignore[import-not-found]  # tests/, on sys.path after _setup
    from learning import LearnRun, run_learning  # type: ignore[import-not-found]

    from pipeline.local_redis import LocalRedis
    from scripts.processes import SimEngineProcess

    slime, warm, tasks, heldout = setup
    sub = workdir / (f"{contender.name.split()[0].strip('(),')}-{contender.eta}-{int(contender.use_tis)}"
                     f"{int(contender.use_rollout_logprobs)}-s{seed}")
    sub.mkdir(parents=True, exist_ok=True)
    engine_args = ["--policy-path", str(warm), "--model", MODEL, "--gpu", GPU, "--time-scale", str(TIME_SCALE),
                   "--seed", str(seed), "--weight-version", "0"]
    run = LearnRun(steps=steps, eval_interval=eval_interval, eta=contender.eta, use_tis=contender.use_tis,
                   use_rollout_logprobs=contender.use_rollout_logprobs, seed=seed, controls=Controls(**contender.controls))
    with LocalRedis() as server, SimEngineProcess(engine_args, log_path=str(sub / "engine.log")) as engine:
        monkeypatch = pytest.MonkeyPatch()
        clock0, real0 = _sim_time(engine.url), time.monotonic()
        try:
            result = asyncio.run(run_learning(run, slime=slime, monkeypatch=monkeypatch, workdir=sub,
                                              redis_url=server.url, ns="learn", engine_url=engine.url,
                                              engine_urls=[engine.url], warm=warm, tasks=tasks, heldout=heldout))
        finally:
            monkeypatch.undo()
        rate = (_sim_time(engine.url) - clock0) / max(time.monotonic() - real0, 1e-9)
    return Curve(contender.name, seed, result.accuracy, result.seconds, rate, result.wall_s)


def _setup(workdir: Path) -> Any:
    """slime on sys.path with pipeline.slime bound to its classes, the task set, the warm start."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO)]
    from tests.conformance_support import require_slime

    slime = require_slime("slime.ray.rollout", "slime.backends.megatron_utils.loss",
                          "slime.observability.rollout_data_utils", "slime.ray.placement_group")
    from learning import prepare_tasks, warm_checkpoint  # type: ignore[import-not-found]

    import pipeline.slime  # noqa: F401  (after slime: its samples are slime's)

    tasks, heldout = prepare_tasks(workdir / "tasks")
    return slime, warm_checkpoint(), tasks, heldout


def _mean_curve(curves: list[Curve], key: str) -> dict[int, float]:
    steps = sorted(set.intersection(*(set(getattr(c, key)) for c in curves))) if curves else []
    return {s: statistics.fmean(getattr(c, key)[s] for c in curves) for s in steps}


def _bootstrap(diffs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def summarize(curves: list[Curve]) -> dict[str, Any]:
    by: dict[str, list[Curve]] = {}
    for c in curves:
        if not c.error:
            by.setdefault(c.contender, []).append(c)
    sync = by.get("sync", [])
    sync_acc = _mean_curve(sync, "accuracy")
    target = sync_acc[max(sync_acc)] if sync_acc else float("nan")
    out: dict[str, Any] = {"sync_final_accuracy": target, "contenders": {}}
    for name, runs in by.items():
        acc, secs = _mean_curve(runs, "accuracy"), _mean_curve(runs, "seconds")
        reach = next((s for s in sorted(acc) if acc[s] >= target), None)
        per_step = {}
        for step in sorted(acc):
            pairs = [(c.accuracy[step], s.accuracy[step]) for c in runs for s in sync
                     if s.seed == c.seed and step in s.accuracy and step in c.accuracy]
            if pairs:
                diffs = [a - b for a, b in pairs]
                low, high = _bootstrap(diffs)
                per_step[step] = {"diff": statistics.fmean(diffs), "ci95": [low, high]}
        first, last = min(acc), max(acc)
        out["contenders"][name] = {
            "seeds": sorted(c.seed for c in runs), "accuracy": acc, "seconds": secs,
            "gain": acc[last] - acc[first], "gain_per_seed": [c.accuracy[last] - c.accuracy[first] for c in runs],
            "steps_to_sync_final": reach, "seconds_to_sync_final": secs.get(reach) if reach is not None else None,
            "vs_sync": per_step, "clock_rate": [round(c.clock_rate, 3) for c in runs],
            "wall_s": [round(c.wall_s, 1) for c in runs],
        }
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [f"sync's final held-out accuracy (mean of its seeds): {summary['sync_final_accuracy']:.3f}", "",
             "| contender | seeds | held-out accuracy by step (mean) | gain (per seed) | steps to sync's final | "
             "seconds to sync's final | final step minus sync (95% bootstrap over seeds) | engine clock rate |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in summary["contenders"].items():
        acc = ", ".join(f"{s}: {v:.3f}" for s, v in c["accuracy"].items())
        last = max(c["vs_sync"]) if c["vs_sync"] else None
        vs = (f"{c['vs_sync'][last]['diff']:+.3f} [{c['vs_sync'][last]['ci95'][0]:+.3f}, "
              f"{c['vs_sync'][last]['ci95'][1]:+.3f}]") if last is not None else "-"
        reach = c["steps_to_sync_final"]
        secs = c["seconds_to_sync_final"]
        lines.append(f"| {name} | {len(c['seeds'])} | {acc} | {c['gain']:+.3f} ({', '.join(f'{g:+.2f}' for g in c['gain_per_seed'])}) | "
                     f"{reach if reach is not None else 'not reached'} | {f'{secs:.0f}' if secs is not None else '-'} | "
                     f"{vs} | {', '.join(str(r) for r in c['clock_rate'])} |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(15, 4.8))
    colors = plt.get_cmap("tab20")  # an int picks one of its 20 colours: more contenders than the default cycle's ten colours
    for i, (name, c) in enumerate(summary["contenders"].items()):
        style = "--" if name.startswith("(") else "-"
        steps = list(c["accuracy"])
        color = colors((2 * i) % 20 + (2 * i) // 20)
        by_step.plot(steps, [c["accuracy"][s] for s in steps], style, marker="o", label=name, color=color)
        secs = [c["seconds"].get(s) for s in steps]
        by_time.plot(secs, [c["accuracy"][s] for s in steps], style, marker="o", label=name, color=color)
    by_step.set_xlabel("trainer steps")
    by_time.set_xlabel("seconds since the loop started (this 2-core machine; CPU actor and model inside)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out pass@1 (temperature 1)")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("tiny LM through the pipeline and slime's train.py (CPU actor, slime's loss): mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench_learn(*, quick: bool = False, seeds: int = 3, steps: int = 12, eval_interval: int = 4,
                deadline_s: float | None = None, out_dir: Path = Path("."), contenders: tuple[Contender, ...] = CONTENDERS,
                seed_ids: tuple[int, ...] | None = None, merge: Path | None = None) -> list[Figure]:
    """Run every contender for every seed (seed-major), write learn.json / learn.txt / learn.png
    in `out_dir`, return the figures. `deadline_s`: stop starting runs past it (said in the table).
    `seed_ids`: these seeds instead of 0..seeds-1. `merge`: an earlier learn.json whose curves
    (and skipped runs) are kept, except those this run redoes, so the table and plot cover both."""
    import tempfile

    if quick:
        seeds, steps = 1, 8
    workdir = Path(tempfile.mkdtemp(prefix="bench-learn-"))
    setup = _setup(workdir)
    from cpu_actor import quiet_transformers  # type: ignore[import-not-found]  # tests/ is on sys.path now

    quiet_transformers()
    started = time.monotonic()
    curves, skipped = _load(merge) if merge is not None else ([], [])
    for seed in seed_ids if seed_ids is not None else range(seeds):
        for contender in contenders:
            done = f"{contender.name} seed {seed}"
            curves = [c for c in curves if f"{c.contender} seed {c.seed}" != done]
            skipped = [s for s in skipped if s != done]
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                skipped.append(f"{contender.name} seed {seed}")
                continue
            try:
                curve = run_one(contender, seed, steps=steps, eval_interval=eval_interval, workdir=workdir, setup=setup)
            except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others go on
                curve = Curve(contender.name, seed, {}, {}, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")
            curves.append(curve)
            print(f"[learn] {contender.name} seed {seed}: {curve.accuracy or curve.error} "
                  f"({curve.wall_s:.0f} s, engine clock {curve.clock_rate:.2f}x)", flush=True)
            _write(curves, skipped, out_dir)
    summary = _write(curves, skipped, out_dir)
    print(table(summary))
    figures = []
    for name, c in summary["contenders"].items():
        goal_met = c["gain"] < 0.1 if name.startswith("(") else c["steps_to_sync_final"] is not None
        figures.append(Figure(section="learn", name=f"{name}: held-out gain over {steps} steps", value=c["gain"],
                              unit="accuracy", goal="no rise (a control)" if name.startswith("(") else
                              "reaches sync's final accuracy", met=goal_met, details=c))
    return figures


def _load(path: Path) -> tuple[list[Curve], list[str]]:
    """An earlier run's curves (JSON keys back to step numbers) and the runs it skipped."""
    data = json.loads(path.read_text())
    curves = [Curve(**{**c, "accuracy": {int(k): v for k, v in c["accuracy"].items()},
                       "seconds": {int(k): v for k, v in c["seconds"].items()}}) for c in data["curves"]]
    return curves, list(data["summary"].get("skipped", []))


def _chosen(only: list[str]) -> tuple[Contender, ...]:
    """`--only` values: exact contender names, or comma-separated 0-based numbers."""
    by_name = {c.name: c for c in CONTENDERS}
    chosen: list[Contender] = []
    for value in only:
        if value in by_name:
            chosen.append(by_name[value])
        elif all(part.strip().isdigit() for part in value.split(",")):
            chosen.extend(CONTENDERS[int(part)] for part in value.split(","))
        else:
            raise SystemExit(f"--only {value!r}: not a contender; one of {sorted(by_name)} or their numbers")
    return tuple(chosen) or CONTENDERS


def _write(curves: list[Curve], skipped: list[str], out_dir: Path) -> dict[str, Any]:
    summary = summarize(curves)
    summary["skipped"] = skipped
    summary["failed"] = [f"{c.contender} seed {c.seed}: {c.error}" for c in curves if c.error]
    (out_dir / "learn.json").write_text(json.dumps({"summary": summary, "curves": [asdict(c) for c in curves]},
                                                   indent=1, default=str))
    text = table(summary) if summary["contenders"] else "(no run finished)"
    if skipped:
        text += f"\n\nnot run (time budget): {', '.join(skipped)}"
    if summary["failed"]:
        text += "\n\nfailed: " + "; ".join(summary["failed"])
    (out_dir / "learn.txt").write_text(text + "\n")
    if summary["contenders"]:
        plot(summary, out_dir / "learn.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m scripts.bench.learn", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-interval", type=int, default=4)
    p.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--out", default=".", help="directory for learn.json, learn.txt, learn.png")
    p.add_argument("--only", action="append", default=[],
                   help="a contender's exact name, or comma-separated 0-based numbers; repeatable; default all")
    p.add_argument("--seed-ids", default="", help="comma-separated seeds to run instead of 0..seeds-1")
    p.add_argument("--merge", type=Path, default=None,
                   help="an earlier learn.json: keep its curves (those rerun here replaced) in the table and plot")
    a = p.parse_args(argv)
    seed_ids = tuple(int(s) for s in a.seed_ids.split(",")) if a.seed_ids.strip() else None
    bench_learn(seeds=a.seeds, steps=a.steps, eval_interval=a.eval_interval, deadline_s=a.deadline_s,
                out_dir=Path(a.out), contenders=_chosen(a.only), seed_ids=seed_ids, merge=a.merge)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
