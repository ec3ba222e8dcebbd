"""`GgufLlama`: a llama-architecture GGUF file read as Hugging Face-layout float32 tensors.

llama.cpp's converter stores weights as `[out, in]` rows (like PyTorch) but permutes the rows of
`attn_q`/`attn_k` within each head so that rope pairs (i, i + d/2) become adjacent (2i, 2i + 1).
`unpermute_rope_rows` undoes that, giving Hugging Face's rotate-half layout back.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """w [n_heads * D, H] in llama.cpp's interleaved rope order -> Hugging Face's half-split order.

    llama.cpp wrote `w.reshape(n, 2, D/2, H).swapaxes(1, 2)`; this reshapes to (n, D/2, 2, H) and
    swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"rows ({rows}) must be a multiple of 2 * n_heads ({2 * n_heads})")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `unpermute_rope_rows` (llama.cpp's own permutation)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"rows ({rows}) must be a multiple of 2 * n_heads ({2 * n_heads})")
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


@dataclass(frozen=True)
class LlamaHyperParams:
    """The `llama.*` metadata of a GGUF file."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tied_embeddings: bool


class GgufLlama:
    """Metadata and dequantized tensors of a llama-architecture GGUF file (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self._gguf = gguf
        self._reader = gguf.GGUFReader(str(self.path))
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path}: general.architecture must be 'llama', got {arch!r}")
        self.hparams = self._hparams()

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        return default if f is None else f.contents()

    def _hparams(self) -> LlamaHyperParams:
        def req(key: str) -> Any:
            value = self.field(key)
            if value is None:
                raise ValueError(f"{self.path}: metadata {key} is missing")
            return value

        hidden = int(req("llama.embedding_length"))
        heads = int(req("llama.attention.head_count"))
        tokens = self.field("tokenizer.ggml.tokens") or []
        vocab = int(self.field("llama.vocab_size", len(tokens)))
        return LlamaHyperParams(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(req("llama.feed_forward_length")),
            num_layers=int(req("llama.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field("llama.attention.head_count_kv", heads)),
            head_dim=int(self.field("llama.rope.dimension_count", hidden // heads)),
            max_position_embeddings=int(req("llama.context_length")),
            # The file stores float32; print its shortest decimal (1e-05, not 9.99999974e-06).
            rms_norm_eps=float(str(np.float32(req("llama.attention.layer_norm_rms_epsilon")))),
            rope_theta=float(str(np.float32(self.field("llama.rope.freq_base", 10000.0)))),
            tied_embeddings="output.weight" not in self._tensors,
        )

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to float32, as stored (`[out, in]`, no rope un-permutation)."""
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        data = self._gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        return torch.from_numpy(np.array(data, dtype=np.float32, copy=True).reshape(shape))

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32 in Hugging Face layout (q/k rows un-permuted for rope)."""
        w = self.raw(name)
        if name.endswith(".attn_q.weight"):
            return unpermute_rope_rows(w, self.hparams.num_heads)
        if name.endswith(".attn_k.weight"):
            return unpermute_rope_rows(w, self.hparams.num_kv_heads)
        return w
