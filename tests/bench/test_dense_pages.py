"""bench/dense_pages.py at test size: both engines step, the huge-page side holds its LM head in huge pages."""
from __future__ import annotations

import pytest
import torch

from bench import dense_pages
from kernels import hugepages
from kernels.cpu.linear_cpu import holds_plain


def test_runs_both_sides_and_reports_the_huge_page_memory(tiny_shape_dir, capsys):
    model = tiny_shape_dir("qwen3-sparse-tiny")
    out = dense_pages.main(["--model", str(model), "--steps", "3", "--threads", "1"])
    assert out["4k_ms"] > 0 and out["2m_ms"] > 0
    printed = capsys.readouterr().out
    assert "2 MiB / 4 KiB" in printed and "3 steps each" in printed
    if hugepages.available() and holds_plain(torch.bfloat16, torch.device("cpu")):
        # held plain, the tiny shape's LM head (49152 x 64 bfloat16, 6 MiB) is copied into huge pages
        assert out["huge_bytes"] > 0


def test_rejects_zero_steps(capsys):
    with pytest.raises(SystemExit):
        dense_pages.parse_args(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err
