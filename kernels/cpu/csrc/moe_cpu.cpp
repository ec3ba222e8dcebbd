// Torch binding of the CPU expert kernels: the routed expert MLP (gather, gate/up GEMM with its
// activation, down GEMM, weighted float32 combine) over weights read in place in their stored format.
// The work of each GEMM is split by output columns over torch's intra-op thread pool
// (at::parallel_for), so every thread streams its own share of each selected expert's weights;
// where every expert has at most one row and the threads divide their number (a decode step's top-k
// of one token), each thread instead runs whole experts, gate_up to down, in one parallel region.
//
// Shape legend: T tokens, H hidden, N rows (token-expert pairs) grouped by expert, G experts in the
// call, I intermediate, KP a reduction dim padded to 32.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "api.h"
#include "ops.h"

namespace moemesh_cpu {
namespace {

struct Isa {
  void (*matmul)(const Weights&, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t);
  void (*activation)(int, const float*, const float*, float*, int64_t);
  void (*prepare_row)(int, const float*, int64_t, float*);
};

constexpr int GATE_BLOCK = 32;  // gate columns (and their up columns) per work item
constexpr int DOWN_BLOCK = 32;  // hidden columns per work item

// Whether the AVX-512 kernels may multiply bfloat16 activations in bfloat16 (AVX512-BF16), and the
// 4-bit formats' in 16-bit integers (AVX512-VNNI, which every CPU with AVX512-BF16 has).
bool bf16_dot(const std::string& variant) {
#ifdef MOEMESH_X86_KERNELS
  __builtin_cpu_init();
  return variant == "avx512" && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
#else
  (void)variant;
  return false;
#endif
}

// Whether the AVX-512 kernels may also decode FP8 with byte permutes (AVX512-VBMI), given bf16_dot.
bool vbmi(const std::string& variant) {
#ifdef MOEMESH_X86_KERNELS
  __builtin_cpu_init();
  return bf16_dot(variant) && __builtin_cpu_supports("avx512vbmi");
#else
  (void)variant;
  return false;
#endif
}

bool supports(const std::string& variant) {
#ifdef MOEMESH_X86_KERNELS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (variant == "avx2") return avx2;
  if (variant == "avx512")
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  (void)variant;
  return false;
}

Isa isa_for(const std::string& variant) {
  TORCH_CHECK(supports(variant), "variant: ", variant, " is not supported by this CPU or build");
#ifdef MOEMESH_X86_KERNELS
  if (variant == "avx512") return {avx512::matmul, avx512::activation, avx512::prepare_row};
  return {avx2::matmul, avx2::activation, avx2::prepare_row};
#else
  return {nullptr, nullptr, nullptr};
#endif
}

// ints: fmt, k, seg_rows, per_seg, qbn, qbk. data [E, N, ...] (a row's bytes contiguous: mxfp4 blocks
// come as stored, [E, N, KB, 16]; any dtype, read as bytes); scale [E, *, *] (or empty); scale2
// [E, S] (or empty).
Weights weights_of(const std::vector<int64_t>& ints, const at::Tensor& data, const at::Tensor& scale,
                   const at::Tensor& scale2) {
  TORCH_CHECK(ints.size() == 6, "weights: expected 6 ints");
  bool rows_contiguous = data.dim() >= 3 && data.stride(data.dim() - 1) == 1;
  for (int64_t d = 2; rows_contiguous && d + 1 < data.dim(); ++d)
    rows_contiguous = data.stride(d) == data.stride(d + 1) * data.size(d + 1);
  TORCH_CHECK(rows_contiguous, "weights: data must be [E, N, ...] with each row's elements contiguous");
  Weights w{};
  w.fmt = int(ints[0]);
  w.data = data.data_ptr();
  w.sd_e = data.stride(0);
  w.sd_n = data.stride(1);
  if (scale.defined() && scale.numel()) {
    TORCH_CHECK(scale.dim() == 3 && scale.stride(2) == 1, "weights: scale must be [E, *, *] with unit last stride");
    w.scale = scale.data_ptr();
    w.ss_e = scale.stride(0);
    w.ss_r = scale.stride(1);
  }
  if (scale2.defined() && scale2.numel()) {
    TORCH_CHECK(scale2.dim() == 2 && scale2.stride(1) == 1 && scale2.scalar_type() == at::kFloat, "weights: scale2 must be [E, S] float32");
    w.scale2 = scale2.data_ptr<float>();
    w.s2_e = scale2.stride(0);
  }
  w.k = ints[1];
  w.seg_rows = ints[2];
  w.per_seg = ints[3];
  w.qbn = ints[4];
  w.qbk = ints[5];
  return w;
}

// Row j of bias [E, M] for expert e as float32 (float32 or bfloat16 storage); zeros when absent.
void bias_into(const c10::optional<at::Tensor>& bias, int64_t e, int64_t j0, int64_t n, float* out) {
  if (!bias.has_value()) {
    std::fill(out, out + n, 0.f);
    return;
  }
  const at::Tensor& b = *bias;
  if (b.scalar_type() == at::kFloat) {
    const float* p = b.data_ptr<float>() + e * b.stride(0) + j0;
    std::copy(p, p + n, out);
  } else {
    const c10::BFloat16* p = b.data_ptr<c10::BFloat16>() + e * b.stride(0) + j0;
    for (int64_t i = 0; i < n; ++i) out[i] = float(p[i]);
  }
}

float round_bf16(float v) { return float(c10::BFloat16(v)); }

// Split items [0, costs.size()) into `parts` contiguous ranges of about equal summed cost.
std::vector<int64_t> split_by_cost(const std::vector<int64_t>& costs, int64_t parts) {
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  std::vector<int64_t> bounds(parts + 1, int64_t(costs.size()));
  bounds[0] = 0;
  int64_t acc = 0, part = 1;
  for (size_t i = 0; i < costs.size() && part < parts; ++i) {
    acc += costs[i];
    while (part < parts && acc * parts >= total * part) bounds[part++] = int64_t(i) + 1;
  }
  return bounds;
}

// Whether a call runs whole experts per thread: every expert in it has at most one row (a decode
// step's top-k of one token) and nt (>= 2) divides the number that have one, so the threads' shares
// are equal. With more rows per expert the column split below stays (its combine runs on every
// thread; whole experts per thread measured 2% slower at 16 rows, docs/benchmarks.md).
bool whole_experts(int64_t G, const int64_t* cnt, int64_t nt) {
  if (nt < 2) return false;
  int64_t live = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (cnt[g] > 1) return false;
    live += cnt[g];
  }
  return live >= nt && live % nt == 0;
}

}  // namespace

