"""bench/alternated_steps.py: the two sides take turns, the first alternating; medians per side; flags checked."""
from __future__ import annotations

import pytest

from bench import alternated_steps


def test_the_sides_take_turns_and_the_first_alternates():
    calls = []
    med = alternated_steps.alternate(4, {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert set(med) == {"a", "b"} and all(v >= 0 for v in med.values())


def test_the_median_is_each_sides_own(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setattr(alternated_steps.time, "perf_counter", lambda: next(ticks) / 1000)  # every call 1 ms later
    slow = lambda: [next(ticks) for _ in range(2)]  # noqa: E731  two more ticks: 3 ms a step
    med = alternated_steps.alternate(3, {"fast": lambda: None, "slow": slow})
    assert med == {"fast": pytest.approx(1.0), "slow": pytest.approx(3.0)}


@pytest.mark.parametrize("flag", ["--steps", "--threads", "--concurrent"])
def test_zero_is_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit):
        alternated_steps.parse_args("A bench.", [flag, "0"])
    assert flag in capsys.readouterr().err


def test_defaults():
    ns = alternated_steps.parse_args("A bench.", [], steps=40)
    assert (ns.shape, ns.model, ns.experts_dtype, ns.steps, ns.threads, ns.concurrent) == ("qwen3-sparse", None, None, 40, 2, 1)
