"""The engine's device setting: validation, and shape-only checks on the `meta` device that every weight,
table, KV cache plane and per-step tensor is allocated on the configured device (CUDA itself needs a
GPU; the CPU path is covered by every other engine test)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moemesh.checkpoint import CheckpointReader
from moemesh.engine import EngineConfig
from moemesh.engine.device import DeviceReader, check_device, on_device
from moemesh.engine.kv_cache import KVCache
from moemesh.engine.llm_engine import build_model
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.registry import load_model_config

META = torch.device("meta")


def tensors_in(obj, seen=None):
    """Every tensor reachable from `obj` through attributes, dataclass fields, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, torch.dtype, torch.device)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from tensors_in(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, seen)
    elif hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj):
        for item in vars(obj).values() if hasattr(obj, "__dict__") else ():
            yield from tensors_in(item, seen)
        for name in getattr(type(obj), "__slots__", ()):
            yield from tensors_in(getattr(obj, name, None), seen)


@pytest.mark.parametrize("spec", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_accepts_cpu_and_cuda_forms(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    check_device(spec)


@pytest.mark.parametrize("spec", ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "meta", "cpu:0"])
def test_device_rejects_other_strings_naming_the_field(tiny_ckpt, spec):
    path, _ = tiny_ckpt("mixtral")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(str(path), device=spec)


def test_cuda_without_cuda_is_a_value_error_naming_device(tiny_ckpt, monkeypatch):
    path, _ = tiny_ckpt("mixtral")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=r"device 'cuda.*CUDA is not available"):
            EngineConfig(str(path), device=spec)


def test_cuda_index_beyond_the_machine_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device 'cuda:2'.*2 CUDA device"):
        check_device("cuda:2")


def test_default_device_is_cpu(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    assert EngineConfig(str(path)).device == "cpu"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_every_weight_and_table_is_built_on_the_device(tiny_ckpt, arch):
    path, _ = tiny_ckpt(arch)
    cfg = load_model_config(str(path))
    model, experts = build_model(cfg, CheckpointReader(str(path)), torch.float32, META)
    found = list(tensors_in(model)) + list(tensors_in(experts))
    assert len(found) > 10
    assert {t.device.type for t in found} == {"meta"}


def test_cpu_build_keeps_every_tensor_on_the_cpu(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    cfg = load_model_config(str(path))
    model, experts = build_model(cfg, CheckpointReader(str(path)), torch.float32, torch.device("cpu"))
    assert {t.device.type for t in [*tensors_in(model), *tensors_in(experts)]} == {"cpu"}


def test_kv_cache_planes_live_on_the_device():
    kv = KVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device=META)
    assert len(kv.layers) == 3
    for k, v in kv.layers:
        assert k.device == META and v.device == META
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == torch.bfloat16


def test_step_metadata_is_allocated_on_the_device():
    slices = [SeqSlice([7], 5, [0, 1]), SeqSlice([1, 2, 3], 0, [2])]
    with on_device(META):
        meta = BatchMeta.build(slices, 4, None)
    found = list(tensors_in(meta))
    assert found and {t.device.type for t in found} == {"meta"}


def test_device_reader_moves_what_it_reads(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    reader = DeviceReader(CheckpointReader(str(path)), META)
    t = reader.get("model.embed_tokens.weight", dtype=torch.bfloat16)
    assert t.device == META and t.dtype == torch.bfloat16
    assert reader.has("model.norm.weight") and "model.norm.weight" in reader.keys()


def test_on_device_is_a_no_op_on_the_cpu():
    with on_device(torch.device("cpu")):
        assert torch.empty(1).device.type == "cpu"
    with on_device(META):
        assert torch.arange(3).device == META and torch.tensor([1]).device == META
