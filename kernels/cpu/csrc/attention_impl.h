// Decode attention's inner loops (api.h: ATTENTION_FUNCTIONS), written once over the SIMD traits `V`
// and compiled once per instruction set: isa_avx512.cpp and isa_avx2.cpp include this file after
// kernel_impl.h (whose `vexp` the softmax uses), inside their target pragma. step_ops.cpp checks the
// inputs, writes the cache, splits the work and calls these on runs of cached rows.
//
// Shape legend: G query heads sharing one key/value head (group), D head dim (a multiple of W and
// of ATTN_D_MULTIPLE), n cached rows of a run, P = ATTN_ROWS rows per score block, W lanes.
//
// Scores: P key rows are converted to float32 once into a scratch block [P, D], then each query head
// runs P dot products side by side (P accumulators of W lanes) and reduces them together (V::hsum8),
// so that no reduction is paid per (row, head). Values: the accumulators of up to GB query heads x
// up to 4 vectors of D stay in registers over all rows of the run, each value row converted once per
// slab of D and per GB heads.
#include <cmath>

namespace moemesh_cpu {
namespace MOEMESH_ISA {
namespace {

static_assert(ATTN_ROWS == 8, "the score blocks reduce 8 rows at once (V::hsum8)");
static_assert(ATTN_D_MULTIPLE % W == 0, "D is read in whole vectors");

constexpr int ATTN_GB = W == 16 ? 4 : 2;  // query heads whose accumulators p.V keeps in registers
constexpr int ATTN_SLAB = 4;             // vectors of D per slab of p.V

inline F load_row(const void* rows, int64_t off, int bf16) {
  return bf16 ? V::load_bf16(static_cast<const uint16_t*>(rows) + off) : V::load(static_cast<const float*>(rows) + off);
}

// acc[g][c] += p[g * ldp + j] * v_j[e0 + c W] for g < NG, c < NV, j < n
template <int NG, int NV>
void values_slab(const float* p, int64_t ldp, const void* v, int64_t ld, int bf16, int64_t n, int64_t d, int64_t e0,
                 float* acc) {
  F a[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = V::load(acc + g * d + e0 + c * W);
  for (int64_t j = 0; j < n; ++j) {
    F x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load_row(v, j * ld + e0 + c * W, bf16);
    for (int g = 0; g < NG; ++g) {
      const F pg = V::set1(p[g * ldp + j]);
      for (int c = 0; c < NV; ++c) a[g][c] = V::fma(pg, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NV; ++c) V::store(acc + g * d + e0 + c * W, a[g][c]);
}

template <int NG>
void values_heads(const float* p, int64_t ldp, const void* v, int64_t ld, int bf16, int64_t n, int64_t d, float* acc) {
  for (int64_t e0 = 0; e0 < d; e0 += ATTN_SLAB * W) {
    const int64_t nv = (d - e0) / W < ATTN_SLAB ? (d - e0) / W : ATTN_SLAB;
    switch (nv) {
      case 1: values_slab<NG, 1>(p, ldp, v, ld, bf16, n, d, e0, acc); break;
      case 2: values_slab<NG, 2>(p, ldp, v, ld, bf16, n, d, e0, acc); break;
      case 3: values_slab<NG, 3>(p, ldp, v, ld, bf16, n, d, e0, acc); break;
      default: values_slab<NG, ATTN_SLAB>(p, ldp, v, ld, bf16, n, d, e0, acc); break;
    }
  }
}

}  // namespace

void attn_scores(const float* q, int64_t group, int64_t d, const void* k, int64_t ld, int bf16, int64_t n, float scale,
                 float* s, int64_t lds, float* scratch) {
  constexpr int P = ATTN_ROWS;
  for (int64_t j0 = 0; j0 < n; j0 += P) {
    const int np = n - j0 < P ? int(n - j0) : P;
    const float* rows[P];
    for (int r = 0; r < P; ++r) {
      const int64_t j = j0 + (r < np ? r : np - 1);  // a partial block repeats its last row
      if (bf16) {
        float* dst = scratch + r * d;
        if (r < np)
          for (int64_t e = 0; e < d; e += W) V::store(dst + e, V::load_bf16(static_cast<const uint16_t*>(k) + j * ld + e));
        rows[r] = r < np ? dst : rows[np - 1];
      } else {
        rows[r] = static_cast<const float*>(k) + j * ld;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      F acc[P];
      for (int r = 0; r < P; ++r) acc[r] = V::zero();
      for (int64_t e = 0; e < d; e += W) {
        const F x = V::load(qg + e);
        for (int r = 0; r < P; ++r) acc[r] = V::fma(x, V::load(rows[r] + e), acc[r]);
      }
      alignas(32) float sums[P];
      V::hsum8(acc, sums);
      float* out = s + g * lds + j0;
      for (int r = 0; r < np; ++r) out[r] = sums[r] * scale;
    }
  }
}

float attn_max(const float* s, int64_t n) {
  F m = V::set1(-INFINITY);
  int64_t j = 0;
  for (; j + W <= n; j += W) m = V::max(m, V::load(s + j));
  float r = V::hmax(m);
  for (; j < n; ++j) r = s[j] > r ? s[j] : r;
  return r;
}

float attn_exp(float* s, int64_t n, float m, int round_bf16) {
  const F mv = V::set1(m);
  F sum = V::zero();
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const F e = vexp(V::sub(V::load(s + j), mv));
    sum = V::add(sum, e);
    V::store(s + j, round_bf16 ? V::round_bf16(e) : e);
  }
  float total = V::hsum(sum);
  if (j < n) {  // the last partial vector, through a zero-padded copy
    alignas(64) float t[W];
    for (int i = 0; i < W; ++i) t[i] = j + i < n ? s[j + i] : m;
    const F e = vexp(V::sub(V::load(t), mv));
    alignas(64) float et[W], rt[W];
    V::store(et, e);
    V::store(rt, round_bf16 ? V::round_bf16(e) : e);
    for (int64_t i = 0; j + i < n; ++i) {
      total += et[i];
      s[j + i] = rt[i];
    }
  }
  return total;
}

void attn_values(const float* p, int64_t ldp, int64_t group, const void* v, int64_t ld, int bf16, int64_t n, int64_t d,
                 float* acc) {
  int64_t g = 0;
  for (; g + ATTN_GB <= group; g += ATTN_GB) values_heads<ATTN_GB>(p + g * ldp, ldp, v, ld, bf16, n, d, acc + g * d);
  for (; g < group; ++g) values_heads<1>(p + g * ldp, ldp, v, ld, bf16, n, d, acc + g * d);
}

}  // namespace MOEMESH_ISA
}  // namespace moemesh_cpu
