"""DeepSeek-V3.2 and GLM-5 config: DeepSeek-V3's MLA and grouped gate (deepseek_v3/config.py) plus the
DSA lightning indexer (`index_topk`, `index_head_dim`, `index_n_heads`) and, for GLM-5, which layers run
their own indexer and which reuse the previous one's selection (`indexer_types`).

The KV cache slot of a DSA layer holds the MLA latent (c_kv, k_pe) and the indexer key after it:
R + Dr + Di numbers per token, split across the engine's k and v planes as for DeepSeek-V3, so the
indexer keys are paged, allocated, shared and freed with the latents.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from moemesh.config import ConfigError, ModelConfig
from moemesh.models.deepseek_v3.config import MLAConfig, parse_config as parse_deepseek_v3
from moemesh.models.deepseek_v3.mla import latent_slot_width

INDEXER_TYPES = ("full", "shared")
DEEPSEEK_V32 = "DeepseekV32ForCausalLM"
GLM_MOE_DSA = "GlmMoeDsaForCausalLM"


def glm_indexer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """GLM-5's per-layer indexer mode, as transformers derives it: `indexer_types`, else the pattern
    string `index_topk_pattern` ("F" full, "S" shared), else every `index_topk_freq`-th layer from
    `index_skip_topk_offset` on runs its indexer (freq 1: all of them)."""
    if raw.get("indexer_types") is not None:
        return tuple(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if any(c not in "FS" for c in pattern):
                raise ConfigError(f"config field index_topk_pattern must be made of 'F' and 'S', got {pattern!r}")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


@dataclass(frozen=True)
class DSAConfig:
    """index_topk: keys kept per query; index_head_dim / index_n_heads: the indexer's heads;
    interleaved_rope: the indexer rotates interleaved pairs (GLM-5) or half-split ones (V3.2);
    indexer_types: per layer "full" (runs its indexer) or "shared" (reuses the last full layer's keys)."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    interleaved_rope: bool
    indexer_types: tuple[str, ...]

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "DSAConfig":
        return cls.from_raw(cfg.raw, cfg.architecture, cfg.num_layers)

    @classmethod
    def from_raw(cls, raw: dict[str, Any], architecture: str, num_layers: int) -> "DSAConfig":
        glm = architecture == GLM_MOE_DSA
        types = glm_indexer_types(raw, num_layers) if glm else ("full",) * num_layers
        cfg = cls(
            index_topk=int(raw.get("index_topk", 2048)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_n_heads=int(raw.get("index_n_heads", 32 if glm else 64)),
            interleaved_rope=glm,
            indexer_types=types,
        )
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"config field {name} must be >= 1, got {getattr(cfg, name)}")
        if len(types) != num_layers or any(t not in INDEXER_TYPES for t in types):
            raise ConfigError(f"config field indexer_types must list one of {INDEXER_TYPES} per layer, got {list(types)!r}")
        if types and types[0] != "full":
            raise ConfigError("config field indexer_types: the first layer must run its indexer ('full')")
        return cfg


def mla_config(raw: dict[str, Any]) -> MLAConfig:
    """DSA's MLA always rotates interleaved pairs (transformers ignores `rope_interleave` here)."""
    return replace(MLAConfig.from_raw(raw), rope_interleave=True)


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    cfg = parse_deepseek_v3(raw, generation)
    mla = mla_config(raw)
    dsa = DSAConfig.from_raw(raw, cfg.architecture, cfg.num_layers)
    if mla.q_lora_rank is None:
        raise ConfigError("config field q_lora_rank must be set for DSA models (the indexer reads the q LoRA latent)")
    if dsa.index_head_dim < mla.qk_rope_head_dim:
        raise ConfigError(
            f"config field index_head_dim ({dsa.index_head_dim}) must be >= qk_rope_head_dim ({mla.qk_rope_head_dim})"
        )
    width = latent_slot_width(mla.kv_lora_rank + mla.qk_rope_head_dim + dsa.index_head_dim)
    dense = cfg.mlp_only_layers
    types = raw.get("mlp_layer_types")
    if types is not None:
        if len(types) != cfg.num_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(f"config field mlp_layer_types must list 'dense' or 'sparse' per layer, got {types!r}")
        dense = tuple(i for i, t in enumerate(types) if t == "dense")
    return replace(cfg, head_dim=width, mlp_only_layers=dense)
