// The small per-layer operations of a decode step outside the GEMMs, each one compiled call instead of
// several torch ops: RMSNorm (optionally after the residual add), the per-head q/k RMSNorm with the
// rotary embedding, and the softmax top-k routing with its dropless dispatch plan.
//
// Every function rounds where the torch code it replaces rounds (moemesh/models/layers.py,
// moemesh/moe/gate.py, moemesh/moe/dispatch.py): math in float32, the normalized value rounded to the
// activation dtype before the weight multiply, each rope product rounded before the sum. Only the
// order of float32 sums differs, so results agree to float rounding.
//
// Shape legend: T tokens (rows), R rows per token (heads), D row length, E experts, K top-k,
// N = T*K routed rows, G experts that receive rows.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "api.h"
#include "ops.h"

#ifdef MOEMESH_X86_KERNELS
#define MOEMESH_STEP_OPS_CLONES 1
#endif

namespace moemesh_cpu {

bool supports_variant(const std::string& variant);  // moe_cpu.cpp: the CPU and build run it

namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }
// value rounded to T and back: where torch stores an intermediate tensor in the activation dtype
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

constexpr int LANES = 16;  // partial sums, so that the sum of squares vectorizes

template <typename T>
float inv_rms(const T* x, int64_t d, float eps) {
  float part[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float v = to_float(x[i + l]);
      part[l] += v * v;
    }
  for (; i < d; ++i) {
    const float v = to_float(x[i]);
    part[0] += v * v;
  }
  float ss = 0.f;
  for (int l = 0; l < LANES; ++l) ss += part[l];
  return 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
}

// out[i] = round(round(x[i] * r) * w[i]) : F.rms_norm without a weight, then the weight multiply in T
template <typename T>
void norm_row(const T* x, const T* w, int64_t d, float eps, T* out) {
  const float r = inv_rms(x, d, eps);
  for (int64_t i = 0; i < d; ++i) out[i] = from_float<T>(round_to<T>(to_float(x[i]) * r) * to_float(w[i]));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": expected float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 3, name, ": expected 1 to 3 dims, got ", x.dim());
  TORCH_CHECK(x.size(-1) == 0 || x.stride(-1) == 1, name, ": the last dim must have unit stride");
}

// x [..., R?, D] (up to 3 dims, unit stride along D, any strides above) viewed as [A, B, D]
struct Rows {
  int64_t a, b, d, sa, sb;
};
Rows rows_of(const at::Tensor& x) {
  const int64_t n = x.dim();
  Rows r{1, 1, x.size(-1), 0, 0};
  if (n >= 2) r.b = x.size(-2), r.sb = x.stride(-2);
  if (n == 3) r.a = x.size(0), r.sa = x.stride(0);
  return r;
}

// weight [D] (shared by every row) or [B, D] (one per row of B, e.g. per head): its row for row b
void check_weight(const at::Tensor& w, const at::Tensor& x, const Rows& r) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight: expected ", x.scalar_type(), ", got ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "weight: expected a contiguous CPU tensor");
  TORCH_CHECK((w.dim() == 1 && w.size(0) == r.d) || (w.dim() == 2 && w.size(0) == r.b && w.size(1) == r.d),
              "weight: expected [", r.d, "] or [", r.b, ", ", r.d, "], got ", w.sizes());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const Rows r = rows_of(x);
  check_weight(w, x, r);
  at::Tensor out = at::empty(x.sizes(), x.options());  // contiguous
  const int64_t wstride = w.dim() == 2 ? r.d : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, r.a * r.b, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t ia = i / r.b, ib = i % r.b;
        norm_row(xp + ia * r.sa + ib * r.sb, wp + ib * wstride, r.d, static_cast<float>(eps), op + i * r.d);
      }
    });
  });
  return out;
}

// x, res [T, D] -> (x + res [T, D] rounded to the dtype, rms_norm of that sum [T, D])
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(res, "residual");
  TORCH_CHECK(x.dim() == 2 && res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(),
              "residual: expected the shape and dtype of x [T, D], got ", res.sizes(), " ", res.scalar_type());
  const Rows r = rows_of(x);
  TORCH_CHECK(w.dim() == 1, "weight: expected [D]");
  check_weight(w, x, r);
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t sx = x.stride(0), sr = res.stride(0), d = r.d;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = res.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, r.b, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        scalar_t* s = sp + t * d;
        for (int64_t i = 0; i < d; ++i) s[i] = from_float<scalar_t>(to_float(xp[t * sx + i]) + to_float(rp[t * sr + i]));
        norm_row(s, wp, d, static_cast<float>(eps), op + t * d);
      }
    });
  });
  return {sum, out};
}