// v [rows * cols] float32 -> a new [rows, cols] tensor of dtype (float32, or bfloat16 rounded to
// nearest even as torch's conversion rounds): the results' one conversion, in place of a float32
// tensor and a `.to` (a dispatch of its own, which a decode step pays per layer).
at::Tensor as_dtype(const std::vector<float>& v, int64_t rows, int64_t cols, at::ScalarType dtype) {
  at::Tensor t = at::empty({rows, cols}, at::TensorOptions().dtype(dtype));
  if (dtype == at::kBFloat16) {
    c10::BFloat16* p = t.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < rows * cols; ++i) p[i] = c10::BFloat16(v[i]);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "as_dtype: float32 or bfloat16, got ", dtype);
    std::memcpy(t.data_ptr<float>(), v.data(), sizeof(float) * rows * cols);
  }
  return t;
}

// x [T, H] float32/bfloat16; token_idx [N] int64; row_weight [N] float32; expert_idx [G] int64;
// counts [G] int64 -> [T, H] in x's dtype (accumulated in float32).
at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& token_idx, const at::Tensor& row_weight,
                   const at::Tensor& expert_idx, const at::Tensor& counts,
                   const std::vector<int64_t>& gu_ints, const at::Tensor& gu_data, const at::Tensor& gu_scale,
                   const at::Tensor& gu_scale2, const c10::optional<at::Tensor>& gu_bias,
                   const std::vector<int64_t>& dn_ints, const at::Tensor& dn_data, const at::Tensor& dn_scale,
                   const at::Tensor& dn_scale2, const c10::optional<at::Tensor>& dn_bias,
                   int64_t act, int64_t inter, const std::string& variant) {
  const Isa isa = isa_for(variant);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: expected a contiguous [T, H] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  Weights gu = weights_of(gu_ints, gu_data, gu_scale, gu_scale2);
  Weights dn = weights_of(dn_ints, dn_data, dn_scale, dn_scale2);
  // With bfloat16 x, the gate_up input and the down input (the activation, rounded to bfloat16 as the
  // reference rounds it) hold bfloat16 values.
  gu.bf16_x = dn.bf16_x = bf16 && bf16_dot(variant);
  gu.vbmi = dn.vbmi = gu.bf16_x && vbmi(variant);
  const int64_t T = x.size(0), H = x.size(1), N = token_idx.numel(), G = expert_idx.numel();
  const int64_t* tok = token_idx.data_ptr<int64_t>();
  const float* rw = row_weight.data_ptr<float>();
  const int64_t* ex = expert_idx.data_ptr<int64_t>();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  const int64_t E = gu_data.size(0);
  TORCH_CHECK_VALUE(dn_data.size(0) == E, "down: expected ", E, " experts");
  std::vector<int64_t> start(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK_VALUE(cnt[g] >= 0, "counts: must be non-negative");
    TORCH_CHECK_VALUE(ex[g] >= 0 && ex[g] < E, "expert_idx: indices must lie in [0, ", E, ")");
    start[g + 1] = start[g] + cnt[g];
  }
  TORCH_CHECK_VALUE(start[G] == N, "counts: must sum to N=", N);
  TORCH_CHECK_VALUE(row_weight.numel() == N, "row_weight: expected ", N, " values");
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK_VALUE(tok[r] >= 0 && tok[r] < T, "token_idx: indices must lie in [0, ", T, ")");
  std::vector<float> out(T * H, 0.f);  // [T, H] the weighted sums, rounded to x's dtype at the end
  if (N == 0) return as_dtype(out, T, H, x.scalar_type());
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());

  // Gather: each token once as float32 in the gate_up format's layout, then each row's token (a
  // token goes to K experts: K rows, one preparation).
  const int64_t kh = padded_k(H), ki = padded_k(inter);
  std::vector<float> xt(T * kh), xg(N * kh), h(N * inter), hp(N * ki);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(H);
    for (int64_t t = t0; t < t1; ++t) {
      if (bf16) {
        const c10::BFloat16* p = x.data_ptr<c10::BFloat16>() + t * H;
        for (int64_t i = 0; i < H; ++i) row[i] = float(p[i]);
      } else {
        std::copy(x.data_ptr<float>() + t * H, x.data_ptr<float>() + (t + 1) * H, row.begin());
      }
      isa.prepare_row(gu.fmt, row.data(), H, xt.data() + t * kh);
    }
  });
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::memcpy(xg.data() + r * kh, xt.data() + tok[r] * kh, sizeof(float) * kh);
  });

  // Expert g's gate and up columns [c0, c1) for its rows: both projections, the bias, the activation
  // into h (with the bfloat16 roundings the reference makes).
  auto gate_up = [&](int64_t g, int64_t c0, int64_t c1, std::vector<float>& gbuf, std::vector<float>& ubuf,
                     std::vector<float>& bias) {
    const int64_t m = cnt[g], r0 = start[g], e = ex[g], nc = c1 - c0;
    gbuf.resize(m * nc);
    ubuf.resize(m * nc);
    bias.resize(2 * nc);
    isa.matmul(gu, e, c0, c1, xg.data() + r0 * kh, m, kh, gbuf.data(), nc);
    isa.matmul(gu, e, inter + c0, inter + c1, xg.data() + r0 * kh, m, kh, ubuf.data(), nc);
    bias_into(gu_bias, e, c0, nc, bias.data());
    bias_into(gu_bias, e, inter + c0, nc, bias.data() + nc);
    for (int64_t i = 0; i < m; ++i) {
      float* gr = gbuf.data() + i * nc;
      float* ur = ubuf.data() + i * nc;
      for (int64_t j = 0; j < nc; ++j) {
        gr[j] += bias[j];
        ur[j] += bias[nc + j];
        if (bf16) {  // the bfloat16 reference rounds the projection (and bias sum) to bfloat16
          gr[j] = round_bf16(gr[j]);
          ur[j] = round_bf16(ur[j]);
        }
      }
      float* hr = h.data() + (r0 + i) * inter + c0;
      isa.activation(int(act), gr, ur, hr, nc);
      if (bf16)
        for (int64_t j = 0; j < nc; ++j) hr[j] = round_bf16(hr[j]);
    }
  };
  // out's hidden columns [c0, c1) += each of expert g's rows' weight times (its down projection
  // y [cnt[g], c1 - c0], row stride ldy, plus the bias), rounded as the reference rounds it.
  auto combine = [&](int64_t g, int64_t c0, int64_t c1, const float* y, int64_t ldy, std::vector<float>& bias) {
    const int64_t nc = c1 - c0;
    bias.resize(nc);
    bias_into(dn_bias, ex[g], c0, nc, bias.data());
    for (int64_t i = 0; i < cnt[g]; ++i) {
      const int64_t r = start[g] + i;
      float* orow = out.data() + tok[r] * H + c0;
      const float wgt = rw[r];
      const float* yr = y + i * ldy;
      for (int64_t j = 0; j < nc; ++j) {
        const float v = yr[j] + bias[j];
        orow[j] += wgt * (bf16 ? round_bf16(v) : v);
      }
    }
  };

  if (whole_experts(G, cnt, nt)) {
    // Whole experts per thread, in one parallel region (a decode step's top-k of one token): each
    // thread runs gate_up, the activation and down of its experts one after another, keeping each
    // expert's down projection in y; the experts are then added to out in the order of the call, as
    // the split below adds them, so the sums are the same. One region instead of two, and no wait
    // between the projections: 1-2% faster decode steps (docs/benchmarks.md).
    std::vector<float> y(N * H);  // [N, H] each row's down projection
    const std::vector<int64_t> eb = split_by_cost(std::vector<int64_t>(cnt, cnt + G), nt);  // equal shares of experts
    at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> gbuf, ubuf, bias;
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t g = eb[p]; g < eb[p + 1]; ++g) {
          if (cnt[g] == 0) continue;
          const int64_t r0 = start[g];
          gate_up(g, 0, inter, gbuf, ubuf, bias);
          for (int64_t r = r0; r < r0 + cnt[g]; ++r) isa.prepare_row(dn.fmt, h.data() + r * inter, inter, hp.data() + r * ki);
          isa.matmul(dn, ex[g], 0, H, hp.data() + r0 * ki, cnt[g], ki, y.data() + r0 * H, H);
        }
    });
    std::vector<float> bias;
    for (int64_t g = 0; g < G; ++g)
      if (cnt[g]) combine(g, 0, H, y.data() + start[g] * H, H, bias);
    return as_dtype(out, T, H, x.scalar_type());
  }

  // Otherwise gate_up with the activation in work items (expert, block of gate columns), balanced by
  // cost over the threads.
  struct Item { int64_t g, c0, c1; };
  std::vector<Item> items;
  std::vector<int64_t> costs;
  for (int64_t g = 0; g < G; ++g) {
    if (cnt[g] == 0) continue;
    for (int64_t c0 = 0; c0 < inter; c0 += GATE_BLOCK) {
      items.push_back({g, c0, std::min(inter, c0 + GATE_BLOCK)});
      costs.push_back(8 + cnt[g]);  // weight streaming, plus work per row
    }
  }
  const std::vector<int64_t> bounds = split_by_cost(costs, nt);
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> gbuf, ubuf, bias;
    for (int64_t p = p0; p < p1; ++p) {
      // A thread's consecutive items of one expert run as one range of gate columns (and one of up
      // columns): each projection's rows are then read as one long stream instead of restarting,
      // cold, every GATE_BLOCK rows (the items only balance the threads' shares).
      for (int64_t it = bounds[p]; it < bounds[p + 1];) {
        int64_t last = it;
        while (last + 1 < bounds[p + 1] && items[last + 1].g == items[it].g && items[last + 1].c0 == items[last].c1) ++last;
        gate_up(items[it].g, items[it].c0, items[last].c1, gbuf, ubuf, bias);
        it = last + 1;
      }
    }
  });

  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) isa.prepare_row(dn.fmt, h.data() + r * inter, inter, hp.data() + r * ki);
  });

  // down with the weighted combine: each thread owns a contiguous range of hidden columns (whole
  // DOWN_BLOCKs) of `out` (no two threads add to the same element) and reads, expert after expert,
  // that range's rows as one stream; the experts are added in the order of the call.
  const int64_t blocks = (H + DOWN_BLOCK - 1) / DOWN_BLOCK;
  at::parallel_for(0, blocks, (blocks + nt - 1) / nt, [&](int64_t b0, int64_t b1) {
    const int64_t c0 = b0 * DOWN_BLOCK, c1 = std::min(H, b1 * DOWN_BLOCK), nc = c1 - c0;
    std::vector<float> ybuf, bias;
    for (int64_t g = 0; g < G; ++g) {
      if (cnt[g] == 0) continue;
      ybuf.resize(cnt[g] * nc);
      isa.matmul(dn, ex[g], c0, c1, hp.data() + start[g] * ki, cnt[g], ki, ybuf.data(), nc);
      combine(g, c0, c1, ybuf.data(), nc, bias);
    }
  });
  return as_dtype(out, T, H, x.scalar_type());
}

