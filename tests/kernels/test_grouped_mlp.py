import pytest
import torch

from kernels import ExpertWeights, grouped_expert_mlp, prepare_experts
from kernels.experts import apply_activation, dequantized

FORMATS = ["bf16", "fp8", "mxfp4", "nvfp4"]


def make_weights(e=6, h=64, i=48, bias=False, activation="silu", seed=0):
    torch.manual_seed(seed)
    return ExpertWeights(
        torch.randn(e, 2 * i, h) * 0.2,
        torch.randn(e, h, i) * 0.2,
        torch.randn(e, 2 * i) * 0.1 if bias else None,
        torch.randn(e, h) * 0.1 if bias else None,
        activation,
    )


def reference(x, expert_idx, counts, w):
    """Per expert, in float64, on exactly the dequantized float32 weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    start = 0
    for e, n in zip(expert_idx.tolist(), counts.tolist()):
        gu = dequantized(w.gate_up, torch.float32, torch.tensor([e]))[0].double()
        dn = dequantized(w.down, torch.float32, torch.tensor([e]))[0].double()
        h = x[start : start + n].double() @ gu.T
        if w.gate_up_bias is not None:
            h = h + w.gate_up_bias[e].double()
        y = apply_activation(h, w.activation) @ dn.T
        if w.down_bias is not None:
            y = y + w.down_bias[e].double()
        out[start : start + n] = y
        start += n
    return out


def assert_matches(out, ref, rel=1e-5):
    assert out.dtype == torch.float32
    err = (out.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err} vs scale {ref.abs().max().item()}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)])
def test_matches_dequantized_reference_fp32(fmt, activation, bias):
    w = prepare_experts(make_weights(bias=bias, activation=activation), fmt, torch.float32)
    expert_idx = torch.tensor([4, 0, 2, 5, 1])  # not sorted; expert 3 absent
    counts = torch.tensor([3, 0, 1, 7, 2])  # a zero-token and a single-token expert
    x = torch.randn(int(counts.sum()), 64)
    out = grouped_expert_mlp(x, expert_idx, counts, w, backend="torch")
    assert_matches(out, reference(x, expert_idx, counts, w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sorted_experts_with_zero_counts(fmt):
    w = prepare_experts(make_weights(seed=1), fmt, torch.float32)
    expert_idx = torch.arange(6)
    counts = torch.tensor([0, 1, 0, 4, 1, 0])
    x = torch.randn(6, 64)
    assert_matches(grouped_expert_mlp(x, expert_idx, counts, w), reference(x, expert_idx, counts, w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_compute_dequantizes_into_bf16(fmt):
    w = prepare_experts(make_weights(seed=2), fmt, torch.bfloat16)
    expert_idx, counts = torch.tensor([0, 3]), torch.tensor([2, 5])
    x = torch.randn(7, 64).to(torch.bfloat16)
    out = grouped_expert_mlp(x, expert_idx, counts, w)
    assert out.dtype == torch.bfloat16
    ref = reference(x.float(), expert_idx, counts, w)
    assert (out.double() - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()


def test_no_rows_and_small_dequant_budget(monkeypatch):
    import kernels.grouped_torch as gt

    w = prepare_experts(make_weights(seed=3), "mxfp4", torch.float32)
    empty = grouped_expert_mlp(torch.zeros(0, 64), torch.tensor([1]), torch.tensor([0]), w)
    assert empty.shape == (0, 64)
    monkeypatch.setattr(gt, "DEQUANT_BUDGET_BYTES", 1)  # one expert per chunk
    expert_idx, counts = torch.tensor([5, 1, 3]), torch.tensor([2, 1, 3])
    x = torch.randn(6, 64)
    assert_matches(grouped_expert_mlp(x, expert_idx, counts, w), reference(x, expert_idx, counts, w))


def test_quantized_weights_are_close_to_the_originals():
    dense = make_weights(seed=4)
    expert_idx, counts = torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4])
    x = torch.randn(12, 64)
    ref = grouped_expert_mlp(x, expert_idx, counts, dense)
    tolerance = {"bf16": 0.01, "fp8": 0.08, "mxfp4": 0.3, "nvfp4": 0.25}  # measured 0.003, 0.046, 0.19, 0.15
    for fmt, tol in tolerance.items():
        out = grouped_expert_mlp(x, expert_idx, counts, prepare_experts(dense, fmt, torch.float32))
        rel = ((out - ref).norm() / ref.norm()).item()
        assert 0 < rel < tol, (fmt, rel)


def test_bad_arguments_raise_value_error():
    w = make_weights()
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="counts"):
        grouped_expert_mlp(x, torch.tensor([0, 1]), torch.tensor([1, 1]), w)
    with pytest.raises(ValueError, match="backend"):
        grouped_expert_mlp(x, torch.tensor([0]), torch.tensor([3]), w, backend="cuda")
    with pytest.raises(ValueError, match="expert_idx"):
        grouped_expert_mlp(x, torch.tensor([9]), torch.tensor([3]), w)
    with pytest.raises(ValueError, match="x"):
        grouped_expert_mlp(torch.randn(3, 10), torch.tensor([0]), torch.tensor([3]), w)
    with pytest.raises(ValueError, match="down"):
        ExpertWeights(torch.zeros(2, 8, 4), torch.zeros(2, 4, 3))


def test_prepare_experts_serves_quantized_weights_as_stored():
    q = prepare_experts(make_weights(), "nvfp4", torch.float32)
    again = prepare_experts(q, "fp8", torch.bfloat16)
    assert again.gate_up is q.gate_up and again.down is q.down
    assert q.fmt == "nvfp4" and q.gate_up.segments == 2 and q.down.segments == 1
    with pytest.raises(ValueError, match="experts_dtype"):
        prepare_experts(make_weights(), "int4", torch.float32)


def test_bytes_per_weight():
    w = make_weights(e=4, h=256, i=128)
    n = 4 * 3 * 256 * 128
    bits = {f: prepare_experts(w, f, torch.float32) for f in ("fp8", "mxfp4", "nvfp4")}
    assert 8 * (bits["mxfp4"].nbytes) / n == 4.25
    assert 4.5 <= 8 * bits["nvfp4"].nbytes / n < 4.51  # + one float32 weight_scale_2 per projection
    assert 8 < 8 * bits["fp8"].nbytes / n < 8.01


def test_select_and_to_keep_the_experts():
    w = prepare_experts(make_weights(), "fp8", torch.float32)
    sub = w.select(torch.tensor([4, 1]))
    assert sub.num_experts == 2
    assert torch.equal(sub.gate_up.dequantize(), w.gate_up.dequantize(experts=torch.tensor([4, 1])))
    assert sub.to("cpu").fmt == "fp8"
