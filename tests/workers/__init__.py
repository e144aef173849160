"""Tests of workers/: engine client, episodes, environments, liveness, the pool, the simulator."""