// heads [T, R, D] (unit stride along D) -> [T, R, D]: per-row RMSNorm with weight [R, D] (or [D]; no
// norm where w is absent: n = the row as is), then the rotary embedding as
// moemesh/models/layers.apply_rope_signed computes it:
//   out[i] = round(round(n[i] * cos[i]) + round(n[(i + D/2) % D] * sin_signed[i]))
// cos, sin_signed [T, D] or [T, 1, D] in the dtype of heads (one row per token, shared by its R rows).
at::Tensor qk_norm_rope(const at::Tensor& heads, const std::optional<at::Tensor>& weight, const at::Tensor& cos,
                        const at::Tensor& sin_signed, double eps) {
  check_rows(heads, "heads");
  TORCH_CHECK(heads.dim() == 3, "heads: expected [T, R, D], got ", heads.sizes());
  const Rows r = rows_of(heads);
  TORCH_CHECK(r.d % 2 == 0, "heads: D must be even, got ", r.d);
  const bool normed = weight.has_value() && weight->defined();
  if (normed) check_weight(*weight, heads, r);
  for (const at::Tensor* t : {&cos, &sin_signed}) {
    TORCH_CHECK(t->scalar_type() == heads.scalar_type() && t->dim() >= 2 && t->size(0) == r.a && t->size(-1) == r.d &&
                    t->numel() == r.a * r.d && t->stride(-1) == 1 && t->device().is_cpu(),
                "cos/sin_signed: expected [", r.a, ", ", r.d, "] or [", r.a, ", 1, ", r.d, "] ", heads.scalar_type(),
                " with unit stride along D, got ", t->sizes(), " ", t->scalar_type());
  }
  at::Tensor out = at::empty(heads.sizes(), heads.options());
  const int64_t d = r.d, half = d / 2, wstride = normed && weight->dim() == 2 ? d : 0;
  const int64_t sc = cos.stride(0), ss = sin_signed.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, heads.scalar_type(), "qk_norm_rope", [&] {
    const scalar_t* hp = heads.data_ptr<scalar_t>();
    const scalar_t* wp = normed ? weight->data_ptr<scalar_t>() : nullptr;
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin_signed.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, r.a * r.b, 64, [&](int64_t i0, int64_t i1) {
      std::vector<float> n(d);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / r.b, b = i % r.b;
        const scalar_t* x = hp + t * r.sa + b * r.sb;
        if (normed) {
          const scalar_t* wr = wp + b * wstride;
          const float inv = inv_rms(x, d, static_cast<float>(eps));
          for (int64_t j = 0; j < d; ++j) n[j] = round_to<scalar_t>(round_to<scalar_t>(to_float(x[j]) * inv) * to_float(wr[j]));
        } else {
          for (int64_t j = 0; j < d; ++j) n[j] = to_float(x[j]);
        }
        const scalar_t* c = cp + t * sc;
        const scalar_t* s = sp + t * ss;
        scalar_t* o = op + i * d;
        for (int64_t j = 0; j < d; ++j) {
          const float a = round_to<scalar_t>(n[j] * to_float(c[j]));
          const float b2 = round_to<scalar_t>(n[j < half ? j + half : j - half] * to_float(s[j]));
          o[j] = from_float<scalar_t>(a + b2);
        }
      }
    });
  });
  return out;
}

namespace {

// q [E] (probability, expert) -> its first k the k largest, largest first. Equal probabilities are
// ordered as torch.topk orders them on the CPU (which then decides which of them is kept): the same
// selection algorithm on the same comparison (values only, NaN largest), so that the plan names the
// experts transformers' torch.topk names.
void select_top(std::vector<std::pair<float, int64_t>>& q, int64_t k) {
  const auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= static_cast<int64_t>(q.size())) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), larger);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), larger);
    std::sort(q.begin(), q.begin() + k - 1, larger);
  }
}

}  // namespace

