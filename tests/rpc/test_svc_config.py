from dataclasses import dataclass, field

import pytest

from moemesh.rpc.config import RpcConfig
from moemesh.svc_config import ConfigValueError, from_sources, parse_config


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
