"""llama.cpp's side of the benchmarks: its own converter and quantizer, and the GGUF files they make.

Converter: `convert_hf_to_gguf.py` (with its `conversion/` package and `gguf-py`) vendored in the
llama-cpp-python source package of the installed version, fetched with
`pip download --no-binary :all: --no-deps llama-cpp-python==<version>` (or a local sdist given as
`sdist`) and extracted once into `<bench home>/llama.cpp-<version>/`. It runs in a subprocess with
that `gguf-py` first on its path (the `gguf` on PyPI may lag the converter) and writes a bf16 GGUF.
Quantizer: `llama_cpp.llama_model_quantize` (the library's `llama-quantize`) from the bf16 GGUF:
  mxfp4  LLAMA_FTYPE_MOSTLY_MXFP4_MOE: expert tensors MXFP4, every other matrix Q8_0
  q4_0   LLAMA_FTYPE_MOSTLY_Q4_0: every matrix Q4_0 (the LM head as llama.cpp picks, Q6_K)
GGUF files are cached in `<bench home>/gguf/` under a digest of the checkpoint (config.json and its
safetensors files' names, sizes and modification times) and the llama.cpp version, so a rebuilt
checkpoint or another llama-cpp-python gets new files.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

from bench.shapes import bench_home

DIST = "llama-cpp-python"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
QUANT_TYPES = {"mxfp4": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
QUANT_DESCRIPTIONS = {
    "bf16": "bf16 (norms f32), from convert_hf_to_gguf.py --outtype bf16",
    "mxfp4": "MXFP4_MOE: experts MXFP4, other matrices Q8_0",
    "q4_0": "Q4_0: every matrix Q4_0",
}


class LlamaCppMissing(RuntimeError):
    """llama-cpp-python is not installed (a bench extra: `pip install -e .[bench]`)."""


def installed_version() -> str:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise LlamaCppMissing(
            f"{DIST} is not installed: `pip install -e .[bench]` builds it from source (cmake, a C++ compiler; "
            "CMAKE_ARGS=-DLLAVA_BUILD=OFF skips the multimodal library)"
        ) from None


def fetch_sdist(version: str, dest: Path) -> Path:
    """The llama-cpp-python source package of `version`, downloaded by pip into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet", f"{DIST}=={version}", "-d", str(dest)]
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download left no llama_cpp_python sdist in {dest}")
    return found[0]


def converter_dir(version: str, sdist: Path | None = None, progress: Callable[[str], None] = lambda m: None) -> Path:
    """`<bench home>/llama.cpp-<version>/` holding the converter parts, extracted first if absent."""
    out = bench_home() / f"llama.cpp-{version}"
    if all((out / p).exists() for p in CONVERTER_PARTS):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        tmp = Path(tmp)
        if sdist is None:
            progress(f"downloading the {DIST} {version} source package")
            sdist = fetch_sdist(version, tmp)
        progress(f"extracting llama.cpp's converter from {sdist.name}")
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts  # llama_cpp_python-X/vendor/llama.cpp/<part>/...
                if len(parts) > 3 and parts[1:3] == ("vendor", "llama.cpp") and parts[3] in CONVERTER_PARTS:
                    members.append(m)
            if not members:
                raise FileNotFoundError(f"{sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py")
            tar.extractall(tmp / "x", members=members, filter="data")
        root = next((tmp / "x").iterdir()) / "vendor" / "llama.cpp"
        staged = tmp / "staged"
        staged.mkdir()
        for part in CONVERTER_PARTS:
            shutil.move(str(root / part), staged / part)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def checkpoint_digest(model_dir: Path) -> str:
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def convert(model_dir: Path, out: Path, converter: Path, threads: int) -> None:
    """llama.cpp's converter: HF checkpoint -> bf16 GGUF at `out`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(converter / "gguf-py"), str(converter)]),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "bf16", "--outfile", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")


QUANTIZE = """
import sys
import llama_cpp

src, out, ftype, threads = sys.argv[1:]
params = llama_cpp.llama_model_quantize_default_params()
params.nthread = int(threads)
params.ftype = getattr(llama_cpp, ftype)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), out.encode(), params))
"""


def quantize(src: Path, out: Path, kind: str, threads: int) -> None:
    """`llama_model_quantize` of the bf16 GGUF `src` into `out` as `kind` (see QUANT_TYPES), in a
    subprocess: its per-tensor log stays out of the bench's output, and a quantizer that aborts on a
    type it cannot make is an error here, not the end of the bench."""
    cmd = [sys.executable, "-c", QUANTIZE, str(src), str(out), QUANT_TYPES[kind], str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama_model_quantize to {kind} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")


def gguf_file(model_dir: Path, kind: str, threads: int, sdist: Path | None = None,
              progress: Callable[[str], None] = lambda m: None) -> Path:
    """The cached GGUF of `model_dir` as `kind` ('bf16' or a QUANT_TYPES key), made first if absent."""
    if kind != "bf16" and kind not in QUANT_TYPES:
        raise ValueError(f"kind must be bf16 or one of {', '.join(QUANT_TYPES)}, got {kind!r}")
    version = installed_version()
    model_dir = Path(model_dir).absolute()
    out = bench_home() / "gguf" / f"{model_dir.name}-{checkpoint_digest(model_dir)}-llama.cpp-{version}-{kind}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if kind == "bf16":
            converter = converter_dir(version, sdist, progress)
            progress(f"converting {model_dir} with llama.cpp {version}'s convert_hf_to_gguf.py")
            convert(model_dir, tmp, converter, threads)
        else:
            src = gguf_file(model_dir, "bf16", threads, sdist, progress)
            progress(f"quantizing {src.name} to {kind}")
            quantize(src, tmp, kind, threads)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
