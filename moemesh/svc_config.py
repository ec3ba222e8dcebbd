"""Command-line flags and environment overrides derived from a service's frozen dataclass config.

Each field `foo_bar` becomes `--foo-bar` and `MOEMESH_<SERVICE>_FOO_BAR`; the dataclass default is
the only default. Precedence: default < environment < command line. A field whose type is itself a
dataclass (e.g. `rpc: RpcConfig`) is flattened: its fields become flags of the service.
Field metadata may carry "help" and "choices". Supported field types: str, int, float, bool,
`X | None` of those (an empty string means None), and `tuple[str|int|float, ...]` (comma-separated).

    cfg = parse_config(ExpertServerConfig, "expert", argv)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class ConfigValueError(ValueError):
    """A flag or environment value cannot be converted to its field's type."""


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    path: tuple[str, ...]  # (name,) or (nested_field, name)
    name: str
    kind: Any  # str | int | float | bool | tuple
    item: Any  # element type of tuples
    optional: bool
    default: Any
    help: str
    choices: tuple | None


def field_specs(cls: type) -> list[FieldSpec]:
    """Flattened fields of a dataclass config (nested dataclass fields inlined)."""
    hints = typing.get_type_hints(cls)
    specs: list[FieldSpec] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            for sub in field_specs(tp):
                specs.append(dataclasses.replace(sub, path=(f.name, *sub.path)))
            continue
        kind, item, optional = classify(tp, f.name)
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        choices = f.metadata.get("choices")
        specs.append(
            FieldSpec((f.name,), f.name, kind, item, optional, default, f.metadata.get("help", ""), tuple(choices) if choices else None)
        )
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise TypeError(f"{cls.__name__}: flattened config fields collide: {sorted(dup)}")
    return specs


def classify(tp: Any, name: str) -> tuple[Any, Any, bool]:
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"config field {name}: unsupported union type {tp}")
        tp, optional = args[0], True
    if typing.get_origin(tp) is tuple:
        return tuple, typing.get_args(tp)[0], optional
    if tp in (str, int, float, bool):
        return tp, None, optional
    raise TypeError(f"config field {name}: unsupported type {tp}")


def env_name(service: str, field_name: str) -> str:
    return f"MOEMESH_{service.upper()}_{field_name.upper()}"


def convert(spec: FieldSpec, text: str, source: str) -> Any:
    """`text` from a flag or env var -> the field's value; errors name the field and the source."""
    try:
        if spec.optional and text == "":
            return None
        if spec.kind is bool:
            low = text.strip().lower()
            if low in TRUE:
                return True
            if low in FALSE:
                return False
            raise ValueError(f"expected one of {TRUE + FALSE}")
        if spec.kind is tuple:
            return tuple(spec.item(p.strip()) for p in text.split(",") if p.strip())
        value = spec.kind(text)
    except ValueError as e:
        raise ConfigValueError(f"config field {spec.name} ({source}): cannot read {text!r} as {type_label(spec)}: {e}") from e
    if spec.choices and value not in spec.choices:
        raise ConfigValueError(f"config field {spec.name} ({source}): {value!r} is not one of {list(spec.choices)}")
    return value


def type_label(spec: FieldSpec) -> str:
    if spec.kind is tuple:
        return f"comma-separated {spec.item.__name__}s"
    return spec.kind.__name__ + (" or empty" if spec.optional else "")


def add_arguments(parser: argparse.ArgumentParser, cls: type, service: str) -> None:
    """Add one flag per (flattened) field of `cls`; unset flags are absent from the namespace."""
    for spec in field_specs(cls):
        flag = "--" + spec.name.replace("_", "-")
        shown = "required" if spec.default is dataclasses.MISSING else f"default {spec.default!r}"
        if spec.choices:
            shown = f"one of {', '.join(str(c) for c in spec.choices)}; {shown}"
        help_text = f"{spec.help} ({shown}; env {env_name(service, spec.name)})".strip()
        if spec.kind is bool:
            parser.add_argument(flag, dest=spec.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=spec.name, type=str, default=argparse.SUPPRESS, metavar=spec.name.upper(), help=help_text)


def from_sources(cls: type[T], service: str, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> T:
    """Build the config: defaults, then `env` (os.environ when None), then the parsed `args`."""
    env = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    values: dict[tuple[str, ...], Any] = {}
    for spec in field_specs(cls):
        value = spec.default
        var = env_name(service, spec.name)
        if var in env:
            value = convert(spec, env[var], f"env {var}")
        if spec.name in given:
            raw = given[spec.name]
            value = raw if isinstance(raw, bool) else convert(spec, raw, "--" + spec.name.replace("_", "-"))
        if value is dataclasses.MISSING:
            raise ConfigValueError(f"config field {spec.name} is required (--{spec.name.replace('_', '-')} or env {var})")
        values[spec.path] = value
    return build(cls, values, ())


def build(cls: type[T], values: dict[tuple[str, ...], Any], prefix: tuple[str, ...]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        kwargs[f.name] = build(hints[f.name], values, path) if dataclasses.is_dataclass(hints[f.name]) else values[path]
    return cls(**kwargs)


def parse_config(cls: type[T], service: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str | None = None) -> T:
    """Parse `argv` (sys.argv[1:] when None) into a `cls` instance; exits with usage on bad input."""
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None)
    add_arguments(parser, cls, service)
    args = parser.parse_args(argv)
    try:
        return from_sources(cls, service, args, env)
    except ValueError as e:
        parser.error(str(e))
        raise  # parser.error exits; keeps type checkers content
