"""Helpers the tests share (no tests here): engine stacks, upstream snapshots, chaos harness, ..."""
