"""bench/llamacpp_gguf.py: the converter taken from a llama-cpp-python source package, the GGUF cache
keys; with llama-cpp-python installed (a bench extra), the whole bench on a tiny checkpoint."""
from __future__ import annotations

import importlib.util
import io
import tarfile

import pytest

from bench import llamacpp_gguf
from bench.llamacpp_gguf import checkpoint_digest, converter_dir, gguf_file


def fake_sdist(path, names):
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_converter_is_extracted_from_the_sdist_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEMESH_HOME", str(tmp_path / "home"))
    sdist = fake_sdist(tmp_path / "s.tar.gz", [
        "vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/__init__.py", "vendor/llama.cpp/gguf-py/gguf/__init__.py",
        "vendor/llama.cpp/src/llama.cpp", "llama_cpp/llama.py",
    ])
    out = converter_dir("9.9.9", sdist)
    assert out == tmp_path / "home" / "bench" / "llama.cpp-9.9.9"
    assert (out / "convert_hf_to_gguf.py").is_file() and (out / "conversion" / "__init__.py").is_file()
    assert (out / "gguf-py" / "gguf" / "__init__.py").is_file() and not (out / "src").exists()
    sdist.unlink()
    assert converter_dir("9.9.9", sdist) == out  # cached: the sdist is not read again


def test_an_sdist_without_the_converter_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEMESH_HOME", str(tmp_path / "home"))
    sdist = fake_sdist(tmp_path / "s.tar.gz", ["llama_cpp/llama.py"])
    with pytest.raises(FileNotFoundError, match="convert_hf_to_gguf.py"):
        converter_dir("9.9.9", sdist)
    assert not (tmp_path / "home" / "bench" / "llama.cpp-9.9.9").exists()


def test_checkpoint_digest_follows_the_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = checkpoint_digest(tmp_path)
    assert checkpoint_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert checkpoint_digest(tmp_path) != first


def test_unknown_gguf_kind_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        gguf_file(tmp_path, "q2_k", 1)


def test_missing_llama_cpp_is_reported(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(llamacpp_gguf.importlib.metadata, "version", missing)
    with pytest.raises(llamacpp_gguf.LlamaCppMissing, match=r"pip install -e \.\[bench\]"):
        llamacpp_gguf.installed_version()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (bench extra) not installed")
def test_engine_vs_llamacpp_end_to_end_on_a_tiny_checkpoint(tiny_shape_dir, tmp_path, monkeypatch, capsys):
    import shutil

    from bench import engine_vs_llamacpp
    from bench.shapes import bench_home

    converter = bench_home() / f"llama.cpp-{llamacpp_gguf.installed_version()}"
    monkeypatch.setenv("MOEMESH_HOME", str(tmp_path / "home"))
    if converter.is_dir():  # extracted by an earlier run: no second download of the source package
        shutil.copytree(converter, bench_home() / converter.name)
    path = tiny_shape_dir("qwen3-sparse-tiny")
    assert engine_vs_llamacpp.main(["--model", str(path), "--new-tokens", "3", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "bf16 " in out and "4-bit" in out and "nvfp4 " in out and "moemesh/llama.cpp" in out
    ggufs = sorted(p.name for p in (tmp_path / "home" / "bench" / "gguf").glob("*.gguf"))
    assert len(ggufs) == 2 and ggufs[0].endswith("-bf16.gguf")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (bench extra) not installed")
def test_a_failing_quantization_is_an_error_with_llama_cpp_s_words(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)q4_0 failed.*failed to"):
        llamacpp_gguf.quantize(tmp_path / "missing.gguf", tmp_path / "out.gguf", "q4_0", 1)
    assert not (tmp_path / "out.gguf").exists()
