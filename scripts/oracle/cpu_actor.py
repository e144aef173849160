"""The Megatron actor of slime's loop, on a CPU, training the tiny LM (workers/sim/tinylm.py).

`CPUActor` stands where scripts/oracle/slime_loop.py's `MegatronActor` stands: slime's own
train.py / train_async.py call `async_train(rollout_id, data)` with what slime's
`RolloutManager.generate` returns (`_convert_samples_to_train_data`: GRPO-normalised rewards by
`_post_process_rewards`, loss masks with `remove_sample` zeroed, rollout log-probs), and
`update_weights()` after the step. What runs is slime's code wherever slime has it:

- megatron-core's parallel state, initialised for one CPU process (gloo, TP = PP = CP = DP = 1),
  so slime's loss module runs as on one GPU;
- `slime.backends.megatron_utils.loss.compute_advantages_and_returns` (GRPO returns from
  `ppo_utils.get_grpo_returns`, the approx KL of `ppo_utils.compute_approx_kl`) and
  `loss_function` -> `policy_loss_function` (`get_log_probs_and_entropy` on the packed logits,
  `compute_policy_loss`, slime's `vanilla_tis_function` with `--use-tis`, the KL loss,
  `get_sum_of_sample_mean` over `rollout_mask_sums`);
- the old-policy and reference log-probs are the actor's own forward passes, as slime's
  `compute_log_prob` computes them (the packed layout slime's THD batches have).

The one piece written here is what Megatron's model and optimizer do: a forward of the HF model
on each sample, the logits packed as slime packs them, backward, AdamW. The push is what slime's
updater does to each engine: pause generation, `/update_weights_from_disk` with the checkpoint
and the weight version (the per-process push count), continue.

`Controls` breaks the signal on purpose inside the actor and slime's loop, downstream of the
pipeline (the learning test's and the bench's negative controls: does a signal this broken stop
learning?): advantages of the wrong sign, each trained position scored against the token before
it, rollout log-probs of another sample, rewards shuffled across groups. They plant nothing in the
pipeline's own code; the bugs planted there, each where it would really sit, are
tests/support/signal_bugs.py's (docs/signal-bugs.md).

Each step also keeps the actor's recomputed old log-probs of every sample (`CPUTrainer.recomputed`,
by rollout id), which the signal checks (pipeline/learning/signal_check.py) hold the rollout log-probs and
masks against, and reports slime's means (`reduce_train_step_metrics`), as `train_one_step` logs
them: e.g. `train_rollout_logprob_abs_diff`, the mean over samples, not their sum.
"""

from __future__ import annotations

import os
import random
import time
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.slime.weight_push import pause_body, post_json
from scripts.oracle.slime_loop import Cluster, MegatronActor


@dataclass(frozen=True)
class Controls:
    wrong_sign: bool = False  # (a) advantages negated after slime computed them
    # (b) inside the actor, each trained position is scored against the token before it (the
    # targets one token back); the pipeline's mask is untouched (its own mask bugs: signal_bugs.py)
    actor_targets_shifted: bool = False
    foreign_logprobs: bool = False  # (c) rollout log-probs of another sample of the batch
    shuffled_rewards: bool = False  # (d) rewards shuffled across the batch before slime normalises them per group


def slime_loss_args(*, use_tis: bool = True, kl_loss_coef: float = 0.0,
                    use_rollout_logprobs: bool = False) -> dict[str, Any]:
    """slime's arguments that its loss path reads, at slime's defaults (slime/utils/arguments.py)
    except where a GRPO run sets them (`--advantage-estimator grpo`, `--use-tis`, `--use-kl-loss`,
    `--use-rollout-logprobs`: the rollout log-probs are the old policy instead of a recompute)."""
    return dict(
        advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True, reward_key=None,
        use_rollout_logprobs=use_rollout_logprobs, kl_coef=0.0, kl_loss_type="low_var_kl", use_kl_loss=True,
        kl_loss_coef=kl_loss_coef, use_unbiased_kl=False, custom_advantage_function_path=None, use_opd=False,
        normalize_advantages=False, rollout_temperature=1.0, log_probs_chunk_size=-1, entropy_coef=0.0,
        allgather_cp=False, use_opsm=False, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None,
        get_mismatch_metrics=False, use_tis=use_tis, tis_clip=2.0, tis_clip_low=0.0, custom_tis_function_path=None,
        calculate_per_token_loss=False, loss_type="policy_loss", recompute_loss_function=False,
        custom_pg_loss_reducer_function_path=None, rollout_top_p=1.0, clip_grad=1.0,
        custom_reward_post_process_path=None, custom_convert_samples_to_train_data_path=None,
    )


