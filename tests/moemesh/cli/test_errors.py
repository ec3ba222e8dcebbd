"""Every command-line error is one line naming the flag or file, exit status 2, never a traceback:
swept over every subcommand (`run`, `up`, `generate`, `ctl`, `serve *`, `bench`, `demo`, `demo-model`)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.cli.main import main
from tests.fixtures.auth import TEST_TOKEN, token_env

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return tiny_ckpt("mixtral")[0]


@pytest.fixture(scope="module")
def broken(tmp_path_factory, model):
    """Model directories broken in one way each: name -> path."""
    root = tmp_path_factory.mktemp("broken")
    good = json.loads((model / "config.json").read_text())
    configs = {
        "list": "[1, 2]",
        "not-json": "{architectures: nope",
        "not-utf8": b"\xff\xfe{}",
        "arch-string": json.dumps({**good, "architectures": "MixtralForCausalLM"}),
        "zero-heads": json.dumps({**good, "num_attention_heads": 0}),
        "hidden-list": json.dumps({**good, "hidden_size": [64]}),
        "rope-list": json.dumps({**good, "rope_parameters": [1]}),
    }
    out = {}
    for name, text in configs.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        out[name] = d
    bad_st = root / "bad-safetensors"
    bad_st.mkdir()
    (bad_st / "config.json").write_text(json.dumps(good))
    (bad_st / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    out["bad-safetensors"] = bad_st
    truncated = root / "truncated-safetensors"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps(good))
    data = (model / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    out["truncated-safetensors"] = truncated
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(good))
    out["no-weights"] = no_weights
    bad_tok = root / "bad-tokenizer"
    bad_tok.mkdir()
    for f in model.iterdir():
        (bad_tok / f.name).write_bytes(f.read_bytes())
    (bad_tok / "tokenizer.json").write_text("{}")
    out["bad-tokenizer"] = bad_tok
    return out


def one_error_line(capsys, argv, status=2):
    """Runs `moemesh ARGV` in this process; returns its one error line."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if ": error: " in l]
    assert rc == status, err
    assert len(lines) == 1 and err.rstrip("\n").endswith(lines[0]), err
    assert "Traceback" not in err
    return lines[0]


