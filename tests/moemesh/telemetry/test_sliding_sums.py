import pytest

from moemesh.telemetry import SlidingSums


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_sums_slide_out_and_say_what_they_cover():
    clock = Clock()
    s = SlidingSums(("calls", "busy"), window_s=10.0, buckets=5, clock=clock)
    assert s.window() == {"calls": 0.0, "busy": 0.0, "seconds": 0.0}
    s.add(calls=2, busy=0.5)
    clock.t = 104.0
    s.add(calls=1)
    assert s.window() == {"calls": 3.0, "busy": 0.5, "seconds": 4.0}  # younger than its window
    clock.t = 111.0  # the first bucket [100, 102) left the window
    assert s.window() == {"calls": 1.0, "busy": 0.0, "seconds": pytest.approx(9.0)}  # buckets from 102 to now
    clock.t = 200.0
    assert s.window()["calls"] == 0.0 and s.window()["seconds"] == pytest.approx(8.0)


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match="names"):
        SlidingSums(("a", "a"))
    with pytest.raises(ValueError, match="names"):
        SlidingSums(("seconds",))
    with pytest.raises(ValueError, match="window_s"):
        SlidingSums(("a",), window_s=0)
    with pytest.raises(ValueError, match="unknown sums"):
        SlidingSums(("a",)).add(b=1)