// router_logits [T, E] -> the dropless dispatch plan of moemesh/moe/dispatch.make_plan after
// gate.softmax_topk: softmax over E in float32, the top k of each token (largest first; equal
// probabilities as torch.topk orders them), renormalized to sum 1 when `normalize`; the T*K choices taken
// slot-major (all first choices in token order, then all second choices, ...) and grouped by expert
// in that order (a stable sort by expert).
// Returns token_idx [N] int64, weights [N] float32, expert_ids [G] int64 ascending, counts [G] int64.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_topk(const at::Tensor& logits, int64_t top_k, bool normalize) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "router_logits: expected a [T, E] CPU tensor, got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "router_logits: expected float32 or bfloat16, got ", logits.scalar_type());
  const int64_t t_n = logits.size(0), e_n = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= e_n, "top_k: expected [1, ", e_n, "], got ", top_k);
  const at::Tensor l = logits.contiguous();
  std::vector<float> w_tk(t_n * top_k);     // [T, K] chosen weights
  std::vector<int64_t> id_tk(t_n * top_k);  // [T, K] chosen experts
  std::vector<float> p(e_n);
  std::vector<std::pair<float, int64_t>> q(e_n);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, l.scalar_type(), "route_topk", [&] {
    const scalar_t* lp = l.data_ptr<scalar_t>();
    for (int64_t t = 0; t < t_n; ++t) {
      const scalar_t* row = lp + t * e_n;
      float m = -INFINITY;
      for (int64_t e = 0; e < e_n; ++e) m = std::max(m, to_float(row[e]));
      float s = 0.f;
      for (int64_t e = 0; e < e_n; ++e) s += (p[e] = std::exp(to_float(row[e]) - m));
      for (int64_t e = 0; e < e_n; ++e) p[e] = p[e] / s;
      for (int64_t e = 0; e < e_n; ++e) q[e] = {p[e], e};
      select_top(q, top_k);
      float kept = 0.f;
      for (int64_t k = 0; k < top_k; ++k) kept += q[k].first;
      for (int64_t k = 0; k < top_k; ++k) {
        id_tk[t * top_k + k] = q[k].second;
        w_tk[t * top_k + k] = normalize ? q[k].first / kept : q[k].first;
      }
    }
  });
  // counting sort by expert over the slot-major order (stable)
  std::vector<int64_t> count(e_n, 0);
  for (int64_t i = 0; i < t_n * top_k; ++i) ++count[id_tk[i]];
  std::vector<int64_t> start(e_n, 0);
  int64_t groups = 0;
  for (int64_t e = 0, acc = 0; e < e_n; ++e) {
    start[e] = acc;
    acc += count[e];
    groups += count[e] > 0;
  }
  const int64_t n = t_n * top_k;
  at::Tensor token_idx = at::empty({n}, at::kLong), weights = at::empty({n}, at::kFloat);
  at::Tensor expert_ids = at::empty({groups}, at::kLong), counts = at::empty({groups}, at::kLong);
  int64_t* tp = token_idx.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  for (int64_t k = 0; k < top_k; ++k)
    for (int64_t t = 0; t < t_n; ++t) {
      const int64_t row = start[id_tk[t * top_k + k]]++;
      tp[row] = t;
      wp[row] = w_tk[t * top_k + k];
    }
  int64_t* ep = expert_ids.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t e = 0, g = 0; e < e_n; ++e)
    if (count[e]) ep[g] = e, cp[g++] = count[e];
  return {token_idx, weights, expert_ids, counts};
}

namespace {

// One logits row: the plain path of argmax_logsumexp (any values).
void plain_argmax_lse(const float* x, int64_t n, int64_t* id, float* top, float* lse) {
  float m = -INFINITY;
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) {  // torch.argmax takes the first NaN as the largest
      *id = j;
      *top = *lse = NAN;
      return;
    }
    if (x[j] > m) m = x[j], best = j;
  }
  *id = best;
  *top = m;
  if (!std::isfinite(m)) {  // +inf, or only -inf: no distribution
    *lse = NAN;
    return;
  }
  double s = 0.0;  // one running sum: double keeps it within float rounding over a long row
  for (int64_t j = 0; j < n; ++j) s += std::exp(double(x[j]) - m);
  *lse = float(m + std::log(s));
}

}  // namespace

