"""The arq workers on the engine path a cluster runs: `engine.url: auto` follows the router URL the
slime side publishes, and every episode goes smg -> SGLang 0.5.23's own HTTP front -> the
simulator as scheduler (tests/support/engine_stack.py, the session's stack). Groups land once and
whole; every /generate body the workers sent was admitted by SGLang's server; a weight push as
slime makes it (each engine of the router's `GET /workers`: pause, update_weight_version,
continue) shows in the samples' version labels; a long episode at the engines' 4096-token
context ends truncated with its tokens."""

import aiohttp
import pytest

from pipeline.config import parse_config
from pipeline.keys import Counter
from pipeline.schema import Status
from pipeline.state import PipelineState
from pipeline.store.jobqueue import create_arq_pool, enqueue_prompt_job
from tests.support.engine_stack import SHARED_MODEL_CONTEXT, START_TIMEOUT_S, shared_stack
from tests.support.policy_helpers import trainer_started
from tests.workers.test_worker_jobs import config_dict, job, run_worker_until, stream_groups

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(START_TIMEOUT_S + 120)]


@pytest.fixture
def stack():
    return shared_stack()


@pytest.fixture(autouse=True)
async def _policy_published(redis, keys):
    await trainer_started(redis, keys)


def _groups_landed(redis, keys, n):
    async def check() -> bool:
        return await redis.xlen(keys.groups) >= n

    return check


async def _push_weights(router: str, version: str) -> None:
    """slime's weight push: the engines from the router's list, each paused, relabelled, resumed."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{router}/workers") as resp:
            engines = [w["url"] for w in (await resp.json())["workers"]]
        for engine in engines:
            for path, body in (("/pause_generation", {}), ("/update_weight_version", {"new_version": version}),
                               ("/continue_generation", {})):
                async with session.post(f"{engine}{path}", json=body) as resp:
                    assert resp.status == 200, (engine, path, await resp.text())


async def test_groups_land_through_the_router_and_sglangs_front(stack, redis, redis_url, keys, namespace):
    stack.configure(accuracy=0.7, tool_use=0.9)
    await PipelineState(redis, keys).set_engine(stack.router_url)  # what the slime side publishes
    config = parse_config(config_dict(redis_url, namespace, "auto"))
    arq = await create_arq_pool(redis_url, keys)
    try:
        first = [job(namespace, i) for i in range(2)]
        assert all([await enqueue_prompt_job(arq, j, keys) for j in first])
        await run_worker_until(config, _groups_landed(redis, keys, 2), "2 groups", timeout=60)
        await _push_weights(stack.router_url, "1")
        second = [job(namespace, i) for i in range(2, 4)]
        assert all([await enqueue_prompt_job(arq, j, keys) for j in second])
        await run_worker_until(config, _groups_landed(redis, keys, 4), "4 groups", timeout=60)
    finally:
        await arq.aclose()
    groups = {g.group_id: g for g in await stream_groups(redis, keys)}
    assert sorted(groups) == sorted(j.job_id for j in first + second)
    for j in first + second:
        samples = groups[j.job_id].samples
        assert len(samples) == 4 and all(s.status is not Status.FAILED and s.response_length > 0 for s in samples)
        label = "default" if j in first else "1"
        assert all(set(s.weight_versions) == {label} for s in samples), [s.weight_versions for s in samples]
    counters = await PipelineState(redis, keys).counters()
    assert counters[Counter.EPISODES] == 16 and counters.get(Counter.EPISODES_FAILED, 0) == 0
    stats = stack.total_stats()
    assert stats["requests"] == len(stack.all_bodies()) > 16  # every body reached SGLang's front and was admitted
    assert stats["errors"] == 0


async def test_a_long_group_at_the_engines_context_ends_truncated_with_its_tokens(stack, redis, redis_url, keys,
                                                                                 namespace):
    """~2048 tokens a turn: the second turn of each tool episode meets the 4096-token context."""
    stack.configure(accuracy=1.0, tool_use=1.0, length_mu=7.7, length_sigma=0.01, max_filler_tokens=2048)
    await PipelineState(redis, keys).set_engine(stack.router_url)
    data = config_dict(redis_url, namespace, "auto")
    data["rollout"]["max_response_tokens"] = 8192
    config = parse_config(data)
    arq = await create_arq_pool(redis_url, keys)
    try:
        assert await enqueue_prompt_job(arq, job(namespace, 3, n=2), keys)
        await run_worker_until(config, _groups_landed(redis, keys, 1), "1 group", timeout=60)
    finally:
        await arq.aclose()
    (group,) = await stream_groups(redis, keys)
    for sample in group.samples:
        assert sample.status is Status.TRUNCATED, sample.metadata
        assert [t["finish"] for t in sample.metadata["turn_log"]] == ["stop", "length"]
        assert sample.num_tokens == SHARED_MODEL_CONTEXT - 6
