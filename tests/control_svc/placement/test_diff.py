from control_svc.placement import Placement, placement_diff


def test_loads_and_drops_per_server():
    old = Placement(1, {0: (("a",), ("b",)), 1: (("a", "b"), ("b",))})
    new = Placement(2, {0: (("a",), ("a", "c")), 1: (("b",), ("b",))})
    d = placement_diff(old, new)
    assert d.loads == {"a": {0: (1,)}, "c": {0: (1,)}}
    assert d.drops == {"a": {1: (0,)}, "b": {0: (1,)}}
    assert d.moves == 2 and not d.empty


def test_from_nothing_loads_everything():
    new = Placement(0, {0: (("a",), ("b",))})
    d = placement_diff(None, new)
    assert d.moves == 2 and d.drops == {}
    assert placement_diff(new, new).empty
