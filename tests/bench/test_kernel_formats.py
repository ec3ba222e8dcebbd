"""bench/kernel_formats.py at test size: every format's row for each token count, and --layers copies."""
from __future__ import annotations

import pytest

from bench import kernel_formats

TINY = ["--experts", "4", "--top-k", "2", "--hidden", "64", "--intermediate", "32", "--tokens", "1,3", "--dtype", "bfloat16",
        "--repeat", "2", "--torch-repeat", "1", "--device", "cpu"]


def test_prints_every_format_for_each_token_count_over_the_layer_copies(capsys):
    kernel_formats.main(TINY + ["--layers", "3"])
    out = capsys.readouterr().out
    assert "layers=3" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["3"]) and len(line.split()) > 4]
    assert sorted((r[0], r[2]) for r in rows) == sorted((t, f) for t in ("1", "3") for f in kernel_formats.FORMATS)


def test_rejects_fewer_than_one_layer(capsys):
    with pytest.raises(SystemExit):
        kernel_formats.main(TINY + ["--layers", "0"])
    assert "--layers must be >= 1" in capsys.readouterr().err
