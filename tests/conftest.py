"""Suite-wide set-up: the hard watchdog under pytest-timeout, the shared tiny models, repeatable
hypothesis runs, and the `slow` rule of the fast lane."""
import importlib.metadata
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


def clashing_kernels_distribution() -> str | None:
    """The version of the Hugging Face `kernels` distribution when it is installed, else None: its
    import name is that of our kernels/ (docs/architecture.md, "The import name `kernels`")."""
    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_sessionstart(session):
    clash = clashing_kernels_distribution()
    if clash is not None:
        pytest.exit(
            f"the Hugging Face `kernels` distribution {clash} is installed (transformers >= 5.25 requires "
            "it); its import name is that of moemesh's kernels/, so transformers would import ours. "
            "Install the test extra's pin: pip install 'transformers>=5,<5.25' && pip uninstall -y kernels",
            returncode=4,
        )


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in SLOW_SUITES:
            item.add_marker(pytest.mark.slow)
