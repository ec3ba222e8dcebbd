import pytest
import torch
from hypothesis import given, settings, strategies as st

from control_svc.placement import replicate
from control_svc.placement.replicate import copies_fit, slot_capacity


def test_extra_copies_go_to_highest_load_per_copy():
    phy2log, rank, logcnt = replicate(torch.tensor([10.0, 1.0, 4.0, 1.0]), 7)
    # 10 -> 2 copies (5 each) -> 4 vs 5: expert 0 again (3.33) -> expert 2 (4 -> 2)
    assert logcnt.tolist() == [3, 1, 2, 1]
    assert phy2log.tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert rank.tolist() == [0, 1, 2, 0, 0, 1, 0]


def test_two_d_rows_are_independent():
    phy2log, rank, logcnt = replicate(torch.tensor([[5.0, 1.0], [1.0, 5.0]]), 3)
    assert logcnt.tolist() == [[2, 1], [1, 2]]
    assert phy2log.shape == rank.shape == (2, 3)


def test_server_slots_cap_copies_at_one_per_server():
    # two servers: no expert can have 3 copies however hot it is
    _, _, logcnt = replicate(torch.tensor([100.0, 1.0, 1.0]), 5, server_slots=[3, 3])
    assert logcnt.max() <= 2 and logcnt.sum() == 5


def test_gale_ryser_blocks_unplaceable_counts():
    # slots [3,3,1]: two experts with 3 copies each would need 2 copies on the 1-slot server
    _, _, logcnt = replicate(torch.tensor([100.0, 90.0, 1.0]), 7, server_slots=[3, 3, 1])
    assert copies_fit(logcnt, slot_capacity([3, 3, 1], 3))
    assert logcnt.sum() == 7


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_load_names_field(bad):
    with pytest.raises(ValueError, match="load"):
        replicate(torch.tensor([1.0, bad]), 2)


def test_too_few_physical_names_field():
    with pytest.raises(ValueError, match="num_physical"):
        replicate(torch.ones(4), 3)
    with pytest.raises(ValueError, match="num_physical"):
        replicate(torch.ones(2), 5, server_slots=[1, 1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=16), st.integers(0, 20))
def test_invariants(loads, extra):
    load = torch.tensor(loads, dtype=torch.float64)
    p = len(loads) + extra
    phy2log, rank, logcnt = replicate(load, p)
    assert phy2log.shape == (p,) and (logcnt >= 1).all() and int(logcnt.sum()) == p
    assert torch.equal(torch.bincount(phy2log, minlength=len(loads)), logcnt)
    for e in range(len(loads)):
        assert sorted(rank[phy2log == e].tolist()) == list(range(int(logcnt[e])))
    # greedy optimality: no move of one copy lowers the max load per copy
    if extra:
        per = load / logcnt
        donors = logcnt > 1
        if donors.any():
            assert per.max() <= (load / (logcnt - 1).clamp_min(1))[donors].min() + 1e-9
