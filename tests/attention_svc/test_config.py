"""AttentionConfig nests the engine's config: flags and MOEMESH_ATTENTION_* reach it under the names
users and manifests use; the replica's own defaults; bad values name the field."""
from __future__ import annotations

import pytest
import torch

from attention_svc.config import AttentionConfig
from moemesh.engine import EngineConfig
from moemesh.svc_config import field_specs, from_sources, parse_config
from tests.fixtures.auth import TEST_TOKEN

ENV = {"MOEMESH_ATTENTION_MODEL_DIR": "/m", "MOEMESH_MESH_TOKEN": TEST_TOKEN}


@pytest.fixture
def two_cuda_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_engine_fields_are_flags_under_their_names():
    flags = {s.flag for s in field_specs(AttentionConfig)}
    assert {"--model-dir", "--dtype", "--device", "--experts-dtype", "--dense-dtype", "--block-size", "--kv-cache-tokens", "--max-num-seqs",
            "--max-num-batched-tokens", "--max-model-len", "--micro-batches", "--num-threads", "--control-addr",
            "--transport", "--failover-timeout-s", "--metrics-port", "--shutdown-grace-s"} <= flags
    assert "--moe-top-k" not in flags and "--capacity-factor" not in flags  # the control plane's knobs


def test_defaults_reach_the_engine_and_a_replica_keeps_torchs_threads():
    cfg = from_sources(AttentionConfig, "attention", None, ENV)
    assert cfg.engine == EngineConfig("/m", num_threads=None)
    assert cfg.control_addr == "" and cfg.transport == "grpc"


def test_unset_values_are_empty_and_numbers_reach_the_engine():
    env = {**ENV, "MOEMESH_ATTENTION_EXPERTS_DTYPE": "", "MOEMESH_ATTENTION_MAX_MODEL_LEN": "", "MOEMESH_ATTENTION_NUM_THREADS": "2"}
    cfg = parse_config(AttentionConfig, "attention", ["--experts-dtype", "fp8", "--dense-dtype", "fp8", "--max-model-len", "512",
                                                      "--micro-batches", "2"], env)
    assert cfg.engine.experts_dtype == "fp8" and cfg.engine.dense_dtype == "fp8" and cfg.engine.max_model_len == 512
    assert cfg.engine.num_threads == 2 and cfg.engine.micro_batches == 2


@pytest.mark.parametrize("value", ["cuda:0", "cuda", "cpu"])
def test_device_from_the_environment(two_cuda_devices, value):
    cfg = from_sources(AttentionConfig, "attention", None, {**ENV, "MOEMESH_ATTENTION_DEVICE": value})
    assert cfg.engine.device == value


def test_device_flag_beats_the_environment(two_cuda_devices):
    cfg = parse_config(AttentionConfig, "attention", ["--model-dir", "/m", "--device", "cuda:1"], env={"MOEMESH_ATTENTION_DEVICE": "cpu", "MOEMESH_MESH_TOKEN": TEST_TOKEN})
    assert cfg.engine.device == "cuda:1"


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:one", "meta", ""])
def test_bad_device_names_the_field(value):
    with pytest.raises(ValueError, match="device"):
        from_sources(AttentionConfig, "attention", None, {**ENV, "MOEMESH_ATTENTION_DEVICE": value})


@pytest.mark.parametrize("env, field", [({}, "model_dir"), ({**ENV, "MOEMESH_ATTENTION_MICRO_BATCHES": "3"}, "micro_batches"),
                                        ({**ENV, "MOEMESH_ATTENTION_PORT": "70000"}, "port")])
def test_missing_or_bad_values_name_the_field(env, field):
    with pytest.raises(ValueError, match=field):
        from_sources(AttentionConfig, "attention", None, env)