@dataclass
class TrainerClock:
    """The trainer's step on a simulated GPU's clock: `tokens_per_s` tokens (prompt + response,
    every sample of the step) a simulated second, played `time_scale` times faster than that
    GPU (the engine's `--time-scale`), so the CPU actor's step lasts tokens / tokens_per_s /
    time_scale real seconds. The CPU's own work has to fit inside: when it does not, the step
    lasts what the CPU took and the run's seconds are no longer the simulated GPU's (`overruns`
    says how often). tokens_per_s = 0: no clock (the step lasts what the CPU takes)."""

    tokens_per_s: float = 0.0
    time_scale: float = 1.0
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (tokens, budget s, CPU s), real seconds

    def budget_s(self, tokens: int) -> float:
        return tokens / self.tokens_per_s / self.time_scale if self.tokens_per_s > 0 else 0.0

    def fill(self, tokens: int, started: float) -> None:
        """Sleep out the rest of the step's budget (the step began at monotonic `started`)."""
        used = time.monotonic() - started
        budget = self.budget_s(tokens)
        self.steps.append((tokens, budget, used))
        if budget > used:
            time.sleep(budget - used)

    @property
    def overruns(self) -> int:
        return sum(1 for _, budget, used in self.steps if budget and used > budget)

    @property
    def cpu_share(self) -> float:
        """The largest share of a step's budget the CPU's own work took (above 1: an overrun)."""
        return max((used / budget for _, budget, used in self.steps if budget), default=0.0)


_PARALLEL_READY = False


def ensure_cpu_parallel_state() -> None:
    """megatron-core's parallel state for one CPU process: a gloo group of one, TP = PP = CP = 1.
    slime's loss reads its groups and ranks from it. torch.compile (slime decorates the KL and
    loss kernels with it) is turned off: on a CPU it compiles C++ for ~20 s, for kernels that
    run eagerly in milliseconds; the arithmetic is the same."""
    global _PARALLEL_READY
    if _PARALLEL_READY:
        return
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch._dynamo.config.disable = True
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    _PARALLEL_READY = True


