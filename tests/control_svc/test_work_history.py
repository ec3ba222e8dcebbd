"""control_svc.work_history: one window kept every half window, forgotten with its server, and the
earlier windows handed to the cost model without the current one."""
from control_svc.cost_model import WorkSample
from control_svc.work_history import WorkHistory


def sample(rows: int) -> WorkSample:
    return WorkSample(10.0, 100, 100, rows, 1.0, 2.0, 1.0, 0.1)


def test_windows_are_kept_half_a_window_apart_and_at_most_keep():
    h = WorkHistory(keep=2)
    h.record("a", sample(1), now=0.0)
    h.record("a", sample(2), now=4.0)  # under half of the 10 s window since the last kept: skipped
    h.record("a", sample(3), now=5.0)
    h.record("a", sample(4), now=10.0)
    assert [s.rows for s in h.windows()["a"]] == [3, 4]
    h.forget("a")
    assert h.windows() == {}


def test_earlier_leaves_out_each_servers_current_window():
    h = WorkHistory()
    h.record("a", sample(1), now=0.0)
    h.record("a", sample(2), now=10.0)
    h.record("b", sample(7), now=0.0)
    assert {k: [s.rows for s in v] for k, v in h.earlier({"a": sample(2)}).items()} == {"a": [1], "b": [7]}
