"""A progress bar for loading many tensors that only appears when loading takes over a second."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")


@contextmanager
def load_progress(total: int, desc: str, unit: str = "layer", delay_s: float = 1.0) -> Iterator[tqdm]:
    """Yields a tqdm counter on stderr; nothing is drawn unless the load outlives `delay_s`."""
    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=delay_s, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def load_layers(count: int, load: Callable[[int], T]) -> list[T]:
    """[load(0), ..., load(count - 1)]: a model's decoder layers, with the progress bar."""
    layers = []
    with load_progress(count, "loading layers") as bar:
        for layer in range(count):
            layers.append(load(layer))
            bar.update(1)
    return layers
