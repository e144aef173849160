"""The simulated scheduler's rules checked against SGLang 0.5.23's own code, run on CPU: the same
request sequences go through SGLang's functions and through workers/sim/scheduler.py, and their
decisions must be the same.

- queue order: `SchedulePolicy._sort_by_priority_and_fcfs` (managers/schedule_policy.py);
- decode retraction order: `ScheduleBatch._get_decode_retraction_order` (managers/schedule_batch.py,
  --retraction-policy length);
- priority preemption: `PrefillAdder.preempt_to_schedule` (managers/schedule_policy.py): which
  running requests it releases, and whether the waiting one may then be scheduled.

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
    return {"sort": sort, "retract": retract, "preempt": preempt}


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
    print(json.dumps({"sort": sort, "retract": retract, "preempt": preempt}))


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
