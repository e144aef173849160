"""Benchmarks and thin launchers (`rollout bench`)."""
