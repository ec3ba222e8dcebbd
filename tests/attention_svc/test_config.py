"""AttentionConfig's device: flag and MOEMESH_ATTENTION_DEVICE reach the engine config; bad values name the field."""
from __future__ import annotations

import pytest

from attention_svc.config import AttentionConfig
from moemesh.svc_config import from_sources, parse_config


def test_device_defaults_to_cpu_and_reaches_the_engine(tiny_model_dir):
    cfg = AttentionConfig(model_dir=str(tiny_model_dir))
    assert cfg.device == "cpu" and cfg.engine_config().device == "cpu"


@pytest.mark.parametrize("value", ["cuda:0", "cuda", "cpu"])
def test_device_from_the_environment(value):
    cfg = from_sources(AttentionConfig, "attention", None, {"MOEMESH_ATTENTION_MODEL_DIR": "/m", "MOEMESH_ATTENTION_DEVICE": value})
    assert cfg.device == value


def test_device_flag_beats_the_environment():
    cfg = parse_config(AttentionConfig, "attention", ["--model-dir", "/m", "--device", "cuda:1"], env={"MOEMESH_ATTENTION_DEVICE": "cpu"})
    assert cfg.device == "cuda:1"


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:one", "meta", ""])
def test_bad_device_names_the_field(value):
    with pytest.raises(ValueError, match="device"):
        AttentionConfig(model_dir="/m", device=value)
