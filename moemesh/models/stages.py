"""Driving a model's `forward_stages` generator (it yields after each MoE submit, returns logits)."""
from __future__ import annotations

from typing import Generator, TypeVar

R = TypeVar("R")


def run_to_end(stages: Generator[None, None, R]) -> R:
    """Runs one micro-batch's stages back to back and returns the generator's value (the logits)."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value
