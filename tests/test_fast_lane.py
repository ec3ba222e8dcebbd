"""The fast lane's rule (tests/conftest.py): every test of the suites that span services is slow;
elsewhere only the tests marked so are."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests import conftest

TESTS = Path(__file__).resolve().parent


class FakeItem:
    def __init__(self, path: Path) -> None:
        self.fspath = path
        self.markers: list = []

    def add_marker(self, marker) -> None:
        self.markers.append(marker)


@pytest.mark.parametrize("where, slow", [
    (TESTS / "e2e" / "test_mesh.py", True),
    (TESTS / "live" / "test_failover.py", True),
    (TESTS / "moemesh" / "engine" / "test_scheduler.py", False),
    (TESTS / "moemesh" / "e2e_named_file.py", False),  # only the top-level suites count
    (Path("/elsewhere/e2e/test_x.py"), False),  # a test outside tests/ (pytest run on another tree)
])
def test_suites_that_span_services_are_slow(where, slow):
    item = FakeItem(where)
    conftest.pytest_collection_modifyitems(None, [item])
    assert [m.name for m in item.markers] == (["slow"] if slow else [])
