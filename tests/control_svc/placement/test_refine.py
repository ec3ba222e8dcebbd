import torch

from control_svc.placement.refine import incremental


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
