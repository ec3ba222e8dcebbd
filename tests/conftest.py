"""Suite-wide set-up: the hard watchdog under pytest-timeout, and repeatable hypothesis runs."""
import os

from hypothesis import settings

pytest_plugins = ["tests.plugins.watchdog", "tests.fixtures.tiny_models"]

# The same examples on every run, so CI never fails on a draw a previous run did not make;
# HYPOTHESIS_PROFILE=explore draws fresh examples (and more of them) to hunt for new failures.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
