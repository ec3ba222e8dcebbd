import pytest
import torch

from kernels.formats.e2m1 import E2M1_MAGNITUDES, decode_e2m1, decode_packed_e2m1, encode_e2m1, encode_packed_e2m1, unpack_nibbles
from tests.kernels.oracles import torchao_mxfp4_floor  # noqa: F401  (imports torchao once, warnings silenced)


def test_decode_every_code():
    vals = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert vals[:8].tolist() == list(E2M1_MAGNITUDES)
    assert vals[8:].tolist() == [-m for m in E2M1_MAGNITUDES]


def test_encode_representable_values_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    back = encode_e2m1(decode_e2m1(codes))
    # -0.0 (code 8) keeps its sign bit; every other value maps back to its code
    assert back.tolist() == codes.tolist()


@pytest.mark.parametrize(
    "x, code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (0.26, 1), (5.01, 7), (100.0, 7), (-100.0, 15), (-0.1, 8)],
)
def test_ties_to_even_and_saturation(x, code):
    assert encode_e2m1(torch.tensor([x])).item() == code


def test_encode_matches_torchao_on_a_dense_grid():
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    x = torch.linspace(-7.0, 7.0, 14001)
    x = torch.cat([x, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).repeat(2) * torch.tensor([1.0] * 7 + [-1.0] * 7)])
    assert torch.equal(encode_e2m1(x), f32_to_f4_unpacked(x.contiguous()))


def test_encode_packed_puts_element_2i_in_the_low_nibble():
    x = torch.randn(3, 10) * 3
    packed = encode_packed_e2m1(x)
    codes = encode_e2m1(x)
    assert packed.shape == (3, 5) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_encode_packed_rejects_odd_length():
    with pytest.raises(ValueError, match="x"):
        encode_packed_e2m1(torch.zeros(3))


def test_encode_every_float32_neighbourhood_of_the_midpoints():
    # the bit tricks round on the float32 bits: one ulp either side of each midpoint must fall apart
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 10.0))
    x = torch.cat([below, mids, above, -below, -mids, -above, torch.tensor([0.0, -0.0, 6.0, 7.0, 1e30, -1e30, 1e-40])])
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    assert torch.equal(encode_e2m1(x), f32_to_f4_unpacked(x.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_packed_equals_unpack_then_decode(dtype):
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    got = decode_packed_e2m1(packed, dtype)
    assert got.dtype == dtype and got.shape == (4, 128)
    assert torch.equal(got.float(), decode_e2m1(unpack_nibbles(packed)))
