"""torchao wrote the native NVFP4 / MXFP4 bytes; `--experts-dtype` quantizes the float checkpoint's
experts with the kernels' quantizers at load. Same rule, same blocks (gate and up quantized apart)
-> the two paths give bit-identical outputs."""
from __future__ import annotations

import pytest

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.engine_helpers import make_engine

PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11, 200, 100, 50, 25, 12, 6, 3, 1, 0]


@pytest.mark.parametrize("native_checkpoint", ["nvfp4", "mxfp4"], indirect=True)
def test_native_checkpoint_equals_quantizing_on_load(native_checkpoint):
    fmt, qdir, _, _, src = native_checkpoint
    params = SamplingParams(max_new_tokens=16, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    stored = make_engine(qdir).generate([PROMPT], params)[0]
    on_load = make_engine(src, experts_dtype=fmt).generate([PROMPT], params)[0]
    assert on_load.prompt_logprobs == stored.prompt_logprobs
    assert on_load.token_ids == stored.token_ids
