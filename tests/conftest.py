"""Suite-wide set-up: the hard watchdog under pytest-timeout, the shared tiny models, repeatable
hypothesis runs, and the `slow` rule of the fast lane."""
import os
from pathlib import Path

import pytest
from hypothesis import settings

pytest_plugins = ["tests.plugins.watchdog", "tests.fixtures.tiny_models"]

# The same examples on every run, so CI never fails on a draw a previous run did not make;
# HYPOTHESIS_PROFILE=explore draws fresh examples (and more of them) to hunt for new failures.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# The fast lane (`scripts/test.sh --fast`) is pytest -m "not slow". A test is slow when it starts
# processes of the project (a mesh, a service, a `moemesh` command, an engine or pytest in a child
# process), a browser or the real demo model, or takes more than 2 s alone (`--durations`). The
# suites that span services (tests/e2e, tests/live) are slow as a whole; elsewhere the test or module
# says so with @pytest.mark.slow, naming why.
SLOW_SUITES = ("e2e", "live")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in SLOW_SUITES:
            item.add_marker(pytest.mark.slow)
