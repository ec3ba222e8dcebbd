import pytest
import torch
from hypothesis import given, settings, strategies as st

from control_svc.placement import pack


def test_heaviest_first_onto_least_loaded():
    a = pack(torch.tensor([5.0, 4.0, 3.0, 3.0]), 2, 2)
    loads = torch.zeros(2, dtype=torch.float64).index_add_(0, a, torch.tensor([5.0, 4.0, 3.0, 3.0], dtype=torch.float64))
    assert sorted(loads.tolist()) == [7.0, 8.0]


def test_respects_per_server_budgets():
    a = pack(torch.tensor([9.0, 1.0, 1.0, 1.0]), 2, [1, 3])
    assert torch.bincount(a, minlength=2).tolist() == [1, 3]


def test_groups_never_share_a_server_even_when_greedy_would():
    # greedy puts item 1 (group 1) on server 0's only slot; both copies of group 0 then need
    # distinct servers: the augmenting path moves item 1 to make room.
    w = torch.tensor([5.0, 6.0, 5.0, 1.0])
    groups = torch.tensor([0, 1, 0, 2])
    a = pack(w, 2, [1, 3], groups=groups)
    assert a[0] != a[2]
    assert torch.bincount(a, minlength=2).tolist() == [1, 3]


def test_sticky_copies_stay_within_tolerance():
    w = torch.tensor([4.0, 4.0, 1.0, 1.0])
    held = torch.zeros(1, 4, 2, dtype=torch.bool)
    held[0, 0, 1] = held[0, 1, 0] = True  # item 0 on server 1, item 1 on server 0
    a = pack(w, 2, 2, held=held, tolerance=0.0)
    assert a.tolist()[:2] == [1, 0]
    held_far = torch.zeros(1, 4, 2, dtype=torch.bool)
    held_far[0, 0, 0] = held_far[0, 1, 0] = True  # both heavy items on server 0: the second moves
    a = pack(w, 2, 2, held=held_far, tolerance=0.1)
    assert a[0] != a[1]


def test_over_budget_names_slots():
    with pytest.raises(ValueError, match="slots"):
        pack(torch.ones(5), 2, 2)
    with pytest.raises(ValueError, match="slots"):
        pack(torch.ones(3), 2, 2, groups=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="slots"):
        pack(torch.ones(3), 2, [1, 2, 3])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_item_placed_within_budgets(data):
    s = data.draw(st.integers(1, 5))
    slots = data.draw(st.lists(st.integers(0, 6), min_size=s, max_size=s))
    n = data.draw(st.integers(0, sum(slots)))
    w = torch.tensor(data.draw(st.lists(st.floats(0, 100), min_size=n, max_size=n)), dtype=torch.float64)
    a = pack(w, s, slots)
    assert a.shape == (n,)
    assert (torch.bincount(a, minlength=s) <= torch.tensor(slots)).all()
