"""The tests, by area: `chaos/` (-m chaos, fault injection), `conformance/` (every test runs upstream
code), `pipeline/`, `workers/`, `producers/`, `scripts/` (the floor of the code a test covers),
`support/` (shared helpers, imported as `tests.support.<module>`). Packages, so pytest puts the
checkout's root on sys.path and never `tests/` itself."""
