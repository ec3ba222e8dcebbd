"""`ArchitectureSpec`: how one `config.architectures[0]` parses its config and builds its model.

Each architecture module defines one as `ARCHITECTURE`; `moemesh.models.registry` lists them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ArchitectureSpec:
    """name: the `architectures[0]` string; parse_config(raw, generation) -> ModelConfig;
    model_class: built as model_class(cfg, reader, dtype, dense_dtype=...) (dense_dtype: the format of
    its dense linears, `EngineConfig.dense_dtype`; a class that cannot hold them so raises ValueError)."""

    name: str
    parse_config: Callable[[dict[str, Any], dict[str, Any]], Any]
    model_class: type
