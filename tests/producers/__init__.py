"""Tests of producers/: task preparation, admission and enqueue."""
