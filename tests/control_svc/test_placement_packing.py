import pytest
import torch
from hypothesis import given, settings, strategies as st

from control_svc.placement_packing import copies_fit, incremental, pack, replicate, slot_capacity


# ---- replicate ----------------------------------------------------------------------------------
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
def test_replicate_invariants(loads, extra):
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


# ---- pack ---------------------------------------------------------------------------------------
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


# ---- incremental --------------------------------------------------------------------------------
def peak(expert_load, groups, assign, num_servers):
    w = expert_load[groups] / torch.bincount(groups, minlength=len(expert_load))[groups]
    return float(torch.zeros(num_servers, dtype=torch.float64).index_add_(0, assign, w).max())


def test_keeps_held_copies_then_moves_off_the_busiest_server():
    # 4 experts, 2 servers x 3 slots, all held on server 0: the repair keeps 3 there
    load = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    groups = torch.arange(4)
    held = torch.zeros(4, 2, dtype=torch.bool)
    held[:, 0] = True
    snaps = incremental(load, groups, held, torch.tensor([3, 3]), max_steps=10)
    (g0, a0), (g1, a1) = snaps[0], snaps[-1]
    assert a0.tolist() == [0, 0, 0, 1]
    assert peak(load, g1, a1, 2) == 5.0  # 4+1 | 3+2
    for (ga, a), (gb, b) in zip(snaps, snaps[1:]):
        assert peak(load, gb, b, 2) <= peak(load, ga, a, 2)
        assert int((a != b).sum() + (ga != gb).sum()) in (1, 2)


def test_re_replication_moves_a_copy_to_the_hot_expert():
    # expert 0 is hot but has one copy; expert 1 is cold with two: giving 0 the second copy balances
    load = torch.tensor([10.0, 2.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 2])
    held = torch.tensor([[True, False], [True, True], [False, False]])
    g, a = incremental(load, groups, held, torch.tensor([2, 2]), max_steps=10)[-1]
    assert torch.bincount(g, minlength=3).tolist() == [2, 1, 1]
    assert peak(load, g, a, 2) <= 7.0  # 5+2 | 5+1 (or better)
    on = {(int(e), int(s)) for e, s in zip(g, a)}
    assert len(on) == 4  # no expert twice on a server


def test_no_step_when_balanced():
    load = torch.tensor([1.0, 1.0], dtype=torch.float64)
    held = torch.tensor([[True, False], [False, True]])
    snaps = incremental(load, torch.arange(2), held, torch.tensor([1, 1]), max_steps=5)
    assert len(snaps) == 1 and snaps[0][1].tolist() == [0, 1]
