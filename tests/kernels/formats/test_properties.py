"""Properties of the three formats over random shapes (edge blocks included) and magnitudes."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.formats import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from kernels.formats.checks import pad_last

shapes = st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 70))
magnitudes = st.sampled_from([1e-30, 1e-6, 1.0, 3.7, 1e6, 1e30])


def weights(shape, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * magnitude * torch.rand(shape[0], shape[1], 1, generator=g)
    w[..., ::7] = 0.0  # zeros inside blocks (and all-zero blocks on short rows)
    return w


@settings(max_examples=30, deadline=None)
@given(shapes, magnitudes, st.integers(0, 2**31 - 1))
def test_mxfp4_round_trip_is_idempotent_and_error_is_below_two_scales(shape, magnitude, seed):
    w = weights(shape, magnitude, seed)
    q = quantize_mxfp4(w)
    d = q.dequantize()
    assert d.shape == w.shape and bool(torch.isfinite(d).all())
    again = quantize_mxfp4(d)
    assert torch.equal(again.blocks, q.blocks) and torch.equal(again.scales, q.scales)
    err = pad_last((d - w).abs(), 32).unflatten(-1, (-1, 32)).amax(-1)  # [E, N, KB]
    assert bool((err < 2.0 * torch.exp2(q.scales.double() - 127)).all())


@settings(max_examples=30, deadline=None)
@given(shapes, magnitudes, st.integers(0, 2**31 - 1))
def test_fp8_error_is_an_e4m3_rounding(shape, magnitude, seed):
    w = weights(shape, magnitude, seed)
    q = quantize_fp8_block(w, block=(16, 32))
    d = q.dequantize()
    scale = q.scale.repeat_interleave(16, 1)[:, : shape[1]].repeat_interleave(32, 2)[..., : shape[2]]  # [E, N, K]
    # 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale for subnormals
    bound = torch.maximum(w.abs().double() * 2.0**-4, scale.double() * 2.0**-10) * (1 + 1e-6)
    assert bool(((d - w).abs().double() <= bound).all())


@settings(max_examples=30, deadline=None)
@given(shapes, magnitudes, st.integers(0, 2**31 - 1))
def test_nvfp4_error_is_half_a_step_plus_saturation(shape, magnitude, seed):
    w = weights(shape, magnitude, seed)
    q = quantize_nvfp4(w)
    d = q.dequantize()
    assert d.shape == w.shape
    step = (q.weight_scale.double() * q.weight_scale_2.double()[:, :, None])  # [E, N, KB]: one e2m1 unit
    amax = pad_last(w.abs(), 16).unflatten(-1, (-1, 16)).amax(-1).double()  # [E, N, KB]
    bound = step * (1 + 1e-5) + (amax - 6 * step).clamp(min=0)
    err = pad_last((d - w).abs(), 16).unflatten(-1, (-1, 16)).amax(-1).double()
    assert bool((err <= bound).all())
