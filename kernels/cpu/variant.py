"""Which compiled CPU kernel variant runs: the best the CPU supports, or the one named by
MOEMESH_CPU_KERNEL (avx512 | avx2 | torch; unset or "auto": the best)."""
from __future__ import annotations

import functools
import os

from kernels.cpu.build import extension

VARIANT_ENV = "MOEMESH_CPU_KERNEL"
VARIANTS = ("avx512", "avx2")
CHOICES = ("auto", "torch") + VARIANTS


def available_variants() -> list[str]:
    """Variants this CPU and build run, best first (empty where the extension is absent)."""
    return list(_variants())


@functools.cache
def _variants() -> tuple[str, ...]:
    """available_variants, asked of the extension once per process (the CPU and build do not change)."""
    ext = extension()
    return tuple(ext.variants()) if ext is not None else ()


def selected_variant(requested: str | None = None) -> str | None:
    """requested (default: $MOEMESH_CPU_KERNEL, else "auto") -> the variant to run, or None for the
    torch path. A named variant this machine cannot run is a ValueError."""
    name = requested if requested is not None else (os.environ.get(VARIANT_ENV) or "auto")
    if name not in CHOICES:
        raise ValueError(f"{VARIANT_ENV}: expected one of {CHOICES}, got {name!r}")
    if name == "torch":
        return None
    found = _variants()
    if name == "auto":
        return found[0] if found else None
    if name not in found:
        raise ValueError(f"{VARIANT_ENV}: variant {name!r} is not available here (available: {list(found) or 'none'})")
    return name