// x [M, K] float32/bfloat16 contiguous; one projection W [N, K] in any stored format, given as the
// experts' are (ints, data, scale, scale2; see weights_of) for one "expert": data [N, ...] or
// [1, N, ...], scale [1, *, *] (or empty), scale2 [1, S] (or empty) -> [M, N] = x @ W.T in out_dtype
// (float32, or bfloat16: the float32 sums rounded once).
// A dense matrix (attention, dense MLP, LM head) read once, in place, by the same row-streaming and
// tiled kernels as the experts. Output rows are split over the threads in equal contiguous ranges,
// so each thread streams its own stretch of W.
at::Tensor linear_as(const at::Tensor& x, const std::vector<int64_t>& ints, const at::Tensor& data, const at::Tensor& scale,
                     const at::Tensor& scale2, const std::string& variant, at::ScalarType out_dtype) {
  const Isa isa = isa_for(variant);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), "x: expected a contiguous [M, K] tensor");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK_VALUE(data.dim() >= 2, "w: expected data [N, ...] or [1, N, ...]");
  const at::Tensor d3 = data.dim() == 2 ? data.unsqueeze(0) : data;  // [1, N, ...]
  TORCH_CHECK_VALUE(d3.size(0) == 1, "w: expected one matrix, got ", d3.size(0));
  Weights wt = weights_of(ints, d3, scale, scale2);
  const int64_t M = x.size(0), K = x.size(1), N = d3.size(1);
  TORCH_CHECK_VALUE(wt.k == K, "w: expected ", K, " columns, got ", wt.k);
  if (wt.fmt == FMT_F32 || wt.fmt == FMT_BF16) {
    TORCH_CHECK_VALUE(d3.dim() == 3 && d3.size(2) == K, "w: expected [N, ", K, "]");
    TORCH_CHECK_VALUE(d3.scalar_type() == (wt.fmt == FMT_F32 ? at::kFloat : at::kBFloat16), "w: dtype does not match its format code");
  } else if (wt.fmt == FMT_FP8) {
    TORCH_CHECK_VALUE(d3.dim() == 3 && d3.size(2) == K && d3.element_size() == 1, "w: expected [N, ", K, "] bytes");
    TORCH_CHECK_VALUE(scale.defined() && scale.numel() && scale.scalar_type() == at::kFloat, "w: fp8 needs a float32 scale");
    TORCH_CHECK_VALUE(wt.qbk > 0 && wt.qbk % 32 == 0 && wt.qbn > 0 && wt.seg_rows > 0, "w: fp8 block width must be a multiple of 32");
  } else {
    TORCH_CHECK_VALUE(wt.fmt == FMT_MXFP4 || wt.fmt == FMT_NVFP4, "w: unknown format code ", wt.fmt);
  }
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype: float32 or bfloat16, got ", out_dtype);
  if (M == 0 || N == 0) return at::empty({M, N}, x.options().dtype(out_dtype));
  // float32 out: the result tensor itself; bfloat16: a float32 buffer, rounded into it at the end
  at::Tensor out = out_dtype == at::kFloat ? at::empty({M, N}, x.options().dtype(at::kFloat)) : at::Tensor();
  std::vector<float> buf(out.defined() ? 0 : M * N);
  // With bfloat16 x the quantized formats may multiply in bfloat16 (x's values are bfloat16 already).
  wt.bf16_x = x.scalar_type() == at::kBFloat16 && bf16_dot(variant);
  wt.vbmi = wt.bf16_x && vbmi(variant);
  const int64_t kp = padded_k(K);
  std::vector<float> xp(M * kp), row(K);
  for (int64_t m = 0; m < M; ++m) {
    if (x.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* p = x.data_ptr<c10::BFloat16>() + m * K;
      for (int64_t i = 0; i < K; ++i) row[i] = float(p[i]);
    } else {
      std::copy(x.data_ptr<float>() + m * K, x.data_ptr<float>() + (m + 1) * K, row.begin());
    }
    isa.prepare_row(wt.fmt, row.data(), K, xp.data() + m * kp);
  }
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(16, (N / nt + 15) / 16 * 16);
  float* o = out.defined() ? out.data_ptr<float>() : buf.data();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { isa.matmul(wt, 0, n0, n1, xp.data(), M, kp, o + n0, N); });
  return out.defined() ? out : as_dtype(buf, M, N, out_dtype);
}

