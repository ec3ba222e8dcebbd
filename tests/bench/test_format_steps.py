"""bench/format_steps.py at test size: two engines (bf16 experts and another format) step in turns, block by block."""
from __future__ import annotations

import pytest

from bench import format_steps


def test_both_engines_step_in_every_block(tiny_shape_dir, capsys, monkeypatch):
    sides_seen = []
    timed = format_steps.alternate

    def alternate(steps, sides):
        sides_seen.append(sorted(sides))
        return timed(steps, sides)

    monkeypatch.setattr(format_steps, "alternate", alternate)
    model = str(tiny_shape_dir("qwen3-sparse-tiny"))
    out = format_steps.main(["--model", model, "--experts-dtype", "mxfp4", "--steps", "3", "--blocks", "2", "--threads", "1"])
    assert sides_seen == [["bf16", "mxfp4"], ["bf16", "mxfp4"]]
    assert out["blocks"] == 2 and 0 < out["min_ratio"] <= out["median_ratio"] <= out["max_ratio"]
    printed = capsys.readouterr().out
    assert "block 1:" in printed and "block 2:" in printed and "median over the blocks" in printed


def test_each_block_decodes_fresh_requests(tiny_shape_dir, monkeypatch):
    """A later block's requests are new ones (the earlier block's have finished), so its contexts are as short."""
    added = []
    from moemesh.engine import LLMEngine

    real = LLMEngine.add_request

    def add_request(self, request_id, *args, **kwargs):
        added.append(request_id)
        return real(self, request_id, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    model = str(tiny_shape_dir("qwen3-sparse-tiny"))
    format_steps.main(["--model", model, "--experts-dtype", "fp8", "--steps", "2", "--blocks", "3", "--threads", "1"])
    assert added == ["r0", "r0", "b1-0", "b1-0", "b2-0", "b2-0"]  # one request per engine per block


@pytest.mark.parametrize("argv,flag", [(["--experts-dtype", "bf16"], "--experts-dtype"), (["--blocks", "0"], "--blocks"),
                                       (["--steps", "0"], "--steps")])
def test_bad_flags_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        format_steps.parse_args(argv)
    assert flag in str(e.value) + capsys.readouterr().err


def test_defaults():
    ns = format_steps.parse_args([])
    assert (ns.experts_dtype, ns.steps, ns.blocks, ns.concurrent) == ("mxfp4", 64, 3, 1)
