"""Fault injection (`-m chaos`, left out of a run that names neither the marker nor these files:
tests/conftest.py): processes SIGKILLed, Redis killed and restarted, replies lost."""
