"""bench/decode_layer.py at test size: both sides step, every layer held for the one call."""
from __future__ import annotations

import pytest

from bench import decode_layer
from kernels.cpu.variant import available_variants


def test_runs_both_sides(tiny_shape_dir, capsys):
    model = tiny_shape_dir("qwen3-sparse-tiny")
    out = decode_layer.main(["--model", str(model), "--steps", "3", "--threads", "1"])
    assert out["one_call_ms"] > 0 and out["op_by_op_ms"] > 0
    printed = capsys.readouterr().out
    assert "op by op / one call" in printed and "3 steps each" in printed
    if available_variants():
        assert out["layers_held"] == 2  # the tiny shape's two layers


def test_rejects_zero_steps(capsys):
    with pytest.raises(SystemExit):
        decode_layer.parse_args(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err
