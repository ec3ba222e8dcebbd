"""A tiny float32 Mixtral whose router sends most tokens to a few experts (a skewed workload).

Embedding channel `SKEW_CHANNEL` is a large constant for every token, so the normalised hidden
state has a positive component there in every layer; the gate rows of the hot experts get a large
weight on that channel, so their logits win for nearly every token.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures.checkpoints import build_model, save_checkpoint, tiny_config
from tests.fixtures.tokenizers import make_tiny_tokenizer

SKEW_CHANNEL = 0
HOT_EXPERTS = {0: 4.0, 2: 3.0}  # expert -> gate weight on the skew channel


def make_skewed_checkpoint(out: Path, seed: int = 3) -> Path:
    model = build_model(tiny_config("mixtral", num_hidden_layers=2), dtype=torch.float32, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, SKEW_CHANNEL] = 0.3
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight if hasattr(layer.mlp, "gate") else layer.block_sparse_moe.gate.weight
            for e, w in HOT_EXPERTS.items():
                gate[e, SKEW_CHANNEL] = w
    save_checkpoint(model, out)
    make_tiny_tokenizer(out)
    return out
