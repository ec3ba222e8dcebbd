"""The architecture registry: `config.architectures[0]` -> how to parse its config and build its model.

An architecture plugs in by adding a module under `moemesh/models/` that defines a module-level
`ARCHITECTURE` (an `ArchitectureSpec`, or a tuple of them). Modules are discovered on each lookup,
so there is no mutable registry to keep in sync.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ArchitectureSpec:
    """name: the `architectures[0]` string; parse_config(raw, generation) -> ModelConfig;
    model_class: built as model_class(cfg, reader, dtype)."""

    name: str
    parse_config: Callable[[dict[str, Any], dict[str, Any]], Any]
    model_class: type


def discover() -> dict[str, ArchitectureSpec]:
    import moemesh.models as pkg

    found: dict[str, ArchitectureSpec] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        specs = getattr(module, "ARCHITECTURE", ())
        for spec in specs if isinstance(specs, tuple) else (specs,):
            found[spec.name] = spec
    return found


def supported_architectures() -> list[str]:
    return sorted(discover())


def get_architecture(name: str) -> ArchitectureSpec:
    from moemesh.config import ConfigError

    specs = discover()
    if name not in specs:
        raise ConfigError(f"unsupported architecture {name!r}; supported: {', '.join(sorted(specs))}")
    return specs[name]
