"""The gated delta rule and the causal convolution against transformers' torch fallbacks (float32,
random inputs): the chunked form (prefill) and the recurrent step (decode) equal each other and
transformers, with and without a carried state, grouped value heads, lengths around the chunk size;
a sequence split in pieces, or run token by token, ends in the state a single pass ends in."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as qn

from moemesh.models.qwen3_next.causal_conv import conv_prefill, conv_step
from moemesh.models.qwen3_next.delta_rule import chunked, recurrent, recurrent_step

TOL = dict(rtol=2e-5, atol=2e-5)


def inputs(n: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(n, hv, generator=gen))  # log decays <= 0
    beta = torch.rand(n, hv, generator=gen)
    state = 0.3 * torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def reference(fn, q, k, v, g, beta, state, **kw):
    o, s = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)
    return o[0], s[0]


@pytest.mark.parametrize("n", [1, 7, 64, 65, 150])
@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
@pytest.mark.parametrize("zero_state", [True, False])
def test_chunked_and_recurrent_match_transformers(n, hk, hv, zero_state):
    q, k, v, g, beta, state = inputs(n, hk, hv)
    if zero_state:
        state = torch.zeros_like(state)
    ref_o, ref_s = reference(qn.torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    rec_o, rec_s = reference(qn.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    for o, s in (chunked(q, k, v, g, beta, state), recurrent(q, k, v, g, beta, state)):
        torch.testing.assert_close(o, ref_o, **TOL)
        torch.testing.assert_close(s, ref_s, **TOL)
        torch.testing.assert_close(o, rec_o, **TOL)
        torch.testing.assert_close(s, rec_s, **TOL)


def test_small_chunks_equal_one_chunk():
    q, k, v, g, beta, state = inputs(37)
    o1, s1 = chunked(q, k, v, g, beta, state, chunk=64)
    o2, s2 = chunked(q, k, v, g, beta, state, chunk=8)
    torch.testing.assert_close(o1, o2, **TOL)
    torch.testing.assert_close(s1, s2, **TOL)


def test_pieces_carry_the_state():
    q, k, v, g, beta, state = inputs(100)
    whole_o, whole_s = chunked(q, k, v, g, beta, state)
    o1, s = chunked(q[:41], k[:41], v[:41], g[:41], beta[:41], state)
    o2, s = chunked(q[41:90], k[41:90], v[41:90], g[41:90], beta[41:90], s)
    outs = [o1, o2]
    for t in range(90, 100):  # then decode steps
        o, s4 = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s[None])
        s = s4[0]
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole_o, **TOL)
    torch.testing.assert_close(s, whole_s, **TOL)


def test_recurrent_step_batches_sequences():
    seqs = [inputs(1, seed=i) for i in range(3)]
    q, k, v, g, beta, state = (torch.cat([s[j] for s in seqs]) if j < 5 else torch.stack([s[5] for s in seqs]) for j in range(6))
    o, s = recurrent_step(q, k, v, g, beta, state)
    for i, one in enumerate(seqs):
        oi, si = recurrent(*one)
        torch.testing.assert_close(o[i], oi[0], **TOL)
        torch.testing.assert_close(s[i], si, **TOL)


@pytest.mark.parametrize("n", [1, 3, 9])
def test_causal_conv_matches_transformers_and_carries_its_state(n):
    c, kernel = 10, 4
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(n + 5, c, generator=gen), torch.randn(c, kernel, generator=gen)
    ref = qn.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()  # [n+5, C], zero history
    zero = torch.zeros(c, kernel - 1)
    out, state = conv_prefill(x[:n], w, zero)
    torch.testing.assert_close(out, ref[:n], **TOL)
    rest, state2 = conv_prefill(x[n:], w, state)  # the next piece of the same sequence
    torch.testing.assert_close(rest, ref[n:], **TOL)
    ref_state = torch.zeros(1, c, kernel)  # transformers' decode kernel keeps K inputs
    ref_state[0, :, 1:] = state
    step, new = conv_step(x[n : n + 1], w, state[None])
    want = qn.causal_conv1d_update(x[n : n + 1].t()[None], ref_state, w, None, "silu")[0, :, 0]
    torch.testing.assert_close(step[0], want, **TOL)
    torch.testing.assert_close(step[0], ref[n], **TOL)
    torch.testing.assert_close(new[0], conv_prefill(x[: n + 1], w, zero)[1], **TOL)
