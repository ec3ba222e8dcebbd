import json
import os
import struct

import pytest
import torch

from moemesh.checkpoint import CheckpointError, CheckpointReader


@pytest.fixture(scope="module")
def sharded(tiny_ckpt, tmp_path_factory):
    """The tiny Mixtral saved again in shards of at most 100 KB."""
    _, model = tiny_ckpt("mixtral")
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, max_shard_size="100KB")
    return out, model


def test_single_file_reads_named_tensors(tiny_ckpt):
    path, model = tiny_ckpt("mixtral")
    r = CheckpointReader(path)
    assert r.has("model.embed_tokens.weight") and not r.has("nope")
    assert "model.norm.weight" in r.keys()
    torch.testing.assert_close(r.get("model.norm.weight"), model.model.norm.weight.data)
    assert r.get("model.norm.weight", shape=(64,), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_sharded_checkpoint(sharded):
    path, model = sharded
    assert (path / "model.safetensors.index.json").is_file()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    r = CheckpointReader(path)
    assert set(r.keys()) == set(index["weight_map"])
    torch.testing.assert_close(r.get("lm_head.weight"), model.lm_head.weight.data)


def test_missing_dir_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="config.json"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        CheckpointReader(tmp_path)


def test_missing_tensor_and_wrong_shape_are_named(tiny_ckpt):
    r = CheckpointReader(tiny_ckpt("mixtral")[0])
    with pytest.raises(CheckpointError, match="'model.layers.9.foo.weight' not found"):
        r.get("model.layers.9.foo.weight")
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[64\], expected \[65\]"):
        r.get("model.norm.weight", shape=(65,))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_header(tmp_path):
    """Refused naming the file; its descriptor closed once (a second close could close another file's)."""
    import gc

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        CheckpointReader(tmp_path)
    gc.collect()


def test_index_naming_missing_shard(sharded, tmp_path):
    src, _ = sharded
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))[0]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"names shard '{shard}', which is missing"):
        CheckpointReader(tmp_path)


def test_read_into_fills_place_and_casts(tiny_ckpt):
    path, model = tiny_ckpt("mixtral")
    r = CheckpointReader(path)
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    want = r.get(name)
    stacked = torch.zeros(2, *want.shape, dtype=want.dtype)
    r.read_into(name, stacked[1])  # a contiguous slice of a larger tensor, read in place
    assert torch.equal(stacked[1], want) and not stacked[0].any()
    as_bf16 = torch.empty(want.shape, dtype=torch.bfloat16)
    r.read_into(name, as_bf16)
    assert torch.equal(as_bf16, want.to(torch.bfloat16))
    with pytest.raises(CheckpointError, match="has shape"):
        r.read_into(name, torch.empty(want.shape[0] + 1, want.shape[1], dtype=want.dtype))


def test_reader_does_not_map_the_files(tiny_ckpt):
    """Tensors are fresh memory: the checkpoint's files are not mapped, so a weight the model copies
    into another layout is not held twice (as its copy and as mapped pages)."""
    path, _ = tiny_ckpt("mixtral")
    r = CheckpointReader(path)
    kept = [r.get(n) for n in r.keys()]
    maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
    assert str(path / "model.safetensors") not in maps
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept)


def test_header_offsets_outside_the_file_are_corrupt(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="corrupt header.*offsets"):
        CheckpointReader(tmp_path)


