"""Argument types the benchmarks share."""
from __future__ import annotations

import argparse


def _ints(value: str, allow_empty: bool) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if (not items and not allow_empty) or min(items, default=1) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {value!r}")
    return items


def positive_ints(value: str) -> tuple[int, ...]:
    """'1,16' -> (1, 16): one or more integers >= 1."""
    return _ints(value, allow_empty=False)


def positive_ints_or_none(value: str) -> tuple[int, ...]:
    """As positive_ints, and '' -> () (none)."""
    return _ints(value, allow_empty=True)
