"""The simulated scheduler's rules checked against SGLang 0.5.23's own code, run on CPU: the same
request sequences go through SGLang's functions and through workers/sim/scheduler.py, and their
decisions must be the same.

- queue order: `SchedulePolicy._sort_by_priority_and_fcfs` (managers/schedule_policy.py);
- decode retraction order: `ScheduleBatch._get_decode_retraction_order` (managers/schedule_batch.py,
  --retraction-policy length);
- priority preemption: `PrefillAdder.preempt_to_schedule` (managers/schedule_policy.py): which
  running requests it releases, and whether the waiting one may then be scheduled;
- admission and chunking: `PrefillAdder.add_one_req` with SGLang's `PrefillBudget`
  (mem_cache/prefill_budget.py) in `Scheduler._get_new_batch_prefill_raw`'s loop: which waiting
  requests one prefill pass admits, and how many tokens each prefills.

SGLang's side runs in a subprocess (`python tests/test_sim_sglang_rules.py probe`): it publishes
process-wide server args, which must stay out of the test process (tests/engine_stack.py says why).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workers.sim.physics import FlatSteps
from workers.sim.scheduler import BatchScheduler, SchedulerConfig, SimReq

pytestmark = pytest.mark.conformance
REPO = Path(__file__).resolve().parent.parent


def _cases(seed: int = 31) -> dict[str, list[Any]]:
    rng = random.Random(seed)
    choices = [None, -3, 0, 1, 5, 7, 10, 11, 12, 25, 50, 100]
    sort = [{"priorities": [rng.choice(choices) for _ in range(rng.randint(1, 9))], "low_first": low}
            for low in (False, True) for _ in range(40)]
    retract = [[[rng.randint(0, 6), rng.randint(1, 6)] for _ in range(rng.randint(1, 8))] for _ in range(60)]
    preempt = []
    for low in (False, True):
        for _ in range(60):
            running = []
            for _ in range(rng.randint(1, 6)):
                max_new = rng.randint(1, 60)
                running.append({"priority": rng.choice(choices[1:]), "max_new": max_new, "out": rng.randint(0, max_new)})
            preempt.append({"running": running, "low_first": low, "threshold": rng.choice([0, 5, 10]),
                            "new": {"priority": rng.choice(choices[1:]), "input": rng.randint(1, 40),
                                    "max_new": rng.randint(1, 60)},
                            "rem_total": rng.randint(-50, 80), "ratio": rng.choice([0.7, 0.3, 1.0])})
    admit = []
    for _ in range(150):
        running = []
        for _ in range(rng.randint(0, 4)):
            max_new = rng.randint(1, 500)
            running.append({"max_new": max_new, "out": rng.randint(0, max_new)})
        admit.append({"free": rng.randint(50, 3000), "running": running, "chunk": rng.choice([-1, 64, 256, 1024]),
                      "max_prefill": rng.choice([128, 1024, 16384]), "max_running": rng.randint(2, 8),
                      "ratio": rng.choice([0.7, 0.3, 0.098]),
                      "waiting": [{"input": rng.randint(1, 700), "max_new": rng.randint(1, 600)}
                                  for _ in range(rng.randint(1, 6))]})
    for free in (100, 101, 102):  # the budget's edge: 50 input + 50 output + 1 page against `free`
        admit.append({"free": free, "running": [], "chunk": -1, "max_prefill": 16384, "max_running": 4, "ratio": 0.7,
                      "waiting": [{"input": 50, "max_new": 50}]})
    return {"sort": sort, "retract": retract, "preempt": preempt, "admit": admit, "spans": _span_cases(rng)}


def _span_cases(rng: random.Random) -> list[Any]:
    """Weight updates a request lived through: (old label, its output tokens then) each, with
    output (the sim records none without: SGLang's `record_weight_version_events`), the label at
    its end, and its output tokens (more than at the last update, or as many: an abort)."""
    cases = []
    for _ in range(80):
        events, produced = [], 0
        for _ in range(rng.randint(0, 4)):
            produced += rng.randint(0, 5)
            if produced:
                events.append([rng.choice("abc"), produced])
        cases.append({"events": events, "current": rng.choice("abc"), "produced": produced + rng.randint(0, 5)})
    return cases


@pytest.fixture(scope="module")
def sglang_answers(tmp_path_factory) -> dict[str, list[Any]]:
    import importlib.util

    from conformance_support import unavailable

    if importlib.util.find_spec("sglang") is None:
        unavailable("sglang is not installed (see .ci/run)")
    workdir = tmp_path_factory.mktemp("sglang-rules")
    result = subprocess.run([sys.executable, str(Path(__file__)), "probe", str(workdir)],
                            input=json.dumps(_cases()), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _scheduler(**limits: Any) -> BatchScheduler:
    return BatchScheduler(SchedulerConfig(kv_pool_tokens=10**9, max_running_requests=64, **limits),
                          FlatSteps(0.01), asyncio.Event())


def test_weight_version_spans_are_sglangs(sglang_answers):
    """The simulator's spans (workers/sim/engine.py `_spans`, its own: it runs without sglang)
    are SGLang's `compute_weight_version_spans` of the same events (issue 39 item 5)."""
    from workers.sim.engine import SimEngine

    for case, theirs in zip(_cases()["spans"], sglang_answers["spans"]):
        running = SimpleNamespace(version_events=[tuple(event) for event in case["events"]])
        spans = SimEngine._spans(SimpleNamespace(weight_version=case["current"]), running, case["produced"])  # type: ignore[arg-type]
        assert [[s["version"], s["start"], s["end"]] for s in spans] == theirs, case


def test_queue_order_is_sglangs(sglang_answers):
    for case, theirs in zip(_cases()["sort"], sglang_answers["sort"]):
        sch = _scheduler(priority_scheduling=True, low_priority_values_first=case["low_first"])
        reqs = [SimReq(str(i), [1], [1], 1, p) for i, p in enumerate(case["priorities"])]
        for r in reqs:
            sch.add(r)
        assert [int(r.rid) for r in sch._queue_order()] == theirs, case


def test_retraction_order_is_sglangs(sglang_answers):
    """Ours retracts from the end of the same order: fewest outputs, then longest input."""
    for case, theirs in zip(_cases()["retract"], sglang_answers["retract"]):
        reqs = [SimReq(str(i), [0] * n_in, [0] * (n_out + 1), n_out + 1) for i, (n_out, n_in) in enumerate(case)]
        for r, (n_out, _n_in) in zip(reqs, case):
            r.produced = n_out
        ours = sorted(reqs, key=lambda r: (r.produced, -len(r.input_ids)), reverse=True)
        # equal keys: SGLang's sort is stable over the batch order, so is ours
        assert [int(r.rid) for r in ours] == theirs, case


class _FixedBudget:
    def __init__(self, remaining_total: float):
        self.remaining_total = remaining_total
        self.total_offset = 0.0


def test_priority_preemption_releases_what_sglang_releases(sglang_answers):
    outcomes = sglang_answers["preempt"]
    assert {ok for ok, _ in outcomes} == {True, False} and any(len(released) > 1 for _, released in outcomes)
    for case, theirs in zip(_cases()["preempt"], sglang_answers["preempt"]):
        sch = _scheduler(priority_scheduling=True, low_priority_values_first=case["low_first"],
                         preemption_threshold=case["threshold"])
        sch.new_token_ratio = case["ratio"]
        for i, r in enumerate(case["running"]):
            req = SimReq(f"r{i}", [1], [1] * (r["out"] + 1), r["max_new"], r["priority"])
            req.produced, req.entry = r["out"], i
            sch.running.append(req)
        new = case["new"]
        waiting = SimReq("new", [2] * new["input"], [2], new["max_new"], new["priority"])
        ok = sch._preempt_for(waiting, _FixedBudget(case["rem_total"]))  # type: ignore[arg-type]
        released = sorted(int(r.rid[1:]) for r in sch.waiting)
        assert [ok, released] == theirs, case


def test_admission_and_chunking_are_sglangs(sglang_answers):
    """One prefill pass over a waiting queue (Scheduler._get_new_batch_prefill_raw's loop around
    PrefillAdder.add_one_req, with SGLang's real PrefillBudget): which requests are admitted, and
    how many tokens each prefills (a chunk where --chunked-prefill-size cuts it), from the pool's
    free tokens, the running requests' growth at new_token_ratio, --max-prefill-tokens and
    --max-running-requests."""
    outcomes = sglang_answers["admit"]
    assert any(len(a) > 1 for a in outcomes) and any(not a for a in outcomes)
    assert any(take < case["waiting"][int(rid[1:])]["input"]  # some are chunked
               for case, a in zip(_cases()["admit"], outcomes) for rid, take in a)
    for case, theirs in zip(_cases()["admit"], outcomes):
        sch = BatchScheduler(SchedulerConfig(kv_pool_tokens=case["free"], max_running_requests=case["max_running"],
                                             chunked_prefill_size=case["chunk"], max_prefill_tokens=case["max_prefill"]),
                             FlatSteps(0.01), asyncio.Event())
        sch.new_token_ratio = case["ratio"]
        for i, r in enumerate(case["running"]):
            req = SimReq(f"r{i}", [1], [1] * r["max_new"], r["max_new"])
            req.produced = r["out"]
            sch.running.append(req)
        for i, w in enumerate(case["waiting"]):
            sch.add(SimReq(f"w{i}", [10_000 * (i + 1) + t for t in range(w["input"])], [1], w["max_new"]))
        ours = [[r.rid, take] for r, take in sch._admit()]
        assert ours == theirs, case


# ------------------------------------------------------------------ SGLang's side (subprocess)


def _probe(workdir: Path) -> None:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from conformance_support import _import_with_stubs
    from engine_stack import _model_dir

    cases = json.loads(sys.stdin.read())
    policy = _import_with_stubs("sglang.srt.managers.schedule_policy", ("torchvision",))
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    model = str(_model_dir(workdir, 32768))

    def configure(low_first: bool, threshold: int = 10) -> None:
        publish(ServerArgs(model_path=model, device="cpu", enable_priority_scheduling=True,
                           schedule_low_priority_values_first=low_first,
                           priority_scheduling_preemption_threshold=threshold), role="scheduler")

    sort = []
    for case in cases["sort"]:
        low = case["low_first"]
        default = sys.maxsize if low else -sys.maxsize - 1  # tokenizer_manager.py _set_default_priority
        queue = [SimpleNamespace(i=i, priority=default if p is None else p,
                                 time_stats=SimpleNamespace(wait_queue_entry_time=float(i)))
                 for i, p in enumerate(case["priorities"])]
        policy.SchedulePolicy._sort_by_priority_and_fcfs(queue, 1 if low else -1)
        sort.append([q.i for q in queue])
    configure(False)
    retract = []
    for case in cases["retract"]:
        reqs = [SimpleNamespace(output_ids=[0] * n_out, origin_input_ids=[0] * n_in, priority=None)
                for n_out, n_in in case]
        retract.append(ScheduleBatch._get_decode_retraction_order(reqs))
    preempt = []
    for case in cases["preempt"]:
        configure(case["low_first"], case["threshold"])
        preempt.append(_sglang_preempt(policy.PrefillAdder, case))
    configure(False)
    admit = [_sglang_admit(policy, case) for case in cases["admit"]]
    from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans

    spans = [[[s.version, s.start, s.end] for s in compute_weight_version_spans(
        [WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in case["events"]],
        current_version=case["current"], num_output_tokens=case["produced"])] for case in cases["spans"]]
    print(json.dumps({"sort": sort, "retract": retract, "preempt": preempt, "admit": admit, "spans": spans}))


class _Tree:
    """A radix cache with nothing cached, as PrefillAdder calls it."""

    buffer_pipeline = None
    disable = False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def lock(self, node: Any) -> None:
        return None

    def unlock(self, lock: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def finish_storage_prefetch_admission(self, *args: Any, **kwargs: Any) -> None:
        return None

    def load_back_is_cache_owned(self) -> bool:
        return False


class _Allocator:
    """A token pool with `free` tokens and SGLang's own PrefillBudget."""

    page_size = 1

    def __init__(self, free: int):
        self.free = free

    def available_size(self) -> int:
        return self.free

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        from sglang.srt.mem_cache.prefill_budget import PrefillBudget

        return PrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def request_slot_reserve(self, **_kw: Any) -> int:
        return 0


def _sglang_req(rid: str, n_in: int, max_new: int, out: int = 0) -> _Req:
    return _Req(rid=rid, sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=False),
                output_ids=[0] * out, full_untruncated_fill_ids=[0] * n_in, prefix_len=0, host_hit_length=0,
                swa_host_hit_length=0, last_node=None, needs_host_load_back=lambda: False, retracted_stain=False,
                kv=SimpleNamespace(holds_mamba=False, req_pool_idx=None), mamba_host_hit_length=0,
                auxiliary_swa_host_hit_length=0, extend_end=0, storage_hit_length=0, cache_request_handle=None,
                fulfilled_storage_hit_len=lambda _p: 0, finished=lambda: False)


def _sglang_admit(policy: Any, case: dict[str, Any]) -> list[list[Any]]:
    """Scheduler._get_new_batch_prefill_raw's admission loop, one pass, no cached prefixes."""
    running = [_sglang_req(f"r{i}", 1, r["max_new"], r["out"]) for i, r in enumerate(case["running"])]
    chunk = case["chunk"] if case["chunk"] > 0 else None
    adder = policy.PrefillAdder(1, _Tree(), _Allocator(case["free"]),
                                SimpleNamespace(reqs=running, batch_size=lambda: len(running)),
                                case["ratio"], case["max_prefill"], chunk)
    allocatable = case["max_running"] - len(running)  # get_num_allocatable_reqs
    for i, w in enumerate(case["waiting"]):
        if adder.budget_state() == policy.AddReqResult.OTHER or len(adder.can_run_list) >= allocatable:
            break
        if adder.add_one_req(_sglang_req(f"w{i}", w["input"], w["max_new"]), has_chunked_req=False,
                             truncation_align_size=None) != policy.AddReqResult.CONTINUE:
            break
    return [[r.rid, r.extend_end - r.prefix_len] for r in adder.can_run_list]


def _sglang_preempt(adder_class: Any, case: dict[str, Any]) -> list[Any]:
    """PrefillAdder.preempt_to_schedule on a running batch of plain objects with the fields it reads."""
    def req(name: str, priority: int, entry: float, max_new: int, out: int, n_in: int) -> _Req:
        return _Req(rid=name, priority=priority, time_stats=SimpleNamespace(wait_queue_entry_time=entry),
                               sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=False),
                               output_ids=[0] * out, full_untruncated_fill_ids=[0] * n_in, prefix_len=0,
                               kv=SimpleNamespace(req_pool_idx=None), finished=lambda: False)

    running = [req(f"r{i}", r["priority"], float(i), r["max_new"], r["out"], 1) for i, r in enumerate(case["running"])]
    adder = adder_class.__new__(adder_class)
    adder.running_batch = SimpleNamespace(reqs=running, release_req=lambda i, n: None,
                                          filter_batch=lambda keep_indices: None)
    adder.preempt_list = []
    adder.priority_scheduling_preemption_threshold = case["threshold"]
    adder.memory_budget = SimpleNamespace(remaining_total=case["rem_total"], total_offset=0.0)
    adder.new_token_ratio = case["ratio"]
    adder.token_to_kv_pool_allocator = SimpleNamespace(request_slot_reserve=lambda **_kw: 0)
    new = case["new"]
    ok = adder.preempt_to_schedule(req("new", new["priority"], 99.0, new["max_new"], 0, new["input"]))
    return [bool(ok), sorted(int(r.rid[1:]) for r in adder.preempt_list)]


class _Req:
    """A request's fields as PrefillAdder reads them; hashed by identity, as SGLang's Req."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        _probe(Path(sys.argv[2]))
