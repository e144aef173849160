"""Chaos on the trainer side: a crash between get_samples and save, then resume from the
checkpoint (replayed batches identical); Redis restarted (appendonly) mid-run (what was
acknowledged stays acknowledged, what was pushed is not lost, the reader reconnects)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.keys import Keys
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.store.buffer import GroupBuffer
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]
B, N = 4, 2


def _args(url: str, ns: str) -> SimpleNamespace:
    return SimpleNamespace(pipeline_redis_url=url, pipeline_namespace=ns, rollout_batch_size=B,
                           n_samples_per_prompt=N, pipeline_eta=100, pipeline_wait_timeout_s=30.0,
                           pipeline_publish_engine=False)


def _push(url: str, ns: str, first: int, count: int) -> None:
    async def go() -> None:
        client = connect(url)
        buffer = GroupBuffer(client, Keys(ns))
        await buffer.ensure_group()
        for i in range(first, first + count):
            await buffer.push(make_group(f"g{i}:0", n=N, seed=i))
        await client.aclose()

    asyncio.run(go())


def _fingerprint(batch: list[list]) -> list[tuple]:
    """Everything the trainer sees of a batch: ids, indices, tokens, rewards."""
    return [(s.metadata["pipeline"]["group_id"], s.group_index, s.index, tuple(s.tokens), s.reward)
            for group in batch for s in group]


def test_crash_between_get_samples_and_save_replays_identical_batches(redis_url, namespace):
    _push(redis_url, namespace, 0, 6 * B)
    first = RedisDataSource(_args(redis_url, namespace))
    seen = {}
    for rid in range(4):
        seen[rid] = _fingerprint(generate_rollout(first.args, rid, first).samples)
        if rid == 1:
            first.save(1)  # checkpoint after step 1; steps 2 and 3 were trained but never saved
    first.close()  # the crash: no save(2), no save(3)

    resumed = RedisDataSource(_args(redis_url, namespace))
    resumed.load(1)
    replay = {rid: _fingerprint(generate_rollout(resumed.args, rid, resumed).samples) for rid in (2, 3)}
    fresh = _fingerprint(generate_rollout(resumed.args, 4, resumed).samples)
    resumed.close()
    report = {"replayed_steps": 2, "identical": replay == {2: seen[2], 3: seen[3]},
              "fresh_overlaps_old": bool({f[0] for f in fresh} & {f[0] for s in seen.values() for f in s})}
    print("\nCHAOS trainer crash report:", json.dumps(report))
    assert replay[2] == seen[2] and replay[3] == seen[3]
    assert not report["fresh_overlaps_old"]  # step 4 gets new groups, nothing twice


def test_redis_restart_mid_run_keeps_acknowledged_and_pushed(namespace, tmp_path):
    with LocalRedis(appendonly=True, data_dir=str(tmp_path)) as server:
        _push(server.url, namespace, 0, 3 * B)
        source = RedisDataSource(_args(server.url, namespace))
        before = [_fingerprint(generate_rollout(source.args, rid, source).samples) for rid in (0, 1)]
        source.save(1)  # steps 0-1 acknowledged
        server.restart()  # SIGTERM + start on the same port and AOF
        after_restart = _fingerprint(generate_rollout(source.args, 2, source).samples)  # same client reconnects
        _push(server.url, namespace, 3 * B, B)  # workers push again after the restart
        later = _fingerprint(generate_rollout(source.args, 3, source).samples)
        source.save(3)
        ready = len(source)
        source.close()
    trained = [f[0] for batch in (*before, after_restart, later) for f in batch[::N]]
    report = {"groups_trained": len(trained), "distinct": len(set(trained)), "ready_after": ready}
    print("\nCHAOS redis restart report:", json.dumps(report))
    assert sorted(trained) == sorted(f"g{i}:0" for i in range(4 * B))  # nothing lost, nothing twice
    assert ready == 0


# ----------------------------------------------------------- the trainer in its own process
_TRAINER = r'''
import json, os, signal, sys
from types import SimpleNamespace
from pipeline.slime.data_source import RedisDataSource, generate_rollout

url, ns, workdir, steps, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
phase, _, kill_rid = kill_at.partition(":")
kill_rid = int(kill_rid or -1)
ckpt_path, log_path = os.path.join(workdir, "ckpt"), os.path.join(workdir, "trained.log")

def die(where, rid):
    if phase == where and rid == kill_rid:
        os.kill(os.getpid(), signal.SIGKILL)

args = SimpleNamespace(pipeline_redis_url=url, pipeline_namespace=ns, rollout_batch_size=%(B)d,
                       n_samples_per_prompt=%(N)d, pipeline_eta=100, pipeline_wait_timeout_s=30.0,
                       pipeline_publish_engine=False)
source = RedisDataSource(args)
ckpt = int(open(ckpt_path).read()) if os.path.exists(ckpt_path) else -1
orig_load_recorded = source._load_recorded
async def load_recorded():
    recorded = await orig_load_recorded()
    die("load", ckpt)  # in load, after the records were read, before anything is acknowledged
    return recorded
source._load_recorded = load_recorded
source.load(ckpt)
orig_ack = source.buffer.ack
async def ack(ids):
    await orig_ack(ids)
    die("save", current[0])  # in save: acknowledged, record not yet deleted
source.buffer.ack = ack
current = [ckpt + 1]
for rid in range(ckpt + 1, steps):
    current[0] = rid
    batch = generate_rollout(args, rid, source).samples
    with open(log_path, "a") as log:
        log.write(json.dumps({"rid": rid, "groups": [[s.metadata["pipeline"]["group_id"], s.group_index, s.index,
                              list(s.tokens), s.reward] for g in batch for s in g]}) + "\n")
        log.flush(); os.fsync(log.fileno())
    die("train", rid)  # between get_samples and save
    with open(ckpt_path + ".tmp", "w") as f:  # slime writes the model checkpoint, then calls save(rid)
        f.write(str(rid))
    os.replace(ckpt_path + ".tmp", ckpt_path)
    source.save(rid)
source.close()
''' % {"B": B, "N": N}


def test_trainer_process_sigkilled_five_times_replays_identically(redis_url, namespace, tmp_path):
    import random
    import subprocess
    import sys

    steps, kills = 10, 5
    _push(redis_url, namespace, 0, steps * B)
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    rng = random.Random(5)
    plan = ["train", "save", "load", "train", "train"]  # each kind of point, in a random order and step
    rng.shuffle(plan)
    assert len(plan) == kills
    runs = []
    for phase in [*plan, "none"]:
        ckpt = int((tmp_path / "ckpt").read_text()) if (tmp_path / "ckpt").exists() else -1
        at = f"{phase}:{ckpt if phase == 'load' else min(steps - 1, ckpt + 1 + rng.randrange(2))}"
        proc = subprocess.run([sys.executable, str(script), redis_url, namespace, str(tmp_path), str(steps), at],
                              capture_output=True, text=True, timeout=60, cwd=str(Path(__file__).parents[2]))
        runs.append({"kill_at": at, "rc": proc.returncode})
        if phase != "none":
            assert proc.returncode == -9, (at, proc.stderr[-2000:])
    assert runs[-1]["rc"] == 0, runs
    records = [json.loads(line) for line in (tmp_path / "trained.log").read_text().splitlines()]
    by_step: dict[int, list] = {}
    replayed = differing = 0
    for rec in records:
        if rec["rid"] in by_step:
            replayed += 1
            differing += rec["groups"] != by_step[rec["rid"]]
        else:
            by_step[rec["rid"]] = rec["groups"]
    trained = [g[0] for rid in sorted(by_step) for g in by_step[rid][::N]]
    report = {"kills": runs[:-1], "steps": len(by_step), "replayed_steps": replayed, "replays_differing": differing,
              "groups": len(trained), "distinct": len(set(trained))}
    print("\nCHAOS trainer process SIGKILL report:", json.dumps(report))
    assert sorted(by_step) == list(range(steps)), report
    assert differing == 0, report  # every replayed step is identical
    assert replayed >= 2, report  # the kills between get_samples and save did make steps replay
    assert sorted(trained) == sorted(f"g{i}:0" for i in range(steps * B)), report  # 0 lost, 0 twice
