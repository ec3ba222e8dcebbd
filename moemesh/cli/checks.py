"""Checks of command-line values the config dataclasses do not hold (addresses, timeouts, counts):
each raises ValueError naming the flag, which `moemesh.cli.main` prints as one line (exit status 2)."""
from __future__ import annotations

import math


def check_address(flag: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag}: must be HOST:PORT, got {address!r}")


def check_timeout(flag: str, seconds: float | None) -> None:
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{flag}: must be a number of seconds > 0, got {seconds}")


def check_at_least(flag: str, value: int | float, low: int | float) -> None:
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{flag}: must be >= {low}, got {value}")


def check_model_dir(flag: str, path: str) -> None:
    """A model directory whose config.json can be read (the services would fail on it one by one)."""
    from moemesh.models.registry import load_model_config

    try:
        load_model_config(path)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
