"""The architecture registry: `config.architectures[0]` -> how to parse its config and build its model.

A plain table, built once at import: an architecture plugs in by defining `ARCHITECTURE` (an
`ArchitectureSpec`, or a tuple of them for a family serving several names) in its module under
`moemesh/models/` and being listed here. Reading a model
directory's config goes through here (`load_model_config`), so `moemesh.config` (the `ModelConfig`
every parser builds) never imports the parsers back.
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from moemesh.config import ConfigError, ModelConfig, read_json
from moemesh.models import (
    deepseek_v3, deepseek_v32, glm4_moe, gpt_oss, kimi_k25, minimax_m2, mixtral, qwen3_moe, qwen3_next,
)
from moemesh.models.architecture import ArchitectureSpec

_MODULES = (mixtral, qwen3_moe, deepseek_v3, gpt_oss, glm4_moe, deepseek_v32, minimax_m2, kimi_k25, qwen3_next)
ARCHITECTURES: Mapping[str, ArchitectureSpec] = MappingProxyType(
    {
        spec.name: spec
        for m in _MODULES
        for spec in (m.ARCHITECTURE if isinstance(m.ARCHITECTURE, tuple) else (m.ARCHITECTURE,))
    }
)
# quantization_config.quant_method values whose stored weights the loaders read: DeepSeek-style
# BlockwiseFP8, ModelOpt NVFP4 experts, gpt-oss MXFP4 experts
READ_QUANT_METHODS = ("fp8", "modelopt", "mxfp4")


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def get_architecture(name: str) -> ArchitectureSpec:
    if name not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}")
    return ARCHITECTURES[name]


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """The `ModelConfig` of a parsed `config.json` (+ `generation_config.json`); ConfigError names
    what is missing or malformed."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"config.json: 'architectures' must be a list naming the architecture, got {archs!r}")
    spec = get_architecture(archs[0])
    check_quant_method(raw, archs[0])
    try:
        return spec.parse_config(raw, generation or {})
    except KeyError as e:
        raise ConfigError(f"config.json for {archs[0]} lacks the field {e.args[0]!r}") from e
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as e:
        # a field of the wrong type or value (a list where a number goes, 0 heads, ...)
        raise ConfigError(f"config.json for {archs[0]} has a malformed field: {type(e).__name__}: {e}") from e


def check_quant_method(raw: dict[str, Any], arch: str) -> None:
    """A checkpoint quantized in a format no loader reads (GPTQ, AWQ, compressed-tensors INT4, ...) is
    refused here, before any weight is read as if it were plain."""
    text = raw.get("text_config")
    for where, cfg in (("", raw), ("text_config.", text if isinstance(text, dict) else {})):
        quant = cfg.get("quantization_config")
        if quant is None:
            continue
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method not in READ_QUANT_METHODS:
            raise ConfigError(
                f"config field {where}quantization_config.quant_method {method!r} is not supported for {arch} "
                f"(stored weight formats read here: {', '.join(READ_QUANT_METHODS)}; a bfloat16 conversion loads)"
            )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face model directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    raw = read_json(model_dir / "config.json", required=True)
    gen = read_json(model_dir / "generation_config.json", required=False)
    return parse_model_config(raw, gen)
