"""`ModelConfig`: a typed, frozen view of a Hugging Face `config.json` (+ `generation_config.json`).

Each architecture parses its own raw dict into one (with the helpers here); reading a model
directory goes through the architecture registry: `moemesh.models.registry.load_model_config`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A model directory's config is missing, unreadable or names an unsupported architecture."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a model; `raw` keeps the full config.json."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # rope_parameters beyond the default type, kept for later arches
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # dtypes and tokens
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # image/video placeholder tokens of a multimodal checkpoint whose language model is served alone:
    # a prompt holding one stands for an image this server cannot take, and is refused
    media_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"config field num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads ({self.num_heads})"
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"config field num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}")
        if self.torch_dtype not in DTYPES:
            raise ConfigError(f"config field torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")

    def is_moe_layer(self, layer: int) -> bool:
        if not 0 <= layer < self.num_layers or self.num_experts <= 0 or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if self.is_moe_layer(l))

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]


def read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path.name} not found in {str(path.parent)!r}")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # unreadable, invalid JSON, invalid UTF-8
        raise ConfigError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a JSON object, got {type(data).__name__}")
    return data


def token_ids(value: Any) -> tuple[int, ...]:
    """An int, a list of ints or None -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 5 `rope_parameters` or the older keys."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling")
    if params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, (dict(scaling) if scaling else None)


def common_fields(raw: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """Fields shared by the Llama-family decoders (Mixtral, Qwen3-MoE and kin)."""
    theta, scaling = rope_fields(raw)
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    eos = token_ids(generation.get("eos_token_id")) or token_ids(raw.get("eos_token_id"))
    return dict(
        architecture=raw["architectures"][0],
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw.get("intermediate_size", 0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=raw.get("sliding_window") or None,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        raw=dict(raw),
    )
