"""Tests of pipeline/: the contracts, the Redis store, the slime side, evaluation, the operator's views."""
