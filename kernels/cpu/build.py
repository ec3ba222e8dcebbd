"""Build and load the compiled CPU expert kernels (kernels/cpu/csrc) as a torch C++ extension.

The extension is compiled by torch's own JIT builder (`torch.utils.cpp_extension.load`, with ninja
from PyPI) against the torch that runs, into

    $MOEMESH_KERNEL_CACHE (default ~/.cache/moemesh/kernels)/<key>/moemesh_cpu_kernels.so

where <key> hashes this checkout's path, the torch and Python versions and the machine type (so ninja
rebuilds only what changed), and `source.stamp` beside the library records the sources and flags it
was built from. `scripts/setup.sh` builds it once (`python -m kernels.cpu`); a process that
finds a library whose stamp matches imports it without running any build step. Nothing goes through
pip's isolated build environments (which would pull a CUDA torch). Where the build fails (no C++
compiler, no ninja, not x86-64) a warning says why and the torch path runs instead; nothing raises.

`python -m kernels.cpu` builds it (if needed) and prints which kernel variant this machine runs.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("kernels.cpu")

NAME = "moemesh_cpu_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("moe_cpu.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "step_ops.cpp", "decode_layer.cpp", "quantize_cpu.cpp")
HEADERS = ("api.h", "ops.h", "kernel_impl.h", "attention_impl.h")
# -fopenmp: ATen's parallel_for (the kernels' thread split) is an OpenMP region only where _OPENMP is
# defined; without it every call runs on the calling thread alone. The library then needs
# libgomp.so.1, which resolves to the copy torch has already loaded (same soname): one thread pool,
# sized by torch.set_num_threads.
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CACHE_ENV = "MOEMESH_KERNEL_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moemesh" / "kernels")


def build_dir() -> Path:
    """One directory per checkout, torch, Python and machine, so that ninja rebuilds only what changed."""
    key = f"{CSRC}|{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}"
    return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]


def source_stamp() -> str:
    """Hash of everything the built library depends on: sources, headers and flags (the rest is in build_dir)."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()


def _library_path(build_dir: Path) -> Path:
    return build_dir / f"{NAME}.so"  # the name torch's builder gives it


def _import_built(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: make the one installed next to this Python (the `ninja`
    wheel) findable when the virtual environment is not activated."""
    if shutil.which("ninja"):
        return
    scripts = sysconfig.get_path("scripts")
    if scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _compile(build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    _ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernels, built on first use if the cache lacks them; None (with a warning) where they
    cannot be built or loaded. Loaded once per process."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("CPU expert kernel: torch path (the compiled kernels are x86-64 only)")
        return None
    where = build_dir()
    library, stamp_file, stamp = _library_path(where), where / "source.stamp", source_stamp()
    try:
        if library.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
            module = _import_built(library)
        else:
            module = _compile(where)
            stamp_file.write_text(stamp)
    except Exception as exc:  # a missing compiler or ninja, a failed build: the torch path runs instead
        msg = str(exc).strip().splitlines()
        warnings.warn(
            f"moemesh CPU expert kernels unavailable, using the torch path: {type(exc).__name__}: "
            f"{msg[-1] if msg else ''} (build directory {where})",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    found = module.variants()
    log.info("CPU expert kernel: %s (supported here: %s; library %s)", found[0] if found else "torch path", ", ".join(found) or "none", library)
    return module
