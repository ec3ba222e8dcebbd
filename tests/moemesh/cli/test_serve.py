"""`moemesh serve SERVICE`: one entry point per service, flags derived from each config."""
from __future__ import annotations

import pytest

from moemesh.cli.main import build_parser, main
from tests.fixtures.auth import TEST_TOKEN


@pytest.mark.parametrize("service, flag", [("router", "--attention"), ("attention", "--control-addr"),
                                           ("expert", "--control-addr"), ("control", "--expected-expert-servers"),
                                           ("gateway", "--router"), ("gateway", "--api-key"), ("gateway", "--served-model-name"),
                                           ("gateway", "--control")])
def test_each_service_has_its_config_flags(service, flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", service, "--help"])
    out = capsys.readouterr().out
    assert flag in out and "--max-message-mb" in out


def test_bad_config_is_an_error_naming_the_field(capsys, monkeypatch):
    monkeypatch.setenv("MOEMESH_MESH_TOKEN", TEST_TOKEN)  # the token is fine: the port is what is wrong
    assert main(["serve", "router", "--port", "99999"]) == 2
    assert "--port (or env MOEMESH_ROUTER_PORT) must be in [0, 65535]" in capsys.readouterr().err


def test_missing_model_dir_is_an_error(capsys):
    assert main(["serve", "attention"]) == 2
    assert "model_dir is required" in capsys.readouterr().err


def test_env_overrides_apply(monkeypatch, capsys):
    monkeypatch.setenv("MOEMESH_MESH_TOKEN", TEST_TOKEN)
    monkeypatch.setenv("MOEMESH_ROUTER_MAX_RUNNING", "0")
    assert main(["serve", "router"]) == 2
    assert "--max-running (or env MOEMESH_ROUTER_MAX_RUNNING) must be >= 1" in capsys.readouterr().err


def test_gateway_needs_the_router(capsys):
    assert main(["serve", "gateway"]) == 2
    assert "router is required" in capsys.readouterr().err
