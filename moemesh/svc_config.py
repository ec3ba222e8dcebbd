"""Command-line flags and environment overrides derived from a frozen dataclass config.

Each field `foo_bar` becomes `--foo-bar` and `MOEMESH_<SERVICE>_FOO_BAR`; the dataclass default is
the only default. Precedence: default < environment < command line. A field whose type is itself a
dataclass (e.g. `rpc: RpcConfig`, `engine: EngineConfig`) is flattened: its fields become flags of
the service, under their own names.
Field metadata may carry "help", "choices", "metavar" and "flag" (the flag's name when it is not
the field's, e.g. "--model" for `model_dir`), "env" (a service-independent environment variable
also read, below the service's own: `MOEMESH_MESH_TOKEN`, `MOEMESH_API_KEY`; commands read it too)
and "secret" (no flag: a secret on a command line is visible to every local user). The metadata of a nested dataclass field may carry
"omit" (its fields that get no flag: they keep their defaults), "defaults" (field -> the default
this use of it has instead of the nested class's) and "flags" (field -> flag name in this use).
Supported field types: str, int, float, bool, `X | None` of those (an empty string means None),
and `tuple[str|int|float, ...]` (comma-separated). A required field (no default) must be given.
Commands that are not services pass `service=None`: flags only, no environment.

    cfg = parse_config(ExpertServerConfig, "expert", argv)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
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


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (`PROG: error: MESSAGE (see PROG --help)`), exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


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
    flag: str = ""  # "--name" unless the metadata names another; "" for a secret (env only)
    metavar: str = ""
    global_env: str = ""  # an environment variable read whatever the service

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def field_specs(cls: type, omit: Sequence[str] = (), defaults: Mapping[str, Any] | None = None,
                flags: Mapping[str, str] | None = None) -> list[FieldSpec]:
    """Flattened fields of a dataclass config (nested dataclass fields inlined), without the `omit`
    ones; `defaults` and `flags` replace a field's default and flag name (a nested field's metadata
    passes its "omit", "defaults" and "flags" down)."""
    hints = typing.get_type_hints(cls)
    defaults, flags = defaults or {}, flags or {}
    unknown = (set(omit) | set(defaults) | set(flags)) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)} (named in omit, defaults or flags)")
    specs: list[FieldSpec] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            md = f.metadata
            for sub in field_specs(tp, md.get("omit", ()), md.get("defaults"), md.get("flags")):
                specs.append(dataclasses.replace(sub, path=(f.name, *sub.path)))
            continue
        if f.name in omit:
            continue
        kind, item, optional = classify(tp, f.name)
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        default = defaults.get(f.name, default)
        choices = f.metadata.get("choices")
        flag = "" if f.metadata.get("secret") else flags.get(f.name) or f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        specs.append(FieldSpec(
            (f.name,), f.name, kind, item, optional, default, f.metadata.get("help", ""), tuple(choices) if choices else None,
            flag, f.metadata.get("metavar") or ("|".join(map(str, choices)) if choices else (flag or f.name).lstrip("-").replace("-", "_").upper()),
            f.metadata.get("env", ""),
        ))
    for what, keys in (("fields", [s.name for s in specs]), ("flags", [s.flag for s in specs if s.flag])):
        dup = {n for n in keys if keys.count(n) > 1}
        if dup:
            raise TypeError(f"{cls.__name__}: flattened config {what} collide: {sorted(dup)}")
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


def _source(spec: FieldSpec, service: str | None) -> str:
    names = [spec.flag] if spec.flag else []
    names += [f"env {env_name(service, spec.name)}"] if service else []
    names += [f"env {spec.global_env}"] if spec.global_env else []
    return " or ".join(names)


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
        if spec.kind is float and not math.isfinite(value):  # every float setting is a size, time or factor
            raise ValueError("must be a finite number")
    except ValueError as e:
        raise ConfigValueError(f"config field {spec.name} ({source}): cannot read {text!r} as {type_label(spec)}: {e}") from e
    if spec.choices and value not in spec.choices:
        raise ConfigValueError(f"config field {spec.name} ({source}): {value!r} is not one of {list(spec.choices)}")
    return value


def type_label(spec: FieldSpec) -> str:
    if spec.kind is tuple:
        return f"comma-separated {spec.item.__name__}s"
    return spec.kind.__name__ + (" or empty" if spec.optional else "")


def add_arguments(parser: argparse.ArgumentParser, cls: type, service: str | None) -> None:
    """Add one flag per (flattened) field of `cls`; unset flags are absent from the namespace.
    The help names the default and, for a service, the environment variable."""
    for spec in field_specs(cls):
        if not spec.flag:
            continue  # a secret: environment only
        shown = "required" if spec.required else f"default {spec.default!r}"
        if spec.choices:
            shown = f"one of {', '.join(str(c) for c in spec.choices)}; {shown}"
        if service:
            shown += f"; env {env_name(service, spec.name)}"
        if spec.global_env:
            shown += f" or {spec.global_env}"
        help_text = f"{spec.help} ({shown})".strip()
        if spec.kind is bool:
            parser.add_argument(spec.flag, dest=spec.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(spec.flag, dest=spec.name, type=str, default=argparse.SUPPRESS, metavar=spec.metavar, help=help_text)


def from_sources(cls: type[T], service: str | None, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> T:
    """Build the config: defaults, then the fields' service-independent environment variables, then
    the service's `MOEMESH_<SERVICE>_*` ones (without a service, only the former), then the parsed
    `args`. `env` is os.environ when None."""
    env = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    values: dict[tuple[str, ...], Any] = {}
    for spec in field_specs(cls):
        value = spec.default
        if spec.global_env and spec.global_env in env:
            value = convert(spec, env[spec.global_env], f"env {spec.global_env}")
        var = env_name(service, spec.name) if service else ""
        if var and var in env:
            value = convert(spec, env[var], f"env {var}")
        if spec.name in given and spec.flag:
            raw = given[spec.name]
            value = raw if isinstance(raw, bool) else convert(spec, raw, spec.flag)
        if value is dataclasses.MISSING:
            raise ConfigValueError(f"config field {spec.name} is required ({_source(spec, service)})")
        values[spec.path] = value
    return build(cls, values, ())


def build(cls: type[T], values: dict[tuple[str, ...], Any], prefix: tuple[str, ...]) -> T:
    """`cls` from the flattened values; a field without a value (omitted) keeps its default."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return cls(**kwargs)


def parse_config(cls: type[T], service: str | None, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str | None = None) -> T:
    """Parse `argv` (sys.argv[1:] when None) into a `cls` instance; exits with usage on bad input."""
    parser = OneLineParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None)
    add_arguments(parser, cls, service)
    args = parser.parse_args(argv)
    try:
        return from_sources(cls, service, args, env)
    except ValueError as e:
        parser.error(str(e))
        raise  # parser.error exits; keeps type checkers content
