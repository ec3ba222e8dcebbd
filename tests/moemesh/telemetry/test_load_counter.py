import threading

import pytest
import torch

from moemesh.telemetry import ExpertLoadCounter


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_window_slides_and_totals_stay():
    clock = FakeClock()
    c = ExpertLoadCounter([3, 5], 4, window_s=10.0, buckets=5, clock=clock)
    c.add(3, torch.tensor([1, 0, 2, 0]))
    clock.t += 4.0
    c.add(5, torch.tensor([0, 7, 0, 0]))
    assert c.window().tolist() == [[1, 0, 2, 0], [0, 7, 0, 0]]
    clock.t += 7.0  # the first add is now older than 10 s
    assert c.window().tolist() == [[0, 0, 0, 0], [0, 7, 0, 0]]
    clock.t += 100.0
    assert c.window().sum() == 0
    assert c.totals().tolist() == [[1, 0, 2, 0], [0, 7, 0, 0]]


def test_add_all_and_dtype_conversion():
    c = ExpertLoadCounter(2, 3, clock=FakeClock())
    c.add_all(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    c.add(1, [1, 1, 1])
    assert c.window().tolist() == [[1, 2, 3], [5, 6, 7]]
    assert c.window().dtype == torch.int64


def test_concurrent_adds_are_not_lost():
    c = ExpertLoadCounter(1, 8)
    ones = torch.ones(8, dtype=torch.int64)

    def work():
        for _ in range(500):
            c.add(0, ones)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.totals().tolist() == [[2000] * 8]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"layers": 0}, "layers"), ({"num_experts": 0}, "num_experts"), ({"window_s": 0.0}, "window_s"), ({"buckets": 0}, "buckets")],
)
def test_bad_construction_names_field(kwargs, field):
    args = {"layers": 2, "num_experts": 4} | kwargs
    with pytest.raises(ValueError, match=field):
        ExpertLoadCounter(**args)


def test_bad_add_names_field():
    c = ExpertLoadCounter(2, 4)
    with pytest.raises(ValueError, match="layer"):
        c.add(7, torch.zeros(4))
    with pytest.raises(ValueError, match="counts"):
        c.add(0, torch.zeros(3))
    with pytest.raises(ValueError, match="counts"):
        c.add_all(torch.zeros(4, 2))


def test_add_sparse_matches_the_dispatch_groups():
    c = ExpertLoadCounter([2], 4, clock=FakeClock())
    c.add_sparse(2, torch.tensor([3, 0, 3]), torch.tensor([5, 1, 2]))
    assert c.window().tolist() == [[1, 0, 0, 7]]
    for bad in (4, -1):
        with pytest.raises(ValueError, match="expert_ids"):
            c.add_sparse(2, torch.tensor([bad]), torch.tensor([1]))
    assert c.totals().tolist() == [[1, 0, 0, 7]]
    with pytest.raises(ValueError, match="same length"):
        c.add_sparse(2, torch.tensor([1, 2]), torch.tensor([1]))
