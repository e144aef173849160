"""slime's eval call with `pipeline_eval_datasets` set (`pipeline.slime.data_source.generate_rollout(...,
evaluation=True)`): one round through the workers, held until its last group is back
(`pipeline_eval_mode: blocking`, pipeline/eval/evaluation.py) or enqueued and reported later
(`background`, pipeline/eval/background.py). Its own module: the background round builds on
the blocking one, and the choice between them imports both (no cycle)."""

from __future__ import annotations

from typing import Any

from pipeline.config import EvalMode
from pipeline.eval.background import evaluate_in_background
from pipeline.eval.evaluation import eval_output, load_eval_datasets, run_round
from pipeline.staleness import TrainerLoop


def evaluate(args: Any, rollout_id: int, data_source: Any) -> Any:
    """The `evaluation=True` branch of `pipeline.slime.data_source.generate_rollout` with eval datasets set;
    `data_source` is its `RedisDataSource` (checked there: this module does not import it)."""
    datasets = getattr(data_source, "_eval_datasets", None)
    if datasets is None:  # loaded once per trainer process
        deterministic = bool(getattr(args, "sglang_enable_deterministic_inference", False))
        datasets = data_source._eval_datasets = load_eval_datasets(data_source.settings.eval_datasets,
                                                                   deterministic=deterministic)
    background = data_source.settings.eval_mode is EvalMode.BACKGROUND
    if data_source.first_rollout_id is None:
        data_source.publish(rollout_id)  # eval before the first rollout (train.py): workers wait for a version
    else:
        # slime calls eval(r) after step r and its push: the engines hold what the next generate
        # call publishes (r + 2 under train_async.py, r + 1 under train.py), and that call comes
        # next on the rollout manager either way. Published now, the round's labels are known:
        # after the run's last step no generate call would publish them and the workers' stamps
        # would stay at the version before the last push (blocking and background alike).
        data_source.publish(rollout_id + (2 if data_source.settings.trainer_loop is TrainerLoop.ASYNC else 1))
    if background:
        return eval_output({}, evaluate_in_background(args, rollout_id, data_source, datasets))
    data, metrics = data_source._run(run_round(data_source, rollout_id, datasets))
    return eval_output(data, metrics)
