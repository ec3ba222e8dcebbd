import pytest
import torch

from moemesh.transport.codec import ALLOWED_DTYPES, CodecError, decode, encode, tensor_pb2


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    # integer, float8 and float4: arbitrary bit patterns
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name", sorted(ALLOWED_DTYPES))
def test_round_trip_is_bit_exact_for_every_dtype(name):
    t = sample(ALLOWED_DTYPES[name])
    msg = tensor_pb2.Tensor.FromString(encode(t).SerializeToString())
    assert msg.dtype == name and list(msg.shape) == [3, 5]
    assert same_bits(decode(msg), t)


def test_bf16_and_float8_values_survive():
    x = torch.tensor([[1.5, -2.25, 3e38]], dtype=torch.bfloat16)
    assert torch.equal(decode(encode(x)), x)
    f8 = torch.tensor([0.5, -448.0, 1.0]).to(torch.float8_e4m3fn)
    assert torch.equal(decode(encode(f8)).float(), f8.float())


def test_non_contiguous_scalar_and_empty():
    t = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    assert torch.equal(decode(encode(t)), t)
    s = torch.tensor(2.5)
    assert decode(encode(s)).shape == () and decode(encode(s)).item() == 2.5
    e = torch.empty(0, 64)
    assert decode(encode(e)).shape == (0, 64)


def test_encode_into_an_existing_field():
    msg = tensor_pb2.Tensor(dtype="int8", shape=[9, 9], data=b"x")
    encode(torch.ones(2, dtype=torch.float16), out=msg)
    assert list(msg.shape) == [2] and msg.dtype == "float16" and len(msg.data) == 4


def test_unsupported_dtype_is_refused():
    with pytest.raises(CodecError, match="allow-list"):
        encode(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(
    "msg, match",
    [
        (tensor_pb2.Tensor(dtype="pickle", shape=[1], data=b"\0"), r"x\.dtype 'pickle'"),
        (tensor_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 15), r"x\.data has 15 bytes"),
        (tensor_pb2.Tensor(dtype="float32", shape=[-1, 4], data=b""), r"x\.shape\[0\] is -1"),
        (tensor_pb2.Tensor(dtype="uint8", shape=[1] * 9, data=b"\0"), "at most 8"),
        (tensor_pb2.Tensor(dtype="float32", shape=[1 << 40, 1 << 20], data=b""), r"x\.data has 0 bytes"),
        (tensor_pb2.Tensor(dtype="float32", shape=[4], data=b"\0" * 16), "must have 2 dimensions"),
    ],
)
def test_garbage_and_oversized_messages_name_the_field(msg, match):
    with pytest.raises(CodecError, match=match):
        decode(msg, field="x", ndim=2 if "must have" in match else None)
