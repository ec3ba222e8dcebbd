import torch

from control_svc.placement.refine import incremental


def test_keeps_held_copies_then_moves_off_the_busiest_server():
    # 4 experts, 2 servers x 3 slots, all held on server 0: the repair keeps 3 there
    weights = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    groups = torch.arange(4)
    held = torch.zeros(4, 2, dtype=torch.bool)
    held[:, 0] = True
    snaps = incremental(weights, groups, held, torch.tensor([3, 3]), max_steps=10)
    first, last = snaps[0], snaps[-1]
    assert first.tolist() == [0, 0, 0, 1]
    loads = torch.zeros(2, dtype=torch.float64).index_add_(0, last, weights)
    assert loads.max() == 5.0  # 4+1 | 3+2
    for a, b in zip(snaps, snaps[1:]):  # every step lowers the peak or the busiest server's load
        la = torch.zeros(2, dtype=torch.float64).index_add_(0, a, weights)
        lb = torch.zeros(2, dtype=torch.float64).index_add_(0, b, weights)
        assert lb.max() <= la.max()
        assert int((a != b).sum()) in (1, 2)


def test_no_step_when_balanced():
    weights = torch.tensor([1.0, 1.0], dtype=torch.float64)
    held = torch.tensor([[True, False], [False, True]])
    snaps = incremental(weights, torch.arange(2), held, torch.tensor([1, 1]), max_steps=5)
    assert len(snaps) == 1 and snaps[0].tolist() == [0, 1]