class CPUTrainer:
    """The tiny LM, its optimizer and a frozen reference copy; one GRPO step per rollout."""

    def __init__(self, checkpoint: str | Path, args: Namespace, *, lr: float, seed: int, controls: Controls,
                 clock: TrainerClock | None = None):
        import torch

        from workers.sim.tinylm import load_model

        ensure_cpu_parallel_state()
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.args, self.controls = args, controls
        self.model = load_model(checkpoint)
        self.ref = load_model(checkpoint)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        self.rng = random.Random(seed)
        self.metrics: list[dict[str, float]] = []  # slime's per-step means, one dict a step
        self.recomputed: dict[int, list[list[float]]] = {}  # rollout id -> per sample: the recomputed old log-probs
        # rollout id -> the policy version that recomputed them: the steps taken before it (the
        # k-th push is version k, so a token's lag is this minus its own version: pipeline/learning/drift.py)
        self.version_at: dict[int, int] = {}
        self.clock = clock or TrainerClock()

    def _packed_logits(self, model: Any, tokens: list[Any]) -> Any:
        """Each sample's logits over its own tokens, concatenated as slime's packed THD batch
        ([1, sum of lengths, vocab]; CP = 1, no padding between samples)."""
        import torch

        width = max(len(t) for t in tokens)
        ids = torch.zeros((len(tokens), width), dtype=torch.long)
        mask = torch.zeros((len(tokens), width), dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = t
            mask[i, : len(t)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        return torch.cat([logits[i, : len(t)] for i, t in enumerate(tokens)], dim=0).unsqueeze(0)

    def train(self, data: dict[str, Any], rollout_id: int = -1) -> dict[str, float]:
        import torch
        from slime.backends.megatron_utils import loss as slime_loss

        args, controls = self.args, self.controls
        tokens = [torch.as_tensor(t, dtype=torch.long) for t in data["tokens"]]
        response_lengths = [int(n) for n in data["response_lengths"]]
        total_lengths = [len(t) for t in tokens]
        loss_masks = [torch.as_tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
        rollout_lps = [torch.as_tensor(lp, dtype=torch.float32) for lp in data["rollout_log_probs"]]
        if controls.foreign_logprobs:
            rollout_lps = self._foreign(rollout_lps)
        score_tokens = tokens
        if controls.actor_targets_shifted:  # each position's target is the token before it
            score_tokens = [torch.cat([t[:1], t[:-1]]) for t in tokens]
        batch: dict[str, Any] = {
            "rewards": list(data["rewards"]), "response_lengths": response_lengths, "total_lengths": total_lengths,
            "loss_masks": loss_masks, "rollout_log_probs": rollout_lps, "unconcat_tokens": score_tokens,
            "rollout_mask_sums": [torch.tensor(float(s)) for s in data["rollout_mask_sums"]],
        }
        # slime's compute_log_prob for the actor ("log_probs") and the reference; under
        # --use-rollout-logprobs slime's actor skips the actor's (actor.py) and the loss takes the
        # rollout log-probs as the old policy. The recompute runs either way here: the signal
        # checks hold the rollout log-probs against it
        with torch.no_grad():
            old, batch["ref_log_probs"] = (
                self._log_probs(model, tokens, score_tokens, total_lengths, response_lengths)
                for model in (self.model, self.ref))
        if not args.use_rollout_logprobs:
            batch["log_probs"] = old
        self.recomputed[rollout_id] = [lp.tolist() for lp in old]
        self.version_at[rollout_id] = len(self.metrics)
        slime_loss.compute_advantages_and_returns(args, batch)
        if controls.wrong_sign:
            batch["advantages"] = [-a for a in batch["advantages"]]
        self.model.train()
        logits = self._packed_logits(self.model, tokens)
        loss, _, log = slime_loss.loss_function(args, batch, 1, len(tokens), logits)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad)
        self.optimizer.step()
        self.model.eval()
        metrics = self._slime_means(log, len(tokens))
        self.metrics.append(metrics)
        return metrics

    def _log_probs(self, model: Any, tokens: list[Any], score_tokens: list[Any], total_lengths: list[int],
                   response_lengths: list[int]) -> list[Any]:
        """slime's compute_log_prob on the packed logits: one tensor per sample, its response."""
        from slime.backends.megatron_utils import loss as slime_loss

        logits = self._packed_logits(model, tokens)
        _, out = slime_loss.get_log_probs_and_entropy(
            logits, args=self.args, unconcat_tokens=score_tokens, total_lengths=total_lengths,
            response_lengths=response_lengths)
        return list(out["log_probs"])

    def _slime_means(self, log: dict[str, Any], samples: int) -> dict[str, float]:
        """The step's metrics as slime's `train_one_step` reports them (one micro-batch here):
        `reduce_train_step_metrics` over the loss's log, the per-rollout sums divided by the
        step's rollout count (or the token count under --calculate-per-token-loss)."""
        from megatron.core import parallel_state
        from slime.observability.train_metric_utils import reduce_train_step_metrics

        return reduce_train_step_metrics(
            [log], calculate_per_token_loss=self.args.calculate_per_token_loss, step_global_batch_size=samples,
            cp_size=1, dp_with_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))

    def _foreign(self, rollout_lps: list[Any]) -> list[Any]:
        """(c): each sample gets another sample's rollout log-probs, cut or padded (with its
        mean) to its own length."""
        import torch

        order = list(range(len(rollout_lps)))
        self.rng.shuffle(order)
        out = []
        for mine, theirs in zip(rollout_lps, (rollout_lps[j] for j in order)):
            fill = float(theirs.mean()) if len(theirs) else -1.0
            pad = torch.full((max(0, len(mine) - len(theirs)),), fill)
            out.append(torch.cat([theirs, pad])[: len(mine)])
        return out

    def save(self, path: Path) -> str:
        from workers.sim.tinylm import save_checkpoint

        return save_checkpoint(self.model, path)


class CPUActor(MegatronActor):
    """slime's train group with a real model: trains on each rollout, pushes the weights."""

    def __init__(self, cluster: Cluster, run: int, start: int, crash_at: int | None, trainer: CPUTrainer,
                 checkpoints: Path):
        super().__init__(cluster, run, start, crash_at)
        self.trainer, self.checkpoints = trainer, checkpoints

    def async_train(self, rollout_id: int, data: Any, external_data: Any = None) -> None:
        started = time.monotonic()
        super().async_train(rollout_id, data, external_data)
        self.trainer.train(data, rollout_id)
        self.trainer.clock.fill(sum(len(t) for t in data["tokens"]), started)

    def update_weights(self) -> None:
        """slime's updater: pause, load the new weights with the version label, continue."""
        self.pushes += 1
        label = str(self.pushes)
        self.cluster.truth[(self.run, label)] = self.start + self.steps
        path = self.trainer.save(self.checkpoints / f"run{self.run}-push{label}")
        for url in self.cluster.engine_urls:
            post_json(url, "/pause_generation", pause_body(self.cluster.push_mode))
            # under an in_place pause the paused requests hold KV: SGLang refuses the default cache
            # flush (HTTP 400, workers/sim/sglang_front.py), so that push keeps the cache, as slime's
            # updaters do (flush_cache=False on every update call)
            post_json(url, "/update_weights_from_disk", {"model_path": path, "weight_version": label,
                                                         "flush_cache": self.cluster.push_mode != "in_place"})
            post_json(url, "/continue_generation", {})


def quiet_transformers() -> None:
    """No progress bars for every checkpoint load (the tiny model loads one per push)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