RUN_FLAGS = [
    (["--capacity-factor", "inf"], "--capacity-factor"),
    (["--capacity-factor", "nan"], "--capacity-factor"),
    (["--capacity-factor=-inf"], "--capacity-factor"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature=-1"], "--temperature"),
    (["--top-p", "nan"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k=-1"], "--top-k"),
    (["--seed", str(2**70)], "--seed"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "1000000"], "--max-new-tokens"),
    (["--max-new-tokens", "ten"], "--max-new-tokens"),
    (["--threads", "0"], "--threads"),
    (["--moe-top-k", "99"], "--moe-top-k"),
    (["--moe-top-k", "0"], "--moe-top-k"),
    (["--max-model-len", "1"], "--max-model-len"),
    (["--dtype", "float16"], "--dtype"),
    (["--experts-dtype", "int3"], "--experts-dtype"),
    (["--dense-dtype", "int8"], "--dense-dtype"),
    (["--device", "gpu"], "--device"),
    (["--micro-batches", "3"], "--micro-batches"),
    (["--block-size", "0"], "--block-size"),
]


@pytest.mark.parametrize("flags, needle", RUN_FLAGS)
def test_run_bad_flag(capsys, model, flags, needle):
    line = one_error_line(capsys, ["run", "--model", str(model), "--prompt-ids", "5,6", *flags])
    assert line.startswith("moemesh run: error: ") and needle in line, line


@pytest.mark.parametrize("prompt, needle", [
    (["--prompt-ids", "5,99999"], "--prompt-ids"),
    (["--prompt-ids", "5,x"], "--prompt-ids"),
    (["--prompt-ids", "99999999999999999999999"], "--prompt-ids"),
    (["--prompt-ids", ",".join(["5"] * 300)], "--prompt-ids"),
    ([], "--prompt"),
    (["--prompt", "hi", "--prompt-ids", "5"], "--prompt"),
    (["--prompt", "hi"], "tokenizer.json"),  # the tiny checkpoint has none
])
def test_run_bad_prompt(capsys, model, prompt, needle):
    line = one_error_line(capsys, ["run", "--model", str(model), *prompt])
    assert needle in line, line


@pytest.mark.parametrize("which, needle", [
    ("list", "config.json"), ("not-json", "config.json"), ("not-utf8", "config.json"), ("arch-string", "architectures"),
    ("zero-heads", "config.json"), ("hidden-list", "config.json"), ("rope-list", "config.json"),
    ("bad-safetensors", "model.safetensors"), ("truncated-safetensors", "model.safetensors"), ("no-weights", "safetensors"),
    ("bad-tokenizer", "tokenizer.json"),
])
def test_run_bad_model_directory(capsys, broken, which, needle):
    prompt = ["--prompt", "hi"] if which == "bad-tokenizer" else ["--prompt-ids", "5,6"]
    line = one_error_line(capsys, ["run", "--model", str(broken[which]), *prompt, "--max-new-tokens", "2"])
    assert needle in line, line


def test_run_missing_model_directory(capsys, tmp_path):
    line = one_error_line(capsys, ["run", "--model", str(tmp_path / "nope"), "--prompt-ids", "5"])
    assert "--model" in line and "nope" in line


def test_run_underflowing_temperature_is_greedy(capsys, model):
    def tokens(*flags):
        assert main(["run", "--model", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert tokens("--temperature", "1e-300") == tokens("--temperature", "0")
    assert tokens("--temperature", "0.7", "--top-p", "1e-300", "--seed", "3") == tokens("--temperature", "0")


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--addr", "nohost", "--prompt", "hi"], "--addr"),
    (["generate", "--addr", "127.0.0.1:99999", "--prompt", "hi"], "--addr"),
    (["generate", "--addr", "127.0.0.1:1", "--prompt", "hi", "--timeout=-1"], "--timeout"),
    (["generate", "--addr", "127.0.0.1:1", "--prompt", "hi", "--timeout", "nan"], "--timeout"),
    (["generate", "--addr", "127.0.0.1:1", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "--addr", "127.0.0.1:1", "--prompt-ids", "1,,x"], "--prompt-ids"),
    (["generate", "--addr", "127.0.0.1:1"], "--prompt"),
    (["generate", "--prompt", "hi"], "--addr"),
    (["ctl", "--addr", "127.0.0.1:1", "set"], "--top-k"),
    (["ctl", "--addr", "127.0.0.1:1", "set", "--capacity-factor", "inf"], "--capacity-factor"),
    (["ctl", "--addr", "127.0.0.1:1", "set", "--capacity-factor", "nan"], "--capacity-factor"),
    (["ctl", "--addr", "127.0.0.1:1", "set", "--top-k", "0"], "--top-k"),
    (["ctl", "--addr", "127.0.0.1:1", "set", "--top-k", "two"], "--top-k"),
    (["ctl", "--addr", "127.0.0.1:1", "set", "--top-k", "2", "--layer=-1"], "--layer"),
    (["ctl", "--addr", "localhost", "status"], "--addr"),
    (["ctl", "--addr", "127.0.0.1:1", "--timeout", "0", "status"], "--timeout"),
    (["ctl", "--addr", "127.0.0.1:1", "drain"], "SERVER_ID"),
    (["ctl", "--addr", "127.0.0.1:1", "frobnicate"], "frobnicate"),
    (["up", "--expert-servers", "0"], "--expert-servers"),
    (["up", "--expert-servers", "abc"], "--expert-servers"),
    (["up", "--attention-replicas=-1"], "--attention-replicas"),
    (["up", "--port", "70000"], "--port"),
    (["up", "--attention-threads=-2"], "--attention-threads"),
    (["up", "--start-timeout", "nan"], "--start-timeout"),
    (["up", "--max-num-batched-tokens=-5"], "--max-num-batched-tokens"),
    (["up", "--transport", "carrier-pigeon"], "--transport"),
    (["bench", "--num-requests", "0"], "--num-requests"),
    (["bench", "--concurrency", "0"], "--concurrency"),
    (["bench", "--rate", "nan"], "--rate"),
    (["bench", "--prompt-len", str(10**9)], "--prompt-len"),
    (["bench", "--addr", "nohost"], "--addr"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--expert-servers", "0"], "--expert-servers"),
    (["serve", "router", "--port", "99999"], "--port"),
    (["serve", "router", "--max-running", "0"], "--max-running"),
    (["serve", "attention", "--model-dir", "m", "--failover-timeout-s", "nan"], "--failover-timeout-s"),
    (["serve", "expert", "--model-dir", "m", "--device", "tpu"], "--device"),
    (["serve", "control", "--model-dir", "m", "--max-message-mb", "0"], "--max-message-mb"),
    (["serve", "teleporter"], "teleporter"),
    (["frobnicate"], "frobnicate"),
])
def test_other_commands_bad_flags(capsys, monkeypatch, argv, needle):
    import moemesh.rpc.server

    def must_not_serve(*a, **k):
        raise AssertionError("a bad flag got as far as starting the service")

    monkeypatch.setattr(moemesh.rpc.server, "serve_process", must_not_serve)
    monkeypatch.setenv("MOEMESH_MESH_TOKEN", TEST_TOKEN)  # so that the flag under test is what is wrong
    line = one_error_line(capsys, argv)
    assert needle in line, line


def test_up_and_demo_refuse_a_bad_model_directory_before_starting_anything(capsys, broken, tmp_path):
    for argv in (["up", "--model", str(broken["list"])], ["demo", "--model", str(tmp_path / "nope")],
                 ["bench", "--model", str(broken["zero-heads"])]):
        line = one_error_line(capsys, argv)
        assert "--model" in line, line


def test_demo_model_bad_paths(capsys, tmp_path):
    line = one_error_line(capsys, ["demo-model", str(tmp_path / "out"), "--gguf", str(tmp_path / "missing.gguf")])
    assert "missing.gguf" in line
    (tmp_path / "file").write_text("x")
    line = one_error_line(capsys, ["demo-model", str(tmp_path / "file" / "out")])
    assert str(tmp_path / "file") in line


def test_a_mesh_that_cannot_be_reached_is_one_line_status_1(capsys):
    line = one_error_line(capsys, ["generate", "--addr", "127.0.0.1:1", "--prompt-ids", "5", "--timeout", "3"], status=1)
    assert "UNAVAILABLE" in line or "DEADLINE_EXCEEDED" in line
    line = one_error_line(capsys, ["ctl", "--addr", "127.0.0.1:1", "--timeout", "3", "status"], status=1)
    assert "UNAVAILABLE" in line or "DEADLINE_EXCEEDED" in line


@pytest.mark.parametrize("argv, needle", [
    (["serve", "attention", "--model-dir", "{missing}"], "{missing}"),
    (["serve", "expert", "--model-dir", "{list}"], "config.json"),
    (["serve", "control", "--model-dir", "{missing}"], "{missing}"),
    (["serve", "router", "--attention", "127.0.0.1:1", "--connect-timeout-s", "1"], "replica 127.0.0.1:1"),
])
@pytest.mark.slow  # a service as a process
def test_a_service_that_cannot_start_says_why_in_one_line(tmp_path, broken, argv, needle):
    subs = {"missing": str(tmp_path / "missing"), "list": str(broken["list"])}
    argv = [a.format(**subs) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "moemesh.cli.main", *argv], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=token_env())
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"moemesh serve {argv[1]}: error: ") and needle.format(**subs) in last, proc.stderr


def test_run_a_sequence_that_fails_is_one_line_status_1(capsys, model, monkeypatch):
    import torch

    from moemesh.engine import LLMEngine

    run = LLMEngine._run
    monkeypatch.setattr(LLMEngine, "_run", lambda self, slices: [torch.full_like(r, math.nan) for r in run(self, slices)])
    line = one_error_line(capsys, ["run", "--model", str(model), "--prompt-ids", "5,6"], status=1)
    assert "logits: " in line
