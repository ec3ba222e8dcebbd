"""Dequantization by table lookup: the gathers and keyed indices, and the formats' dequantize against a
plain per-element reading of their documented rule (float32 arithmetic, then the cast)."""
import pytest
import torch

from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts
from kernels.formats.e2m1 import decode_e2m1, e2m1_pair_table, unpack_nibbles
from kernels.formats.lookup import byte_span, keyed_index, lookup

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 2, 3])
def test_lookup_gathers_entries_of_any_width(dtype, width):
    table = torch.randn(3, 256, width).to(dtype)
    index = torch.randint(0, 3 * 256, (4, 5), dtype=torch.int32)
    got = lookup(table, index)
    assert got.shape == (4, 5, width) and got.dtype == dtype
    assert torch.equal(got, table.reshape(-1, width)[index.long()])


def test_keyed_index_and_byte_span():
    stored = torch.tensor([[0, 255], [7, 9]], dtype=torch.uint8)
    key = torch.tensor([[1], [2]], dtype=torch.int32)
    assert keyed_index(stored, key).tolist() == [[256, 511], [519, 521]]
    assert keyed_index(stored, key).dtype == torch.int32
    assert byte_span(stored) == (0, 255) and byte_span(torch.zeros(0, dtype=torch.uint8)) == (0, 0)
    assert byte_span(torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)) == (0x38, 0x40)


def test_pair_table_is_low_nibble_first():
    pairs = e2m1_pair_table(torch.float32)
    byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pairs, decode_e2m1(unpack_nibbles(byte.unsqueeze(-1))))


def _e8m0(s):
    return torch.exp2(s.to(torch.int32).sub(127).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_every_scale_and_byte(dtype):
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2 * 255 // 16 + 1)[: 2 * 255 * 16].reshape(2, 255, 1, 16)
    scales = torch.arange(255, dtype=torch.uint8).repeat(2).reshape(2, 255, 1)  # every finite E8M0 byte
    q = MXFP4Experts(blocks, scales, 32)
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    want = (decode_e2m1(unpack_nibbles(blocks)).to(work) * _e8m0(scales).to(work)[..., None]).to(dtype).flatten(-2)
    assert torch.equal(q.dequantize(dtype), want)
    assert torch.equal(q.dequantize(dtype, torch.tensor([1])), want[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_every_block_scale_byte(dtype):
    torch.manual_seed(0)
    weight = torch.randint(0, 256, (2, 4, 256 * 8), dtype=torch.uint8)
    ws = torch.arange(256, dtype=torch.uint8).repeat(2, 4, 1)  # [2, 4, 256]: every e4m3 byte, NaNs included
    s2 = torch.rand(2, 2) + 0.5
    q = NVFP4Experts(weight, ws.view(torch.float8_e4m3fn), s2, 256 * 16, segments=2)
    scale = ws.view(torch.float8_e4m3fn).float() * s2.repeat_interleave(2, dim=1)[..., None]  # [2, 4, 256]
    vals = decode_e2m1(unpack_nibbles(weight)).unflatten(-1, (256, 16))
    want = (vals * scale[..., None]).flatten(-2).to(dtype)
    got = q.dequantize(dtype)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [256, 200])  # whole blocks, and a partial edge block
def test_fp8_every_byte_with_block_multipliers(dtype, k):
    torch.manual_seed(1)
    raw = torch.randint(0, 256, (2, 300, k), dtype=torch.uint8)
    raw[0, 0, :256 if k == 256 else k] = torch.arange(256, dtype=torch.uint8)[:k]
    scale = torch.rand(2, 3, 2) * 1e-2
    q = FP8BlockExperts(raw.view(torch.float8_e4m3fn), scale)
    s = scale.repeat_interleave(128, 1)[:, :300].repeat_interleave(128, 2)[..., :k]  # [2, 300, K]
    want = (raw.view(torch.float8_e4m3fn).float() * s).to(dtype)
    got = q.dequantize(dtype, torch.tensor([1, 0]))
    want = want[[1, 0]]
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_expert_rows_views_consecutive_experts_only_when_asked():
    from kernels.formats.checks import expert_rows

    t = torch.arange(24.0).reshape(4, 6)
    assert expert_rows(t, torch.tensor([1, 2]), view=True).data_ptr() == t[1].data_ptr()
    assert expert_rows(t, torch.tensor([1, 2])).data_ptr() != t[1].data_ptr()  # select() must not pin all of t
    assert torch.equal(expert_rows(t, torch.tensor([2, 1]), view=True), t[[2, 1]])
    with pytest.raises(IndexError):
        expert_rows(t, torch.tensor([3, 4]), view=True)