at::Tensor linear(const at::Tensor& x, const std::vector<int64_t>& ints, const at::Tensor& data, const at::Tensor& scale,
                  const at::Tensor& scale2, const std::string& variant) {
  return linear_as(x, ints, data, scale, scale2, variant, at::kFloat);
}

namespace {

// How many threads one at::parallel_for region of `items` items (grain 1) runs on: torch's intra-op
// thread count when the library was built with OpenMP (build.py), 1 where it was not.
int64_t parallel_threads(int64_t items) {
  std::vector<int> used(std::max<int64_t>(1, at::get_num_threads()), 0);
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < int(used.size())) used[t] = 1;
  });
  int64_t n = 0;
  for (int u : used) n += u;
  return n;
}

std::vector<std::string> variants() {
  std::vector<std::string> out;
  for (const char* v : {"avx512", "avx2"})
    if (supports(v)) out.emplace_back(v);
  return out;
}

}  // namespace

bool supports_variant(const std::string& variant) { return supports(variant); }

void bind_step_ops(pybind11::module_& m);  // step_ops.cpp
void bind_decode_layer(pybind11::module_& m);  // decode_layer.cpp
void bind_quantize(pybind11::module_& m);  // quantize_cpu.cpp
}  // namespace moemesh_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moemesh CPU expert kernels";
  m.def("variants", &moemesh_cpu::variants, "kernel variants this CPU runs, best first");
  m.def("bf16_dot", &moemesh_cpu::bf16_dot, "whether a variant multiplies bfloat16 activations in bfloat16 here (AVX512-BF16), and 4-bit weights in 16-bit integers (AVX512-VNNI)");
  m.def("parallel_threads", &moemesh_cpu::parallel_threads, "threads one parallel region of n items runs on");
  // the GIL is released while the kernels run (as torch's own ops do), so other Python threads go on
  m.def("moe_mlp", &moemesh_cpu::moe_mlp, "routed expert MLP over weights in their stored format",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &moemesh_cpu::linear, "x @ W.T for one matrix W in any stored format, as float32",
        py::call_guard<py::gil_scoped_release>());
  moemesh_cpu::bind_step_ops(m);
  moemesh_cpu::bind_decode_layer(m);
  moemesh_cpu::bind_quantize(m);
}
