"""bench/decode_layer.py at test size: both sides step, every layer held for the one call."""
from __future__ import annotations

import pytest

from bench import decode_layer
from kernels.cpu.variant import available_variants


@pytest.mark.parametrize("compare,other", [("attention", "op by op"), ("experts", "experts apart")])
def test_runs_both_sides(tiny_shape_dir, capsys, compare, other):
    model = tiny_shape_dir("qwen3-sparse-tiny")
    out = decode_layer.main(["--model", str(model), "--steps", "3", "--threads", "1", "--compare", compare])
    assert out["one_call_ms"] > 0 and out["other_ms"] > 0
    printed = capsys.readouterr().out
    assert f"{other} / one call" in printed and "3 steps each" in printed
    if available_variants():
        assert out["layers_held"] == 2 and out["moe_layers_held"] == 2  # the tiny shape's two MoE layers


def test_each_side_runs_what_it_names(tiny_shape_dir, monkeypatch):
    """--compare experts: the one-call side runs every MoE layer's experts in the call, the other none;
    --compare attention: neither side does."""
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")
    from moemesh.models import decoder
    calls = []
    real = decoder.decode_layers_experts

    def counted(layers, *args, **kwargs):
        calls.extend(layers)
        return real(layers, *args, **kwargs)

    monkeypatch.setattr(decoder, "decode_layers_experts", counted)
    timed = decode_layer.alternate

    def alternate(steps, sides):  # only the timed steps count (the warm-up runs as the engine would)
        calls.clear()
        return timed(steps, sides)

    monkeypatch.setattr(decode_layer, "alternate", alternate)
    model = str(tiny_shape_dir("qwen3-sparse-tiny"))
    decode_layer.main(["--model", model, "--steps", "3", "--threads", "1", "--compare", "experts"])
    assert len(calls) == 3 * 2  # three one-call steps of two MoE layers each
    decode_layer.main(["--model", model, "--steps", "3", "--threads", "1", "--compare", "attention"])
    assert not calls


def test_rejects_zero_steps(capsys):
    with pytest.raises(SystemExit):
        decode_layer.parse_args(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err


def test_rejects_an_unknown_comparison(capsys):
    with pytest.raises(SystemExit):
        decode_layer.parse_args(["--compare", "everything"])
    assert "--compare" in capsys.readouterr().err
