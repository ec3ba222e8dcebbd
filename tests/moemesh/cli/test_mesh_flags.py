"""The mesh flags of `moemesh up`, `demo` and `bench` derive from `MeshSpec` (defaults written once
there); the names are the command line's contract."""
from __future__ import annotations

import dataclasses

import pytest

from moemesh.cli.main import build_parser
from moemesh.cli.up import RunMeshConfig, UpConfig, mesh_config
from moemesh.launcher.mesh import Mesh, MeshSpec

MESH_FLAGS = ["--model", "--expert-servers", "--attention-replicas", "--experts-dtype", "--dense-dtype", "--transport", "--start-timeout",
              "--attention-threads", "--no-prefix-cache", "--max-num-batched-tokens", "--no-all-experts-path", "--log-dir"]
PUBLIC_FLAGS = ["--port", "--http-port", "--api-key", "--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name"]


def help_of(command: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command, public", [(["up"], True), (["demo"], False), (["bench"], False)])
def test_each_command_has_the_mesh_flags(command, public, capsys):
    out = help_of(command, capsys)
    assert all(f in out for f in MESH_FLAGS), [f for f in MESH_FLAGS if f not in out]
    assert all((f in out) is public for f in PUBLIC_FLAGS)
    assert "--host" not in out and "--grace" not in out  # the launcher's own


def test_defaults_are_meshspecs(monkeypatch, tiny_model_dir):
    monkeypatch.delenv("MOEMESH_API_KEY", raising=False)
    m = str(tiny_model_dir)
    cfg = mesh_config(build_parser().parse_args(["up", "--model", m]), UpConfig)
    assert cfg.mesh == MeshSpec(model_dir=m) and cfg.log_dir is None


def test_flags_reach_the_spec(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("MOEMESH_API_KEY", "from-the-environment-0123")
    m = str(tiny_model_dir)
    ns = build_parser().parse_args(["up", "--model", m, "--expert-servers", "3", "--attention-replicas", "2", "--experts-dtype",
                                    "fp8", "--dense-dtype", "fp8", "--transport", "dist", "--port", "8100", "--http-port", "0", "--start-timeout", "30",
                                    "--attention-threads", "1", "--no-prefix-cache", "--max-num-batched-tokens", "64",
                                    "--no-all-experts-path", "--log-dir", "/tmp/logs"])
    cfg = mesh_config(ns, UpConfig)
    assert cfg.mesh == MeshSpec(model_dir=m, expert_servers=3, attention_replicas=2, experts_dtype="fp8", dense_dtype="fp8",
                                transport="dist", port=8100, http_port=0, start_timeout_s=30.0, attention_threads=1, prefix_cache=False,
                                max_num_batched_tokens=64, all_experts_path=False, api_key="from-the-environment-0123")
    assert cfg.log_dir == "/tmp/logs"
    assert mesh_config(build_parser().parse_args(["up", "--model", m, "--api-key", "on-the-command-line"]), UpConfig).mesh.api_key \
        == "on-the-command-line"


@pytest.mark.parametrize("argv, message", [(["--expert-servers", "0"], "expert_servers must be >= 1"),
                                           (["--expert-servers", "two"], "--expert-servers"),
                                           (["--experts-dtype", "int3"], "experts_dtype"),
                                           (["--dense-dtype", "int8"], "dense_dtype"),
                                           (["--start-timeout", "0"], "--start-timeout"),
                                           (["--attention-threads", "-1"], "--attention-threads"),
                                           ([], "--model: model directory '/m' does not exist")])
def test_bad_values_name_the_field(argv, message):
    ns = build_parser().parse_args(["bench", "--model", "/m", *argv])
    with pytest.raises(ValueError, match=message):
        mesh_config(ns, RunMeshConfig)


def test_the_expert_servers_get_the_all_experts_switch(tmp_path, monkeypatch):
    started = {}
    monkeypatch.setattr(Mesh, "_spawn", lambda self, name, service, flags: started.setdefault(name, flags) and f"127.0.0.1:{len(started)}")
    monkeypatch.setattr(Mesh, "_wait", lambda self, addresses: None)
    for on in (True, False):
        started.clear()
        Mesh(dataclasses.replace(MeshSpec(model_dir="/m", expert_servers=1), all_experts_path=on), tmp_path / str(on)).start()
        assert started["expert-0"]["all_experts_path"] is (None if on else False)  # the flag is passed only to turn it off


def test_the_attention_replicas_get_the_dense_format(tmp_path, monkeypatch):
    started = {}
    monkeypatch.setattr(Mesh, "_spawn", lambda self, name, service, flags: started.setdefault(name, flags) and f"127.0.0.1:{len(started)}")
    monkeypatch.setattr(Mesh, "_wait", lambda self, addresses: None)
    for fmt in (None, "fp8"):
        started.clear()
        Mesh(MeshSpec(model_dir="/m", expert_servers=1, dense_dtype=fmt), tmp_path / str(fmt)).start()
        assert started["attention-0"]["dense_dtype"] == fmt and "dense_dtype" not in started["expert-0"]
