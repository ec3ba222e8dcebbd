import pytest
import torch

from control_svc.placement import Placement, balancedness, server_loads


def test_replicas_share_load_evenly():
    p = Placement(1, {0: (("a", "b"), ("b",))})
    loads = server_loads(torch.tensor([[8.0, 2.0]]), p)
    assert loads.tolist() == [[4.0, 6.0]]
    assert balancedness(torch.tensor([[8.0, 2.0]]), p) == pytest.approx(5.0 / 6.0)


def test_idle_named_servers_count_and_layers_average():
    p = Placement(0, {0: (("a",), ("a",)), 1: (("a",), ("b",))})
    load = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    assert balancedness(load, p) == pytest.approx((0.5 + 1.0) / 2)
    assert balancedness(load, p, servers=["a", "b", "c"]) == pytest.approx((1 / 3 + 2 / 3) / 2)


def test_zero_load_is_balanced():
    assert balancedness(torch.zeros(1, 2), Placement(0, {0: (("a",), ("b",))})) == 1.0


def test_shape_mismatch_names_field():
    with pytest.raises(ValueError, match="layers"):
        balancedness(torch.ones(2, 2), Placement(0, {0: (("a",), ("b",))}))
    with pytest.raises(ValueError, match="experts"):
        balancedness(torch.ones(1, 3), Placement(0, {0: (("a",), ("b",))}))
