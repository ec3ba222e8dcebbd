import pytest

from moemesh.contracts.placement import Placement


def test_servers_and_experts_on():
    p = Placement(2, {3: (("b",), ("a", "b")), 1: (("a",), ("b",))})
    assert p.layers == (1, 3)
    assert p.servers() == ("a", "b")
    assert p.experts_on("a") == {3: (1,), 1: (0,)}
    assert p.experts_on("c") == {}


def test_every_expert_needs_a_server_and_versions_are_not_negative():
    with pytest.raises(ValueError, match="layer 0 expert 1 has no server"):
        Placement(1, {0: (("a",), ())})
    with pytest.raises(ValueError, match="version"):
        Placement(-1)