def test_an_fp8_tensor_is_not_cast_without_its_scale(tmp_path):
    """Cast to a float dtype, FP8 values would be read as weights without their scale (a wrong model,
    no error): refused naming the tensor; read as stored, they are returned unchanged."""
    from safetensors.torch import save_file

    w = (torch.randn(4, 8) * 100).to(torch.float8_e4m3fn)
    save_file({"model.layers.0.self_attn.q_proj.weight": w}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    r = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*float8_e4m3fn.*no scale"):
        r.get("model.layers.0.self_attn.q_proj.weight", dtype=torch.bfloat16)
    assert torch.equal(r.get("model.layers.0.self_attn.q_proj.weight").view(torch.uint8), w.view(torch.uint8))


def _checkpoint_of(tmp_path, tensors: dict) -> CheckpointReader:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return CheckpointReader(tmp_path)


@pytest.mark.parametrize("threads", [1, 3])
def test_read_all_into_splits_large_tensors_into_chunks_on_threads(tmp_path, monkeypatch, threads):
    """Every byte lands in place whatever the chunk size and thread count: a chunk of 1000 bytes splits
    a 4004-byte tensor into 5 reads with a short last one, and a cast read runs beside them."""
    import moemesh.checkpoint.reader as reader_module

    monkeypatch.setattr(reader_module, "READ_CHUNK_BYTES", 1000)
    tensors = {f"w{i}": torch.randn(7 + i, 143) for i in range(4)} | {"tiny": torch.randn(3), "empty": torch.empty(0, 5)}
    r = _checkpoint_of(tmp_path, tensors)
    outs = {name: torch.full(t.shape, float("nan")) for name, t in tensors.items()}
    outs["w1"] = torch.empty(tensors["w1"].shape, dtype=torch.bfloat16)  # cast: read as stored, then copied
    stacked = torch.zeros(2, *tensors["w2"].shape)
    r.read_all_into([*outs.items(), ("w2", stacked[1])], threads=threads)
    for name, t in tensors.items():
        assert torch.equal(outs[name], t.to(outs[name].dtype)), name
    assert torch.equal(stacked[1], tensors["w2"]) and not stacked[0].any()


def test_threaded_reads_fill_and_cast_into_inference_tensors(tmp_path, monkeypatch):
    """Models load under torch.inference_mode, which is per thread: the reading threads take the caller's."""
    import moemesh.checkpoint.reader as reader_module

    monkeypatch.setattr(reader_module, "READ_CHUNK_BYTES", 512)
    tensors = {"a": torch.randn(16, 32), "b": torch.randn(8, 8)}
    r = _checkpoint_of(tmp_path, tensors)
    with torch.inference_mode():
        a, b = torch.empty(16, 32), torch.empty(8, 8, dtype=torch.bfloat16)
        r.read_all_into([("a", a), ("b", b)], threads=2)
    assert a.is_inference() and torch.equal(a, tensors["a"]) and torch.equal(b, tensors["b"].to(torch.bfloat16))


def test_read_all_into_checks_every_pair_before_reading_any(tmp_path):
    tensors = {"a": torch.randn(64, 64), "b": torch.randn(8)}
    r = _checkpoint_of(tmp_path, tensors)
    a = torch.zeros(64, 64)
    with pytest.raises(CheckpointError, match=r"'b' has shape \[8\], expected \[9\]"):
        r.read_all_into([("a", a), ("b", torch.zeros(9))], threads=2)
    assert not a.any()
    with pytest.raises(CheckpointError, match="'c' not found"):
        r.read_all_into([("a", a), ("c", torch.zeros(1))], threads=2)


def test_a_truncated_file_fails_the_threaded_read_naming_the_tensor(tmp_path, monkeypatch):
    import moemesh.checkpoint.reader as reader_module

    monkeypatch.setattr(reader_module, "READ_CHUNK_BYTES", 4096)
    r = _checkpoint_of(tmp_path, {"a": torch.randn(64, 64), "z": torch.randn(256, 64)})
    r.get("a")  # the file is open, its header checked against its size
    path = tmp_path / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)  # then "z", stored last, loses its final bytes
    a, z = torch.empty(64, 64), torch.empty(256, 64)
    with pytest.raises(CheckpointError, match=r"cannot read tensor 'z'.*100 bytes early"):
        r.read_all_into([("a", a), ("z", z)], threads=2)


def test_get_stacked_reads_experts_in_place_and_names_a_mismatch(tmp_path):
    tensors = {f"e{i}": torch.randn(4, 6).to(torch.float8_e4m3fn) for i in range(3)} | {"odd": torch.randn(4, 7).to(torch.float8_e4m3fn)}
    r = _checkpoint_of(tmp_path, tensors)
    got = r.get_stacked(["e0", "e1", "e2"], shape=(4, 6))
    assert got.dtype == torch.float8_e4m3fn and got.shape == (3, 4, 6)
    assert torch.equal(got.view(torch.uint8), torch.stack([tensors[f"e{i}"] for i in range(3)]).view(torch.uint8))
    with pytest.raises(CheckpointError, match=r"'odd' has shape \[4, 7\], expected \[4, 6\]"):
        r.get_stacked(["e0", "odd"])
    with pytest.raises(CheckpointError, match=r"'e0' has shape \[4, 6\], expected \[4, 5\]"):
        r.get_stacked(["e0"], shape=(4, 5))