// logits [B, V] float32 -> (ids [B] int64, top [B], lse [B] float32): each row's first largest entry
// (a NaN counts as the largest, as torch.argmax has it), its value, and log(sum(exp(row))), NaN where
// the row holds a NaN or +inf or only -inf. Rows of finite values on the variant's vector pass (max_sumexp), the
// others (and the "plain" variant) on plain loops; rows split over the threads.
std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits, const std::string& variant) {
  TORCH_CHECK_VALUE(logits.device().is_cpu() && logits.dim() == 2 && logits.size(1) > 0 &&
                        logits.scalar_type() == at::kFloat,
                    "logits: expected a [B, V] float32 CPU tensor with V > 0, got ", logits.scalar_type(), " ",
                    logits.sizes());
  TORCH_CHECK_VALUE(variant == "plain" || supports_variant(variant), "variant: ", variant,
                    " is not supported by this CPU or build");
  using RowFn = bool (*)(const float*, int64_t, float*, int64_t*, float*);
  RowFn fast = nullptr;
#ifdef MOEMESH_X86_KERNELS
  if (variant == "avx512") fast = avx512::max_sumexp;
  if (variant == "avx2") fast = avx2::max_sumexp;
#endif
  const at::Tensor l = logits.contiguous();
  const int64_t b_n = l.size(0), v_n = l.size(1);
  at::Tensor ids = at::empty({b_n}, at::kLong), top = at::empty({b_n}, at::kFloat), lse = at::empty({b_n}, at::kFloat);
  const float* lp = l.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* tp = top.data_ptr<float>();
  float* sp = lse.data_ptr<float>();
  at::parallel_for(0, b_n, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = lp + b * v_n;
      float s;
      if (fast && fast(x, v_n, tp + b, ip + b, &s)) {
        sp[b] = tp[b] + std::log(s);
      } else {
        plain_argmax_lse(x, v_n, ip + b, tp + b, sp + b);
      }
    }
  });
  return {ids, top, lse};
}

namespace {

// The decode attention's plain C++ inner loops (api.h: ATTENTION_FUNCTIONS), for head dims the ISA
// units do not take (not a multiple of ATTN_D_MULTIPLE) and where the caller names the "plain"
// variant; std::exp for the softmax (the ISA units: kernel_impl.h's vexp, within about 2 ulp).
// dots and axpys are compiled for AVX-512, AVX2 and the x86-64 baseline and chosen at load time by
// the CPU (GCC function multi-versioning).
#ifdef MOEMESH_STEP_OPS_CLONES
#define STEP_OPS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define STEP_OPS_CLONES
#endif

// out[g * ld] = scale * sum_e q[g * d + e] * k[e] for g < group (in LANES partial sums)
STEP_OPS_CLONES void dots(const float* q, int64_t group, const float* k, int64_t d, float scale, float* out, int64_t ld) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    float part[LANES] = {0};
    int64_t e = 0;
    for (; e + LANES <= d; e += LANES)
      for (int l = 0; l < LANES; ++l) part[l] += qg[e + l] * k[e + l];
    for (; e < d; ++e) part[0] += qg[e] * k[e];
    float s = 0.f;
    for (int l = 0; l < LANES; ++l) s += part[l];
    out[g * ld] = s * scale;
  }
}

// acc[g * d + e] += p[g * ld] * v[e] for g < group, e < d
STEP_OPS_CLONES void axpys(const float* p, int64_t ld, int64_t group, const float* v, int64_t d, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    const float pg = p[g * ld];
    float* a = acc + g * d;
    for (int64_t e = 0; e < d; ++e) a[e] += pg * v[e];
  }
}

// row j of rows (float32, or bfloat16 where bf16) -> out [d] float32
void row_to_float(const void* rows, int64_t off, int bf16, int64_t d, float* out) {
  if (bf16) {
    const c10::BFloat16* r = static_cast<const c10::BFloat16*>(rows) + off;
    for (int64_t e = 0; e < d; ++e) out[e] = static_cast<float>(r[e]);
  } else {
    const float* r = static_cast<const float*>(rows) + off;
    std::copy(r, r + d, out);
  }
}

void plain_scores(const float* q, int64_t group, int64_t d, const void* k, int64_t ld, int bf16, int64_t n, float scale,
                  float* s, int64_t lds, float* scratch) {
  for (int64_t j = 0; j < n; ++j) {
    row_to_float(k, j * ld, bf16, d, scratch);
    dots(q, group, scratch, d, scale, s + j, lds);
  }
}

float plain_max(const float* s, int64_t n) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

float plain_exp(float* s, int64_t n, float m, int round_bf16) {
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(s[j] - m);
    total += e;
    s[j] = round_bf16 ? round_to<c10::BFloat16>(e) : e;
  }
  return total;
}

