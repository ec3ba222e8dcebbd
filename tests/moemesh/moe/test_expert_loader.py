import pytest
import torch
from safetensors import safe_open

from moemesh.checkpoint import CheckpointReader
from moemesh.models.registry import load_model_config
from moemesh.moe.expert_loader import load_expert_weights


@pytest.mark.parametrize(
    "arch,names",
    [("mixtral", ("block_sparse_moe", "w1", "w3", "w2")), ("qwen3_moe", ("mlp", "gate_proj", "up_proj", "down_proj"))],
)
def test_experts_stacked_in_requested_order(tiny_ckpt, arch, names):
    path, _ = tiny_ckpt(arch)
    cfg, reader = load_model_config(path), CheckpointReader(path)
    order = [5, 1, 6]
    w = load_expert_weights(reader, cfg, 1, order, torch.float32)
    inter = cfg.moe_intermediate_size
    assert tuple(w.gate_up.shape) == (3, 2 * inter, cfg.hidden_size)
    assert tuple(w.down.shape) == (3, cfg.hidden_size, inter)
    blk, g, u, d = names
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for i, e in enumerate(order):
            p = f"model.layers.1.{blk}.experts.{e}"
            torch.testing.assert_close(w.gate_up[i, :inter], f.get_tensor(f"{p}.{g}.weight"), rtol=0, atol=0)
            torch.testing.assert_close(w.gate_up[i, inter:], f.get_tensor(f"{p}.{u}.weight"), rtol=0, atol=0)
            torch.testing.assert_close(w.down[i], f.get_tensor(f"{p}.{d}.weight"), rtol=0, atol=0)


def test_dtype_and_experts_dtype(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    cfg, reader = load_model_config(path), CheckpointReader(path)
    w = load_expert_weights(reader, cfg, 0, [0, 1], torch.bfloat16)
    assert w.gate_up.dtype == torch.bfloat16
    plain = load_expert_weights(reader, cfg, 0, [0, 1], torch.float32)
    rounded = load_expert_weights(reader, cfg, 0, [0, 1], torch.float32, experts_dtype="bf16")
    torch.testing.assert_close(rounded.gate_up, plain.gate_up.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_bad_requests(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3_moe", mlp_only_layers=[0])
    cfg, reader = load_model_config(path), CheckpointReader(path)
    with pytest.raises(ValueError, match="expert_ids"):
        load_expert_weights(reader, cfg, 1, [8], torch.float32)
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer"):
        load_expert_weights(reader, cfg, 0, [0], torch.float32)
    with pytest.raises(ValueError, match="expert_ids"):
        load_expert_weights(reader, cfg, 1, [], torch.float32)


@pytest.mark.parametrize("ids", [[16], [-1], []])
def test_bad_expert_ids_of_a_gpt_oss_layer(tiny_ckpt, ids):
    """The ids are checked once, before the gpt-oss loader is chosen."""
    path, _ = tiny_ckpt("gpt_oss")
    cfg, reader = load_model_config(path), CheckpointReader(path)
    with pytest.raises(ValueError, match="expert_ids"):
        load_expert_weights(reader, cfg, 0, ids, torch.float32)
