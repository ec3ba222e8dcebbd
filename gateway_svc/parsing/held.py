"""`partial_marker(text, marker)`: how much of `text`'s end could be the start of `marker`.

A streamed marker may arrive cut anywhere (`<too` + `l_call>`): the splitters hold back that many
characters until the next delta decides whether they begin the marker or are plain text.
"""
from __future__ import annotations


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
