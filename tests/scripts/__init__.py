"""Tests of scripts/: the `rollout` commands as a user runs them, the demo, the benchmarks' checks."""
