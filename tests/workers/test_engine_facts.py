"""Issue 47 item 3: how the engine client reads an engine's facts (/server_info) again after a
failed read (workers/engine.py `EngineDirectory._read_facts`), on real loopback HTTP servers: the
simulator (an SGLang-like engine) behind a relay that fails the requests a test tells it to.

An engine that answered with an error status (a 503 while it restarts, then its facts) is asked
again at its next use, once; a read that fails again backs off (`_FACTS_RETRY_S`, doubling), and
a read that got no answer (a hang costs a control timeout) backs off from its first failure."""

from __future__ import annotations

import asyncio
import time

from tests.workers.test_engine_fleet import Relay, relay
from workers.engine import EngineClient, EngineFacts
from workers.sim.engine import SimConfig, serve_sim_engine

CONTEXT = 8000  # the simulator's --context-length: its facts say limit 8000


async def _reads(client: EngineClient, front: Relay, seconds: float) -> tuple[list[float], EngineFacts]:
    """Ask for the engine's facts every 10 ms for `seconds`, as requests do: (when each call that
    reached the engine's /server_info began, monotonic s; the facts of the last call)."""
    reads: list[float] = []
    facts = EngineFacts()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began, asked = time.monotonic(), front.asked.count("/server_info")
        facts = await client.directory.facts_of(front.url)
        if front.asked.count("/server_info") > asked:
            reads.append(began)
        await asyncio.sleep(0.01)
    return reads, facts


async def test_the_first_503_of_a_facts_read_is_read_again_at_the_next_use():
    """A restarting engine answers 503, then its facts: the next use reads them (no backoff after
    the first error status), and they are kept from then on."""
    async with serve_sim_engine(SimConfig(context_length=CONTEXT)) as sim, relay(sim.url) as front, \
            EngineClient(front.url) as client:
        front.faults["/server_info"] = [503]
        assert await client.directory.facts_of(front.url) == EngineFacts()  # the 503: nothing made up
        reads, facts = await _reads(client, front, 0.3)
    assert facts == EngineFacts(limit=CONTEXT)
    assert len(reads) == 1  # read once more at once, then kept: no read after it answered
    assert front.asked == ["/server_info", "/server_info"]  # a 503 is not the alias's 404: no /get_server_info


async def test_a_facts_read_that_keeps_failing_backs_off_doubling(monkeypatch):
    """An engine that answers 503 every time: read at once after the first 503 only; then the
    reads are `_FACTS_RETRY_S` apart, doubling: a handful in 2 s, not one per use (~100 here)."""
    monkeypatch.setattr("workers.engine._FACTS_RETRY_S", 0.4)
    async with serve_sim_engine(SimConfig(context_length=CONTEXT)) as sim, relay(sim.url) as front, \
            EngineClient(front.url) as client:
        front.faults["/server_info"] = [503] * 100
        reads, facts = await _reads(client, front, 2.0)
    assert facts == EngineFacts()
    gaps = [later - earlier for earlier, later in zip(reads, reads[1:])]
    assert 3 <= len(reads) <= 4, gaps  # at 0, at once, >= 0.4 s later, >= 0.8 s after that (>= 1.2 s in)
    assert gaps[0] < 0.4, gaps  # the first 503: read again at the next use
    assert gaps[1] >= 0.4 and (len(gaps) < 3 or gaps[2] >= 0.8), gaps  # then backing off, doubling


async def test_a_facts_read_with_no_answer_is_not_read_again_at_once(monkeypatch):
    """No answer within the control timeout (a hung /server_info) is no error status: the engine
    is not asked again at the next use but after `_FACTS_RETRY_S`, when it answers."""
    monkeypatch.setattr("workers.engine._FACTS_RETRY_S", 0.4)
    async with serve_sim_engine(SimConfig(context_length=CONTEXT)) as sim, relay(sim.url) as front, \
            EngineClient(front.url, control_timeout_s=0.2) as client:
        front.faults["/server_info"] = [1.0]  # the first read waits 1 s: past the client's 0.2 s
        reads, facts = await _reads(client, front, 1.2)
    assert facts == EngineFacts(limit=CONTEXT)
    assert len(reads) == 2, reads
    assert reads[1] - reads[0] >= 0.2 + 0.4  # its timeout, then the backoff: not at the next use