void plain_values(const float* p, int64_t ldp, int64_t group, const void* v, int64_t ld, int bf16, int64_t n, int64_t d,
                  float* acc) {
  std::vector<float> row(d);
  for (int64_t j = 0; j < n; ++j) {
    row_to_float(v, j * ld, bf16, d, row.data());
    axpys(p + j, ldp, group, row.data(), d, acc);
  }
}

struct AttnFns {
  void (*scores)(const float*, int64_t, int64_t, const void*, int64_t, int, int64_t, float, float*, int64_t, float*);
  float (*max)(const float*, int64_t);
  float (*exp)(float*, int64_t, float, int);
  void (*values)(const float*, int64_t, int64_t, const void*, int64_t, int, int64_t, int64_t, float*);
};

// The inner loops of `variant` ("avx512", "avx2", or "plain") for head dim d: the plain ones where the
// variant's do not take d.
AttnFns attn_fns(const std::string& variant, int64_t d) {
  const AttnFns plain{plain_scores, plain_max, plain_exp, plain_values};
  if (variant == "plain") return plain;
  TORCH_CHECK(supports_variant(variant), "variant: ", variant, " is not supported by this CPU or build");
#ifdef MOEMESH_X86_KERNELS
  if (d % ATTN_D_MULTIPLE == 0) {
    if (variant == "avx512") return {avx512::attn_scores, avx512::attn_max, avx512::attn_exp, avx512::attn_values};
    return {avx2::attn_scores, avx2::attn_max, avx2::attn_exp, avx2::attn_values};
  }
#endif
  return plain;
}

// A work item: attended positions [a0, a1) of sequence `item`, for every key/value head and its G query
// heads (each cached row is read once for all of them).
struct Unit {
  int64_t item, a0, a1;
};

// fn(first attended index, cache row, rows) over attended positions [a0, a1) of a sequence whose
// position a is cache row rows[a] (block * BS + offset), up to ATTN_ROWS consecutive cache rows at a
// time (rows of one block are contiguous), so that every head of them is read while they are in L1.
// (Requesting each row 4 to 128 positions ahead with software prefetches made no difference on this
// machine, with the caches flushed or not.)
template <typename Fn>
void for_rows(const int64_t* rows, int64_t a0, int64_t a1, Fn fn) {
  for (int64_t a = a0; a < a1;) {
    int64_t len = 1;
    while (len < ATTN_ROWS && a + len < a1 && rows[a + len] == rows[a] + len) ++len;
    fn(a, rows[a], len);
    a += len;
  }
}

}  // namespace

