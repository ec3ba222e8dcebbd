from __future__ import annotations

import json

import pytest
import torch

from moemesh.demo_model import merge_experts, split_dense_mlp
from moemesh.demo_model.dense_to_moe import mixtral_config_from_llama, mixtral_state_dict_from_llama
from tests.fixtures.checkpoints import build_model, tiny_config


def test_split_shapes_and_merge_roundtrip():
    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g), torch.randn(16, 48, generator=g)
    w1s, w3s, w2s = split_dense_mlp(gate, up, down, 4)
    assert w1s.shape == (4, 12, 16) and w3s.shape == (4, 12, 16) and w2s.shape == (4, 16, 12)
    assert torch.equal(w1s[1], gate[12:24]) and torch.equal(w3s[3], up[36:48])
    assert torch.equal(w2s[2], down[:, 24:36] * 4)
    back = merge_experts(w1s, w3s, w2s)
    for a, b in zip(back, (gate, up, down)):
        assert torch.equal(a, b)


def test_experts_sum_to_dense_mlp():
    g = torch.Generator().manual_seed(1)
    gate, up, down = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g), torch.randn(8, 64, generator=g)
    x = torch.randn(5, 8, generator=g)  # [T, H]
    dense = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T  # [T, H]
    w1s, w3s, w2s = split_dense_mlp(gate, up, down, 8)
    moe = sum((torch.nn.functional.silu(x @ w1s[j].T) * (x @ w3s[j].T)) @ w2s[j].T / 8 for j in range(8))
    torch.testing.assert_close(moe, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shapes, experts, match",
    [
        (((8, 4), (8, 4), (4, 8)), 3, "must divide"),
        (((8, 4), (8, 5), (4, 8)), 2, "gate and up"),
        (((8, 4), (8, 4), (8, 4)), 2, "down must be"),
        (((8, 4), (8, 4), (4, 8)), 0, "num_experts"),
    ],
)
def test_split_rejects_bad_input(shapes, experts, match):
    gate, up, down = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        split_dense_mlp(gate, up, down, experts)


def test_mixtral_config_rejects_indivisible():
    with pytest.raises(ValueError, match="intermediate_size"):
        mixtral_config_from_llama({"intermediate_size": 100}, 8)


def test_moe_logits_equal_dense_llama(tmp_path):
    """The recipe on a tiny random LlamaForCausalLM: transformers' Mixtral (top-k 8) equals the dense model."""
    import transformers
    from safetensors.torch import save_file

    llama = build_model(tiny_config("llama"))
    config = mixtral_config_from_llama(llama.config.to_dict(), 8)
    state = mixtral_state_dict_from_llama(llama.state_dict(), 8)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in state
    assert not any(".mlp." in k for k in state)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    moe = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert moe.config.num_experts_per_tok == 8 and moe.config.intermediate_size == 16

    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = llama(ids).logits
        got = moe(ids).logits
    assert want.abs().max() > 1.0  # logits are not flat, so the comparison means something
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
