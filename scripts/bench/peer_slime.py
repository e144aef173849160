"""The slime contenders of the peer benchmark, (a)-(c) and (e) (scripts/bench/peer_contenders.py
says which is which): slime's own data source and rollout function in train.py's loop, each in a
fork of a process that imported slime once."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from scripts import upstream
from scripts.bench.harness import CpuMeter, Fleet, as_fleet, engine_pids
from scripts.bench.peer_measure import SlotSampler, group_tokens, read_engine_counts, trainer_loop
from scripts.bench.peer_workload import CONTENDERS, Result, Workload


def slime_path() -> Path:
    """The pinned slime snapshot, found as the conformance tests find it (scripts/upstream.py)."""
    return upstream.snapshot_path("slime")


def slime_args(kind: str, wl: Workload, engine_url: str, prompts: Path, workdir: Path) -> SimpleNamespace:
    """The fields of slime's `args` that generate_rollout, generate_rollout_fully_async and
    RolloutDataSourceWithBuffer read (slime's argument parser needs sglang_router, which is not
    installed here; the values are slime's defaults unless the workload says otherwise)."""
    from workers.sim.tokenizer import default_tokenizer_path

    host, port = engine_url.removeprefix("http://").rsplit(":", 1)
    inprocess = kind == "e"  # (a)'s rollout with the pipeline's episode runner and environment inside
    if inprocess:
        config = {"engine": {"request_timeout_s": wl.request_timeout_s},
                  "rollout": {"n_samples_per_prompt": wl.n, "max_response_tokens": wl.max_response_len,
                              "max_turns": 1, "sampling": {"temperature": 1.0}},
                  "environments": {"math": {"kind": "math", "options": {"check_in": "inline"}}}}
        (workdir / "inprocess.yaml").write_text(json.dumps(config))  # JSON is YAML
    return SimpleNamespace(
        # router = the simulated engine
        sglang_router_ip=host, sglang_router_port=int(port), rollout_num_engines=wl.engines, sglang_dp_size=None,
        sglang_server_concurrency=wl.concurrency, use_distributed_post=False,
        # consistent hashing sends X-SMG-Routing-Key = sample.session_id, so a resumed partial
        # sample continues the engine's plan for it (the simulator seeds a plan per routing key)
        router_policy="consistent_hashing",
        # rollout
        rollout_global_dataset=True, rollout_batch_size=wl.batch, n_samples_per_prompt=wl.n,
        over_sampling_batch_size=2 * wl.batch if kind == "b" else wl.batch,
        partial_rollout=kind == "b", mask_offpolicy_in_partial_rollout=False,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=wl.max_response_len,
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        sglang_enable_deterministic_inference=False, rollout_seed=42, use_rollout_routing_replay=False,
        custom_generate_function_path="workers.inslime.generate" if inprocess else None,
        custom_config_path=str(workdir / "inprocess.yaml") if inprocess else None, rollout_sample_hook_path=None, ci_test=False,
        dynamic_sampling_filter_path=None, rollout_sample_filter_path=None, rollout_all_samples_process_path=None,
        sglang_speculative_algorithm=None,
        # reward: slime's rule-based math RM; (e) the environment's verification generate stored
        group_rm=False, rm_type="math", custom_rm_path="workers.inslime.reward" if inprocess else None, rm_url=None, reward_key=None,
        # data source
        hf_checkpoint=default_tokenizer_path(), prompt_data=str(prompts), input_key="prompt", label_key="label",
        metadata_key="metadata", tool_key=None, multimodal_keys=None,
        apply_chat_template=not inprocess,  # (e): the episode runner renders the chat template itself
        apply_chat_template_kwargs=None, rollout_max_prompt_len=None, rollout_shuffle=False, dump_details=None,
        buffer_filter_path=None, save=str(workdir / "ckpt"), load=None,
    )


def run_slime_contender(kind: str, wl: Workload, engine_url: str | Fleet, prompts: Path, workdir: Path,
                        engine_pid: int = 0) -> Result:
    """In this (child) process: slime's data source and rollout function, train.py's loop."""
    sys.path.insert(0, str(slime_path()))
    from slime.rollout import fully_async_rollout, sglang_rollout
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.utils import async_utils, http_utils


    fleet = as_fleet(engine_url)
    engine_url = fleet.engines[0]  # the trainer's clock and the slot samples: the first engine
    result = Result(kind, CONTENDERS[kind])
    args = slime_args(kind, wl, fleet.url, prompts, workdir)
    # a fresh process's singletons (a fork inherits the parent's: a client sized for another
    # concurrency, a loop whose thread did not survive the fork, a fully-async worker)
    http_utils._http_client = None
    async_utils.async_loop = None
    fully_async_rollout._global_worker = None
    http_utils.init_http_client(args)  # RolloutManager.__init__ does this (once per process)
    source = RolloutDataSourceWithBuffer(args)
    sglang_rollout.GenerateState.clear_instances()  # slime's own reset: a and b may share a process (the test)
    sglang_rollout.GenerateState(args)  # tokenizer load, outside the timed loop
    rollout = (fully_async_rollout.generate_rollout_fully_async if kind == "c" else sglang_rollout.generate_rollout)
    if kind == "c":
        start_fully_async_worker(fully_async_rollout, args, source, wl)

    held = slime_held(source)
    sampler = SlotSampler(engine_url, fleet.engines[1:])
    cpu = CpuMeter({"trainer + rollout (slime, one process)": os.getpid(), **engine_pids(fleet, engine_pid)})
    cpu.start()
    sampler.start()

    def generate(rollout_id: int) -> list[list[Any]]:
        out = rollout(args, rollout_id, source)  # (c) returns the list of groups itself
        return out.samples if hasattr(out, "samples") else out

    trainer_loop(wl, result, fleet, sampler, generate, lambda s: s.weight_versions, source.save, held)
    sampler.finish(result)
    result.cpu_s = cpu.stop()

    carried_groups: list[list[Any]] = []
    read_engine_counts(result, fleet)  # END_RULE: at once, before anything else finishes
    if kind == "c":
        worker = fully_async_rollout._global_worker
        worker.running = False  # no new group; the child exits without waiting on the rest
        carried_groups += [group for _, group in worker.get_completed_groups()]
        result.notes.append(f"{len(carried_groups)} completed groups left in the worker's queue (carried over)")
    carried_groups += list(source.buffer)  # (b): partial groups handed back; (c): aborted groups requeued
    result.carried_tokens = sum(int(s.response_length) for g in carried_groups for s in g)
    return result


FULLY_ASYNC_POLL_S = 1.0  # AsyncRolloutWorker.poll_interval, slime's own constant (wall seconds)


def start_fully_async_worker(fully_async_rollout: Any, args: SimpleNamespace, source: Any, wl: Workload) -> None:
    """slime's worker as `_get_global_worker` makes it, with its top-up poll on the played clock:
    slime's 1 s is a real second of the system played, so FULLY_ASYNC_POLL_S / time_scale here (at
    50x an unscaled poll would refill a finished group's slot after up to 50 simulated seconds)."""
    worker = fully_async_rollout.AsyncRolloutWorker(
        args, source, concurrency=args.sglang_server_concurrency * args.rollout_num_engines)
    worker.poll_interval = FULLY_ASYNC_POLL_S / wl.time_scale
    worker.start()
    fully_async_rollout._global_worker = worker


def slime_held(source: Any) -> Callable[[], int]:
    """slime's stock outside the engines: the fully-async worker's finished groups not yet taken
    (its output queue) and the groups handed back to the data source's buffer (aborted, requeued;
    partial rollout's partial groups)."""
    from slime.rollout import fully_async_rollout

    def held() -> int:
        worker = fully_async_rollout._global_worker
        queued: list[Any] = []
        if worker is not None:
            with worker.output_queue.mutex:  # a look, not a take: the worker keeps its queue
                queued = [group for _, group in worker.output_queue.queue]
        return group_tokens(queued) + group_tokens(list(source.buffer))

    return held


def import_slime() -> None:
    """slime's rollout modules, once per process (46 s on a loaded 2-core machine: torch and
    friends); every slime contender then runs in a fork of this process."""
    sys.path.insert(0, str(slime_path()))
    from slime.rollout import data_source, fully_async_rollout, sglang_rollout  # noqa: F401
    from slime.utils import http_utils  # noqa: F401


def slime_in_fork(kind: str, wl: Workload, engine_url: str | Fleet, engine_pid: int, prompts: Path, sub: Path,
                   timeout_s: float = 900.0) -> int:
    """One slime contender in a fork: slime keeps module-level singletons (GenerateState, the
    HTTP client sized by the first concurrency, the fully-async worker), so each contender gets
    a fresh process, without paying slime's import again. Returns the child's exit status."""
    import logging
    import signal
    import traceback

    import_slime()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: slime's logs and tqdm bars go to child.log
        code = 1
        try:
            fd = os.open(sub / "child.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
            # one INFO line per HTTP request costs slime's one process CPU the others do not pay
            # on a loaded 2-core machine (a line per generate call: tens of thousands a run)
            logging.getLogger("httpx").setLevel(logging.WARNING)
            result = run_slime_contender(kind, wl, engine_url, prompts, sub, engine_pid=engine_pid)
            (sub / "result.json").write_text(json.dumps(asdict(result)))
            code = 0
        except BaseException:  # noqa: BLE001 - the parent reads the traceback's tail from child.log
            traceback.print_exc()
        finally:
            os._exit(code)  # slime's background loop thread and atexit hook would wait on a drained worker
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.1)
