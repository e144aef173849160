"""A redis-server started by the project (`pipeline.store.local_redis.LocalRedis`: the demo's, the
tests') is the one that answers on its port: a port picked free may be taken before the server
binds it, and the PONG then is the other server's while ours exits (once seen as a Sentinel
deployment a sentinel short, tests/support/sentinel_helpers.py). Real redis-server processes."""

from __future__ import annotations

import pytest

from pipeline.store.local_redis import LocalRedis, PortTaken, server_pid


def test_a_port_someone_else_holds_is_refused_by_name():
    with LocalRedis() as holder:
        taken = LocalRedis(port=holder.port)  # a fixed port (a restart's): refused, not shared
        with pytest.raises(PortTaken, match=f"port {holder.port} is answered by process {holder.proc.pid}"):
            taken.start()
        taken.close()
        assert server_pid(holder.port) == holder.proc.pid


def test_a_picked_port_taken_before_the_start_is_picked_again():
    mine = LocalRedis()
    picked = mine.port
    with LocalRedis(port=picked) as squatter:  # took the port between the pick and the start
        with mine:
            assert mine.port != picked and server_pid(mine.port) == mine.proc.pid
            assert mine.url.endswith(f":{mine.port}/0")
        assert server_pid(picked) == squatter.proc.pid
