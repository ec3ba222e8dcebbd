"""`check_token_ids`: token ids validated in one vectorized pass (no Python loop over the ids), with
an error that names the first bad position."""
from __future__ import annotations

from typing import Iterable

import numpy as np


def check_token_ids(ids: Iterable[int], vocab_size: int, field: str) -> list[int]:
    """`ids` as a list of ints, each in [0, vocab_size); else ValueError
    `"{field}[i]: {id} is not a token id (vocabulary size {vocab_size})"` for the first bad one."""
    try:
        arr = np.asarray(ids if isinstance(ids, (list, tuple, np.ndarray)) else list(ids), dtype=np.int64)
    except OverflowError:
        big = next(i for i, t in enumerate(ids) if not -(2**63) <= int(t) < 2**63)
        raise ValueError(f"{field}[{big}]: {list(ids)[big]} is not a token id (vocabulary size {vocab_size})") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field}: must be integers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{field}: must be a flat sequence of token ids")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{field}[{i}]: {int(arr[i])} is not a token id (vocabulary size {vocab_size})")
    return arr.tolist()
