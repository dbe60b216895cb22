"""The system lane: whole-system runs that take minutes each (a soak with faults, schemathesis over
every route, a non-editable install, the RL example). `scripts/test` runs them; `--fast` leaves
them out. test_fuzz's server comes from the integration tests' launcher."""

from tests.integration.conftest import module_server  # noqa: F401  (a fixture)
