from collections import Counter

import pytest

from control_svc.evacuate import evacuate
from control_svc.initial_placement import round_robin_placement
from control_svc.placement.types import Placement


def test_sole_copies_move_replicated_ones_are_dropped():
    p = Placement(4, {0: (("a",), ("a", "b"), ("c",), ("a",))})
    q = evacuate(p, "a", [("a", 0), ("b", 0), ("c", 0)], version=5)
    assert q.version == 5 and "a" not in q.servers()
    assert q.replicas[0][1] == ("b",) and q.replicas[0][2] == ("c",)
    moved = [q.replicas[0][0][0], q.replicas[0][3][0]]
    assert sorted(moved) == ["b", "c"]  # spread by load: b had 1 copy, c had 1


def test_every_expert_keeps_a_copy_and_budgets_hold():
    p = round_robin_placement([0, 1, 2], 8, [("a", 0), ("b", 0), ("c", 0)], version=1)
    q = evacuate(p, "b", [("a", 12), ("c", 12), ("b", 0)], version=2)
    load = Counter(s for ex in q.replicas.values() for copies in ex for s in copies)
    assert set(load) == {"a", "c"} and sum(load.values()) == 24 and max(load.values()) <= 12
    for layer in q.layers:
        assert all(copies for copies in q.replicas[layer])


def test_not_enough_slots_is_refused():
    p = round_robin_placement([0], 4, [("a", 0), ("b", 0)], version=1)
    with pytest.raises(ValueError, match="slot_budget"):
        evacuate(p, "a", [("b", 2)], version=2)
    with pytest.raises(ValueError, match="slot_budget"):
        evacuate(p, "a", [], version=2)
