"""Evaluation through the workers: a round pinned to a policy version (`evaluation`), and rounds
that run in the background without holding a training step (`background`)."""