// One decode step's attention over the paged KV cache, for B sequences of one query token each (the
// decode rows of moemesh/models/attention.paged_attention):
//   q [B, NH, D], k / v [B, KVH, D] this step's keys and values (unit stride along D), written first
//   into k_cache / v_cache [NBLK, BS, KVH, D] (contiguous) at slots [B] (flat block * BS + offset);
//   tables [B, NB] each sequence's blocks, mask [B, NB*BS] bool (true = attend) -> [B, NH, D].
// Query head h reads key/value head h / (NH / KVH). Scores in float32 scaled by D^-0.5, softmax over
// the attended positions, the probabilities rounded to the dtype before they weight V (as torch's
// CPU flash-attention kernel, which SDPA runs here, rounds them), divided by their float32 sum.
//
// Work split: each sequence's attended positions are cut into units of about equal size (every head
// of them in one unit, so that a unit reads whole cached rows, one block after another), enough of
// them to keep every thread busy at batch 1. Two passes over the units: the scores (and each unit's
// maximum per query head), then, against the sequence's maximum over all its units, the
// exponentials, their sum and p.V. Every probability is thus exp(score - the global maximum), rounded
// where the single-pass softmax rounds it; only the order of the float32 sums differs (the units'
// partial sums and accumulators are added at the end).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& tables,
                            const at::Tensor& mask, const std::string& variant) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "q: expected float32 or bfloat16, got ", dt);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: expected [B, heads, D]");
  const int64_t b_n = q.size(0), nh = q.size(1), d = q.size(2), kvh = k.size(1);
  TORCH_CHECK(k.size(0) == b_n && v.size(0) == b_n && v.size(1) == kvh && k.size(2) == d && v.size(2) == d && kvh > 0 &&
                  nh % kvh == 0,
              "k, v: expected [", b_n, ", KVH, ", d, "] with KVH dividing ", nh, ", got ", k.sizes(), " and ", v.sizes());
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == dt && t->stride(2) == 1 && t->device().is_cpu(), "q, k, v: one dtype, unit stride along D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kvh && k_cache.size(3) == d && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && k_cache.scalar_type() == dt &&
                  v_cache.scalar_type() == dt,
              "k_cache, v_cache: expected contiguous [blocks, block size, ", kvh, ", ", d, "] of ", dt);
  const int64_t nblk = k_cache.size(0), bs = k_cache.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == b_n && slots.is_contiguous(),
              "slots: expected [", b_n, "] int64");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == b_n && tables.is_contiguous(),
              "tables: expected [", b_n, ", NB] int64");
  const int64_t nb = tables.size(1), s_n = nb * bs;
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == b_n && mask.size(1) == s_n &&
                  mask.is_contiguous(),
              "mask: expected [", b_n, ", ", s_n, "] bool");
  const AttnFns fns = attn_fns(variant, d);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < b_n; ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < nblk * bs, "slots: ", sl[i], " out of range");
  for (int64_t i = 0; i < b_n * nb; ++i) TORCH_CHECK(tb[i] >= 0 && tb[i] < nblk, "tables: block ", tb[i], " out of range");
  at::Tensor out = at::empty({b_n, nh, d}, q.options());
  const bool* mp = mask.data_ptr<bool>();
  const int64_t group = nh / kvh, row = kvh * d;  // cache elements per position
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));

  // each sequence's attended positions in order, as cache rows (block * BS + offset)
  std::vector<int64_t> n_att(b_n, 0), rows_off(b_n + 1, 0), rows;
  for (int64_t i = 0; i < b_n; ++i) {
    for (int64_t j = 0; j < s_n; ++j)
      if (mp[i * s_n + j]) rows.push_back(tb[i * nb + j / bs] * bs + j % bs);
    rows_off[i + 1] = static_cast<int64_t>(rows.size());
    n_att[i] = rows_off[i + 1] - rows_off[i];
  }

  // units of about equal size, about 4 per thread in all (at least 32 positions each)
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  int64_t total_rows = 0;
  for (int64_t i = 0; i < b_n; ++i) total_rows += n_att[i];
  const int64_t chunk = std::max<int64_t>(32, (total_rows + 4 * nt - 1) / (4 * nt));
  std::vector<Unit> units;
  std::vector<int64_t> unit_begin(b_n + 1, 0), sc_off(b_n + 1, 0);
  for (int64_t i = 0; i < b_n; ++i) {
    const int64_t n = n_att[i];
    unit_begin[i] = static_cast<int64_t>(units.size());
    const int64_t parts = (n + chunk - 1) / chunk;
    for (int64_t p = 0; p < parts; ++p) units.push_back({i, n * p / parts, n * (p + 1) / parts});
    sc_off[i + 1] = sc_off[i] + nh * n;
  }
  unit_begin[b_n] = static_cast<int64_t>(units.size());
  const int64_t u_n = static_cast<int64_t>(units.size());
  // per sequence [NH, n] scores, then probabilities; per unit and query head its maximum, sum and p.V
  const std::unique_ptr<float[]> sc(new float[sc_off[b_n]]);  // every element written in pass 1 before it is read
  std::vector<float> umax(u_n * nh), usum(u_n * nh), uacc(u_n * nh * d), gmax(b_n * nh);
  const int64_t grain = total_rows * nh * d < (1 << 16) ? std::max<int64_t>(u_n, 1) : 1;  // small steps on one thread

  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "decode_attention", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t i = 0; i < b_n; ++i)
      for (int64_t h = 0; h < kvh; ++h) {
        const scalar_t* ks = k.data_ptr<scalar_t>() + i * k.stride(0) + h * k.stride(1);
        const scalar_t* vs = v.data_ptr<scalar_t>() + i * v.stride(0) + h * v.stride(1);
        std::copy(ks, ks + d, kc + sl[i] * row + h * d);
        std::copy(vs, vs + d, vc + sl[i] * row + h * d);
      }
    const int bf16 = std::is_same<scalar_t, c10::BFloat16>::value;
    const scalar_t* qp = q.data_ptr<scalar_t>();
    // pass 1: scores of each unit's positions, and the unit's maximum per query head
    at::parallel_for(0, u_n, grain, [&](int64_t u0, int64_t u1) {
      std::vector<float> qf(nh * d), scratch(ATTN_ROWS * d);
      for (int64_t u = u0; u < u1; ++u) {
        const Unit& un = units[u];
        const int64_t i = un.item, n = n_att[i];
        for (int64_t hq = 0; hq < nh; ++hq) {
          const scalar_t* qr = qp + i * q.stride(0) + hq * q.stride(1);
          for (int64_t e = 0; e < d; ++e) qf[hq * d + e] = to_float(qr[e]);
        }
        float* s = sc.get() + sc_off[i];
        for_rows(rows.data() + rows_off[i], un.a0, un.a1, [&](int64_t a, int64_t pos, int64_t len) {
          for (int64_t h = 0; h < kvh; ++h)
            fns.scores(qf.data() + h * group * d, group, d, kc + pos * row + h * d, row, bf16, len, scale,
                       s + h * group * n + a, n, scratch.data());
        });
        for (int64_t hq = 0; hq < nh; ++hq) umax[u * nh + hq] = fns.max(s + hq * n + un.a0, un.a1 - un.a0);
      }
    });
    for (int64_t i = 0; i < b_n; ++i)
      for (int64_t hq = 0; hq < nh; ++hq) {
        float m = -INFINITY;
        for (int64_t u = unit_begin[i]; u < unit_begin[i + 1]; ++u) m = std::max(m, umax[u * nh + hq]);
        gmax[i * nh + hq] = m;
      }
    // pass 2: probabilities against the sequence's maximum per query head, their sums and p.V per unit
    at::parallel_for(0, u_n, grain, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const Unit& un = units[u];
        const int64_t i = un.item, n = n_att[i];
        float* s = sc.get() + sc_off[i];
        for (int64_t hq = 0; hq < nh; ++hq)
          usum[u * nh + hq] = fns.exp(s + hq * n + un.a0, un.a1 - un.a0, gmax[i * nh + hq], bf16);
        float* acc = uacc.data() + u * nh * d;
        std::fill(acc, acc + nh * d, 0.f);
        for_rows(rows.data() + rows_off[i], un.a0, un.a1, [&](int64_t a, int64_t pos, int64_t len) {
          for (int64_t h = 0; h < kvh; ++h)
            fns.values(s + h * group * n + a, n, group, vc + pos * row + h * d, row, bf16, len, d, acc + h * group * d);
        });
      }
    });
    // the units' partial sums and accumulators added, in unit order
    scalar_t* op = out.data_ptr<scalar_t>();
    std::vector<float> acc(d);
    for (int64_t i = 0; i < b_n; ++i)
      for (int64_t hq = 0; hq < nh; ++hq) {
        float total = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t u = unit_begin[i]; u < unit_begin[i + 1]; ++u) {
          total += usum[u * nh + hq];
          const float* a = uacc.data() + (u * nh + hq) * d;
          for (int64_t e = 0; e < d; ++e) acc[e] += a[e];
        }
        scalar_t* o = op + (i * nh + hq) * d;
        for (int64_t e = 0; e < d; ++e) o[e] = from_float<scalar_t>(n_att[i] == 0 ? 0.f : acc[e] / total);
      }
  });
  return out;
}

// the GIL is released while they run, as for the expert kernels
void bind_step_ops(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "x [..., D] -> RMSNorm(x) * weight (weight [D] or [R, D] for x [T, R, D])",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "x, residual [T, D] -> (x + residual, RMSNorm(x + residual) * weight)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("qk_norm_rope", &qk_norm_rope,
        "heads [T, R, D] -> per-row RMSNorm * weight [R, D] (none where weight is None), then rope with cos, sin_signed [T, D]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_attention", &decode_attention,
        "q [B, NH, D], k, v [B, KVH, D] -> [B, NH, D]: this step's keys and values written into the paged cache, then attention "
        "over it, on the inner loops of variant (avx512, avx2, plain)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_logsumexp", &argmax_logsumexp,
        "logits [B, V] float32 -> (each row's first argmax [B] int64, its value [B], the row's logsumexp [B] float32: NaN "
        "for a row with NaN, +inf or only -inf)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("route_topk", &route_topk, "router_logits [T, E] -> softmax top-k dropless plan (token_idx, weights, expert_ids, counts)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace moemesh_cpu
