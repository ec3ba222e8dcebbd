"""`moemesh run` as a subprocess: JSON output, streaming, chat prompts, and one-line errors."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.engine import EngineConfig, LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "moemesh.cli.main", "run", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


@pytest.mark.slow  # `moemesh run` as a process
def test_json_with_prompt_ids_matches_engine(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    proc = run_cli("--model", str(path), "--prompt-ids", "5,17,301,42", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"prompt_token_ids", "token_ids", "text", "finish_reason", "logprobs", "prompt_logprobs"}
    ref = LLMEngine(EngineConfig(str(path))).generate(
        [[5, 17, 301, 42]], SamplingParams(max_new_tokens=6, temperature=0.0, prompt_logprobs=True)
    )[0]
    assert out["prompt_token_ids"] == [5, 17, 301, 42]
    assert out["token_ids"] == ref.token_ids and out["finish_reason"] == ref.finish_reason
    assert out["logprobs"] == pytest.approx(ref.logprobs, abs=1e-6)
    assert out["prompt_logprobs"][0] is None and out["prompt_logprobs"][1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-6)


@pytest.mark.slow  # `moemesh run` as a process
def test_chat_prompt_streams_text_and_json_agrees(tiny_model_dir):
    proc = run_cli("--model", str(tiny_model_dir), "--prompt", "Hello there", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    from moemesh.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(tiny_model_dir)
    templated = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert out["prompt_token_ids"] == tok.encode(templated, add_special_tokens=False)
    assert out["text"] == tok.decode(out["token_ids"])
    raw = json.loads(run_cli("--model", str(tiny_model_dir), "--prompt", "Hello there", "--raw-prompt", "--max-new-tokens", "2", "--json").stdout)
    assert raw["prompt_token_ids"] == tok.encode("Hello there")
    streamed = run_cli("--model", str(tiny_model_dir), "--prompt", "Hello there", "--max-new-tokens", "8")
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == out["text"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/nonexistent/model", "--prompt-ids", "1,2"], "does not exist"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "--temperature"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "--top-p"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "--top-p"),
        (["--prompt-ids", ",".join(["3"] * 300), "--max-new-tokens", "4"], "context"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--prompt-ids", "1,2", "--device", "gpu"], "device"),
    ],
)
@pytest.mark.slow  # `moemesh run` as a process
def test_bad_input_is_one_clear_line(tiny_ckpt, args, needle):
    path, _ = tiny_ckpt("mixtral")
    full = args if "--model" in args else ["--model", str(path), *args]
    proc = run_cli(*full)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "moemesh run" in l]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # `moemesh run` as a process
def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    proc = run_cli("--model", str(tmp_path), "--prompt-ids", "1")
    assert proc.returncode != 0 and "FooForCausalLM" in proc.stderr and "MixtralForCausalLM" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_flags_are_the_contracts_and_reach_the_engine_config():
    from moemesh.cli.main import build_parser
    from moemesh.cli.run import RunConfig
    from moemesh.svc_config import from_sources

    ns = build_parser().parse_args([
        "run", "--model", "m", "--prompt-ids", "1,2", "--max-new-tokens", "3", "--temperature", "0.5", "--top-p", "0.9",
        "--top-k", "4", "--seed", "7", "--experts-dtype", "fp8", "--moe-top-k", "2", "--capacity-factor", "1.5",
        "--dtype", "float32", "--micro-batches", "2", "--threads", "3", "--device", "cpu", "--json",
    ])
    cfg = from_sources(RunConfig, None, argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in ("command", "func")}))
    assert cfg.engine == EngineConfig("m", dtype="float32", experts_dtype="fp8", micro_batches=2, moe_top_k=2, capacity_factor=1.5, num_threads=3)
    assert cfg.prompt.token_ids == (1, 2) and cfg.json
    assert cfg.prompt.sampling_params() == SamplingParams(max_new_tokens=3, temperature=0.5, top_p=0.9, top_k=4, seed=7)
    unset = from_sources(RunConfig, None, argparse.Namespace(model_dir="m", prompt="hi"))
    assert unset.engine.num_threads is None  # torch's thread count unless --threads
    assert unset.prompt.sampling_params() == SamplingParams(max_new_tokens=128, temperature=0.0)
