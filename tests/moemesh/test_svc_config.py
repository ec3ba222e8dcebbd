import argparse
from dataclasses import dataclass, field

import pytest

from moemesh.rpc.config import RpcConfig
from moemesh.svc_config import ConfigValueError, field_specs, from_sources, parse_config


@dataclass(frozen=True)
class DemoConfig:
    model_dir: str
    port: int = field(default=0, metadata={"help": "port"})
    device: str = field(default="cpu", metadata={"choices": ("cpu", "cuda:0")})
    ratio: float = 0.5
    verbose: bool = False
    control_addr: str | None = None
    layers: tuple[int, ...] = (1, 2)
    rpc: RpcConfig = RpcConfig()

    def __post_init__(self):
        if self.port < 0:
            raise ValueError(f"port must be >= 0, got {self.port}")


def test_defaults_then_env_then_flags():
    env = {"MOEMESH_DEMO_PORT": "7", "MOEMESH_DEMO_RATIO": "0.25", "MOEMESH_DEMO_MAX_MESSAGE_MB": "64"}
    cfg = parse_config(DemoConfig, "demo", ["--model-dir", "/m", "--port", "9", "--verbose", "--layers", "3,4"], env)
    assert cfg.model_dir == "/m" and cfg.port == 9 and cfg.ratio == 0.25 and cfg.verbose is True
    assert cfg.layers == (3, 4) and cfg.control_addr is None
    assert cfg.rpc == RpcConfig(max_message_mb=64)


def test_env_only_and_optional_empty():
    env = {"MOEMESH_DEMO_MODEL_DIR": "/x", "MOEMESH_DEMO_CONTROL_ADDR": "", "MOEMESH_DEMO_VERBOSE": "yes"}
    cfg = from_sources(DemoConfig, "demo", None, env)
    assert cfg.model_dir == "/x" and cfg.control_addr is None and cfg.verbose is True


@pytest.mark.parametrize(
    "env, field_name",
    [
        ({"MOEMESH_DEMO_PORT": "seven"}, "port"),
        ({"MOEMESH_DEMO_VERBOSE": "maybe"}, "verbose"),
        ({"MOEMESH_DEMO_DEVICE": "tpu"}, "device"),
        ({"MOEMESH_DEMO_PORT": "-1"}, "port"),
        ({"MOEMESH_DEMO_MAX_MESSAGE_MB": "0"}, "max_message_mb"),
    ],
)
def test_bad_values_name_the_field(env, field_name):
    with pytest.raises(ValueError, match=field_name):
        from_sources(DemoConfig, "demo", None, {"MOEMESH_DEMO_MODEL_DIR": "/m", **env})


def test_missing_required_field_is_named():
    with pytest.raises(ConfigValueError, match="model_dir"):
        from_sources(DemoConfig, "demo", None, {})


def test_bad_flag_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, "demo", ["--model-dir", "/m", "--ratio", "x"], {})
    assert "ratio" in capsys.readouterr().err


def test_help_lists_env_names(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, "demo", ["--help"], {})
    out = capsys.readouterr().out
    assert "MOEMESH_DEMO_MAX_MESSAGE_MB" in out and "--keepalive-time-s" in out


@dataclass(frozen=True)
class Inner:
    model_dir: str = field(metadata={"metavar": "DIR"})
    threads: int | None = 1
    knob: int = 3


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(metadata={"omit": ("knob",), "defaults": {"threads": None}, "flags": {"model_dir": "--model"}})
    json: bool = False
    name: str = field(default="x", metadata={"flag": "--title"})


def test_nested_config_omit_defaults_and_flag_names():
    specs = {s.name: s for s in field_specs(Outer)}
    assert set(specs) == {"model_dir", "threads", "json", "name"}
    assert specs["model_dir"].flag == "--model" and specs["model_dir"].metavar == "DIR" and specs["model_dir"].required
    assert specs["name"].flag == "--title" and specs["threads"].default is None
    cfg = parse_config(Outer, None, ["--model", "/m", "--title", "t", "--json"])
    assert cfg == Outer(Inner("/m", None, 3), True, "t")  # the omitted field keeps its default


def test_without_a_service_there_is_no_environment():
    cfg = from_sources(Outer, None, argparse.Namespace(model_dir="/m"), {"MOEMESH_NONE_THREADS": "4"})
    assert cfg.inner.threads is None
    with pytest.raises(ConfigValueError, match=r"model_dir is required \(--model\)"):
        from_sources(Outer, None, None)


def test_names_in_nested_metadata_must_exist():
    @dataclass(frozen=True)
    class Bad:
        inner: Inner = field(metadata={"omit": ("nope",)})

    with pytest.raises(TypeError, match="nope"):
        field_specs(Bad)
