"""bench/step_cost.py at test size: the step's split, with the one-call runs of MoE layers timed."""
from __future__ import annotations

import re

from bench import step_cost
from kernels.cpu.variant import available_variants


def test_splits_the_step_with_the_one_call_runs(tiny_shape_dir, capsys):
    model = tiny_shape_dir("qwen3-sparse-tiny")
    assert step_cost.main(["--model", str(model), "--concurrent", "1", "--steps", "3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("in the expert kernels"))
    experts, runs, dense, outside, least = (float(v) for v in re.findall(r"\d+\.\d+", line))
    assert dense > 0 and outside > 0 and least <= outside
    if available_variants():  # the MoE layers decode in one call: no expert call of their own
        assert runs > 0 and experts == 0
    else:
        assert runs == 0 and experts == 0  # the torch path: no compiled call at all
