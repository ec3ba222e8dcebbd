// The quantizers of the expert weight formats (kernels/formats), compiled: each row of the weight is
// read once (FP8: once per pass over its block row, which stays in cache) and the stored bytes are
// written directly, where the torch reference makes many elementwise passes over float32 copies.
// Every value is computed as the torch code computes it (same float32 operations, same rounding),
// so the bytes are identical:
//   MXFP4  block maxima of |w| over 32 elements; E8M0 exponent floor(log2(amax)) - 2 clamped to
//          [-127, 127] (all-zero block: -127, byte 0); elements times exactly 2^-exponent, E2M1
//          encoded (kernels/formats/e2m1.py: half to even on the code, saturated at 6, sign bit of
//          the input) and packed two per byte, element 2i in the low nibble.
//   NVFP4  block maxima over 16 elements (the per-tensor scales follow in torch from these), then
//          per row the e4m3 block scales and each element times (1 / tensor scale) / block scale,
//          E2M1 encoded and packed.
//   FP8    per BN x BK block of each row segment: scale = amax / 448 (1 for an all-zero block);
//          elements w / scale, clamped to +-448, converted to e4m3fn by c10's rounding (half to even).
// Inputs are float32 or bfloat16 [E, N, K] with unit stride along K (any row strides). Non-finite
// values are reported (the return value), not thrown: the Python caller raises its own ValueError.
// Rows are split over torch's threads with at::parallel_for; the GIL is released while they run. The
// row loops are compiled for AVX-512, AVX2 and the x86-64 baseline and chosen at load time by the CPU
// (GCC function multi-versioning, as step_ops.cpp's), so the compiler vectorizes them for the CPU.
//
// Shape legend: E experts, N rows per expert, R = E*N rows, K row length (logical), KB blocks per
// row, S row segments, NB block rows per segment (FP8), BN x BK the FP8 block.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "api.h"

namespace moemesh_cpu {
namespace {

#ifdef MOEMESH_X86_KERNELS
#define QUANT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define QUANT_CLONES
#endif
// the helpers are inlined into each clone, so that they are compiled for its instruction set
#define QUANT_INLINE inline __attribute__((always_inline))

constexpr uint32_t ABS_MASK = 0x7FFFFFFFu;
constexpr uint32_t INF_BITS = 0x7F800000u;  // |x| bits at or above: inf or NaN
constexpr uint32_t MIN_NORMAL_BITS = 0x00800000u;
constexpr int64_t MX_BLOCK = 32;
constexpr int64_t NV_BLOCK = 16;
constexpr int E8M0_BIAS = 127;
constexpr float FP8_MAX = 448.0f;

QUANT_INLINE uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}
QUANT_INLINE float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}
QUANT_INLINE float load(const float* x, int64_t i) { return x[i]; }
QUANT_INLINE float load(const c10::BFloat16* x, int64_t i) { return float_of(uint32_t(x[i].x) << 16); }

// The largest |x| bits over x[a, b): the bits of max |x| where all are finite (|x| bits order as the
// values do), INF_BITS or more where one is inf or NaN. Elements past the row's end count as zero.
template <typename T>
QUANT_INLINE uint32_t abs_max_bits(const T* x, int64_t a, int64_t b) {
  uint32_t m = 0;
  for (int64_t i = a; i < b; ++i) m = std::max(m, bits_of(load(x, i)) & ABS_MASK);
  return m;
}

// e2m1.py encode_e2m1: |v| clamped to 6; from 1 up the float32 mantissa rounded to its top bit (half
// to even) gives the code from the exponent and that bit; below 1, adding 2^22 (ulp 0.5) rounds half
// to even to a multiple of 0.5. The sign bit is v's (so -0 and negatives rounding to 0 give code 8).
QUANT_INLINE uint32_t e2m1_code(float v) {
  const uint32_t vb = bits_of(v);
  const float mag = std::min(float_of(vb & ABS_MASK), 6.0f);
  const uint32_t mb = bits_of(mag);
  const uint32_t normal = (mb + ((mb >> 22) & 1u) + (0x1FFFFFu - (252u << 22))) >> 22;
  const uint32_t small = bits_of(mag + 4194304.0f) - 0x4A800000u;
  return (mag < 1.0f ? small : normal) | ((vb >> 28) & 8u);
}

// x[a, a + B) times its multiplier (mult[i / SUB] for element a + i: one per block of SUB), E2M1
// encoded and packed into B / 2 bytes (zero past k, the torch path's padding). NVFP4 encodes two
// blocks of 16 per call (B 32, SUB 16), so that its loop vectorizes as MXFP4's does.
template <int64_t B, int64_t SUB, typename T>
QUANT_INLINE void encode_block(const T* x, int64_t a, int64_t k, const float* mult, uint8_t* out) {
  float v[B];
  if (a + B <= k) {
    for (int64_t i = 0; i < B; ++i) v[i] = load(x, a + i) * mult[i / SUB];
  } else {
    for (int64_t i = 0; i < B; ++i) v[i] = a + i < k ? load(x, a + i) * mult[i / SUB] : 0.0f;
  }
  uint32_t c[B];
  for (int64_t i = 0; i < B; ++i) c[i] = e2m1_code(v[i]);
  for (int64_t j = 0; j < B / 2; ++j) out[j] = uint8_t(c[2 * j] | (c[2 * j + 1] << 4));
}

// c10's float -> float8_e4m3fn rounding (half to even) for |v| <= 448, where it never saturates:
// below 2^-6 (e4m3's smallest normal) adding 2^14, whose float32 ulp is 2^-9 (e4m3's subnormal step),
// rounds to the subnormal code; above, the float32 bits rounded at mantissa bit 20 (half to even) and
// rebiased are the code. Both are computed and one chosen by a mask.
QUANT_INLINE uint8_t e4m3_code(float v) {
  const uint32_t vb = bits_of(v);
  const uint32_t sign = vb & 0x80000000u;
  const uint32_t f = vb ^ sign;
  constexpr uint32_t denorm_mask = 141u << 23;
  const uint32_t sub = bits_of(float_of(f) + float_of(denorm_mask)) - denorm_mask;
  const uint32_t norm = (f + (uint32_t(7 - 127) << 23) + 0x7FFFFu + ((f >> 20) & 1u)) >> 20;
  const uint32_t below = 0u - uint32_t(f < (121u << 23));
  return uint8_t((sub & below) | (norm & ~below) | (sign >> 24));
}

// e4m3 of v clamped to +-448. The clamp is on |v| with v's sign put back (the same value for finite
// v, -0 kept): GCC vectorizes this form (not a clamp feeding the float add above directly).
QUANT_INLINE uint8_t e4m3_clamped_code(float v) {
  const uint32_t vb = bits_of(v);
  const uint32_t sign = vb & 0x80000000u;
  const float mag = std::min(float_of(vb ^ sign), FP8_MAX);
  return e4m3_code(float_of(bits_of(mag) | sign));
}

// out[i] = e4m3 of clamp(x[i] / s, +-448) for i < n (x and out never overlap: restrict lets it vectorize)
template <typename T>
QUANT_INLINE void e4m3_span(const T* __restrict x, int64_t n, float s, uint8_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = e4m3_clamped_code(load(x, i) / s);
}

// Row r of w [E, N, K] (unit stride along K).
template <typename T>
struct RowsOf {
  const T* base;
  int64_t n, s0, s1;
  explicit RowsOf(const at::Tensor& w)
      : base(static_cast<const T*>(w.data_ptr())), n(w.size(1)), s0(w.stride(0)), s1(w.stride(1)) {}
  const T* operator()(int64_t r) const { return base + (r / n) * s0 + (r % n) * s1; }
};

// Rows [r0, r1) to MXFP4: blocks [R, KB, 16], scales [R, KB]; false where one holds inf or NaN.
template <typename T>
QUANT_INLINE bool mxfp4_span_impl(const RowsOf<T>& rows, int64_t k, int64_t r0, int64_t r1, uint8_t* blocks, uint8_t* scales) {
  const int64_t kb = (k + MX_BLOCK - 1) / MX_BLOCK;
  bool ok = true;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = rows(r);
    for (int64_t b = 0; b < kb; ++b) {
      const int64_t a = b * MX_BLOCK;
      const uint32_t m = abs_max_bits(x, a, std::min(k, a + MX_BLOCK));
      ok = ok && m < INF_BITS;
      // floor(log2(amax)) = biased exponent - 127 for a normal amax; zero and subnormal maxima give
      // an exponent below -127, clamped to it (as mxfp4_scale_exponent)
      const int exp = m < MIN_NORMAL_BITS ? -E8M0_BIAS : std::max(-E8M0_BIAS, int(m >> 23) - E8M0_BIAS - 2);
      scales[r * kb + b] = uint8_t(exp + E8M0_BIAS);
      const float mult = float_of(uint32_t(E8M0_BIAS - exp) << 23);  // 2^-exp, -exp in [-125, 127]: normal
      encode_block<MX_BLOCK, MX_BLOCK>(x, a, k, &mult, blocks + (r * kb + b) * (MX_BLOCK / 2));
    }
  }
  return ok;
}

// Rows [r0, r1): out [R, KB] float32, max |x| per block of `block`; false where one holds inf or NaN.
template <typename T>
QUANT_INLINE bool absmax_span_impl(const RowsOf<T>& rows, int64_t k, int64_t block, int64_t r0, int64_t r1, float* out) {
  const int64_t kb = (k + block - 1) / block;
  bool ok = true;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = rows(r);
    for (int64_t b = 0; b < kb; ++b) {
      const uint32_t m = abs_max_bits(x, b * block, std::min(k, (b + 1) * block));
      ok = ok && m < INF_BITS;
      out[r * kb + b] = float_of(m);
    }
  }
  return ok;
}

// The value of a non-negative, finite e4m3 byte (at most 0x7E): subnormal (exponent field 0) m * 2^-9,
// else the float32 with the same exponent and mantissa bits. Branch-free, so the scale loop vectorizes.
QUANT_INLINE float e4m3_value(uint32_t byte) {
  const uint32_t e = (byte >> 3) & 15u, m = byte & 7u;
  const float sub = float(m) * 0.001953125f;
  const float norm = float_of(((e + 120u) << 23) | (m << 20));
  return e == 0 ? sub : norm;
}

// Rows [r0, r1) to NVFP4, given the block maxima bmax [R, KB] and the tensor scale of each row's
// expert and segment (s2 [E, S]): block scale byte e4m3(min(bmax / 6 / s2, 448)), 1.0 (0x38) where
// that is 0, into scale [R, KB]; elements times (1 / s2) / block scale, E2M1 encoded into out
// [R, KB, 8], two blocks of 16 per step. The float32 operations are quantize_nvfp4's, in its order.
template <typename T>
QUANT_INLINE void nvfp4_span_impl(const RowsOf<T>& rows, int64_t k, int64_t seg_rows, int64_t segments, int64_t r0, int64_t r1,
                                  const float* bmax, const float* s2, float* mult, uint8_t* scale, uint8_t* out) {
  const int64_t kb = (k + NV_BLOCK - 1) / NV_BLOCK;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t e = r / rows.n, seg = (r % rows.n) / seg_rows;
    const float t = s2[e * segments + seg], inv = 1.0f / t;
    const float* bm = bmax + r * kb;
    uint8_t* sc = scale + r * kb;
    for (int64_t b = 0; b < kb; ++b) {
      const uint32_t byte = e4m3_clamped_code((bm[b] / 6.0f) / t);
      const float value = e4m3_value(byte);
      const bool zero = !(value > 0.0f);
      sc[b] = uint8_t(zero ? 0x38u : byte);  // 0x38: e4m3 1.0
      mult[b] = inv / (zero ? 1.0f : value);
    }
    const T* x = rows(r);
    uint8_t* o = out + r * kb * (NV_BLOCK / 2);
    int64_t b = 0;
    for (; b + 2 <= kb; b += 2) encode_block<2 * NV_BLOCK, NV_BLOCK>(x, b * NV_BLOCK, k, mult + b, o + b * (NV_BLOCK / 2));
    if (b < kb) encode_block<NV_BLOCK, NV_BLOCK>(x, b * NV_BLOCK, k, mult + b, o + b * (NV_BLOCK / 2));
  }
}

// One FP8 block row: rows [first, first + count) of R, blocks of bk columns. m [KB] and s [KB] are
// scratch; s gets the block scales (scale_out [KB] too), q [R, K] the e4m3 bytes. False on inf or NaN.
template <typename T>
QUANT_INLINE bool fp8_block_row_impl(const RowsOf<T>& rows, int64_t k, int64_t bk, int64_t first, int64_t count, uint32_t* m,
                                     float* s, float* scale_out, uint8_t* q) {
  const int64_t kb = (k + bk - 1) / bk;
  std::fill(m, m + kb, 0u);
  for (int64_t r = first; r < first + count; ++r) {
    const T* x = rows(r);
    for (int64_t b = 0; b < kb; ++b) m[b] = std::max(m[b], abs_max_bits(x, b * bk, std::min(k, (b + 1) * bk)));
  }
  bool ok = true;
  for (int64_t b = 0; b < kb; ++b) {
    ok = ok && m[b] < INF_BITS;
    s[b] = m[b] > 0 ? float_of(m[b]) / FP8_MAX : 1.0f;  // amax / 448; 1 for an all-zero block
    scale_out[b] = s[b];
  }
  for (int64_t r = first; r < first + count; ++r) {
    const T* x = rows(r);
    uint8_t* out = q + r * k;
    for (int64_t b = 0; b < kb; ++b) {
      const float sb = s[b];
      const int64_t end = std::min(k, (b + 1) * bk);
      e4m3_span(x + b * bk, end - b * bk, sb, out + b * bk);
    }
  }
  return ok;
}

// The multi-versioned entry points, one overload per input type (GCC clones plain functions, not templates).
#define QUANT_SPANS(T)                                                                                         \
  QUANT_CLONES bool mxfp4_span(const RowsOf<T>& rows, int64_t k, int64_t r0, int64_t r1, uint8_t* b, uint8_t* s) { \
    return mxfp4_span_impl(rows, k, r0, r1, b, s);                                                             \
  }                                                                                                            \
  QUANT_CLONES bool absmax_span(const RowsOf<T>& rows, int64_t k, int64_t block, int64_t r0, int64_t r1, float* o) { \
    return absmax_span_impl(rows, k, block, r0, r1, o);                                                        \
  }                                                                                                            \
  QUANT_CLONES void nvfp4_span(const RowsOf<T>& rows, int64_t k, int64_t seg_rows, int64_t segments, int64_t r0, int64_t r1, \
                               const float* bmax, const float* s2, float* mult, uint8_t* scale, uint8_t* o) {      \
    nvfp4_span_impl(rows, k, seg_rows, segments, r0, r1, bmax, s2, mult, scale, o);                            \
  }                                                                                                            \
  QUANT_CLONES bool fp8_block_row(const RowsOf<T>& rows, int64_t k, int64_t bk, int64_t first, int64_t count, uint32_t* m, \
                                  float* s, float* scale_out, uint8_t* q) {                                    \
    return fp8_block_row_impl(rows, k, bk, first, count, m, s, scale_out, q);                                  \
  }
QUANT_SPANS(float)
QUANT_SPANS(c10::BFloat16)
#undef QUANT_SPANS

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && w.numel() > 0, "w: expected a non-empty CPU [E, N, K] tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w: expected float32 or bfloat16");
  TORCH_CHECK(w.stride(2) == 1, "w: expected unit stride along K");
}

void check_out(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel, name,
              ": expected a contiguous CPU tensor of ", numel, " elements of ", dtype);
}

// Rows per parallel work item: about 64K elements, so a thread's share is whole cache-sized pieces.
int64_t grain_rows(int64_t k) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k)); }

// Runs fn(rows, r0, r1) -> bool over all rows of w in parallel; true unless one call returned false.
template <typename T, typename Fn>
bool over_rows(const at::Tensor& w, Fn fn) {
  const RowsOf<T> rows(w);
  std::atomic<bool> finite{true};
  at::parallel_for(0, w.size(0) * w.size(1), grain_rows(w.size(2)), [&](int64_t r0, int64_t r1) {
    if (!fn(rows, r0, r1)) finite = false;
  });
  return finite;
}

// w [E, N, K] -> blocks [R, KB, 16] uint8, scales [R, KB] uint8 (written); false where w holds inf or NaN.
bool quantize_mxfp4(const at::Tensor& w, at::Tensor& blocks, at::Tensor& scales) {
  check_weight(w);
  const int64_t r_all = w.size(0) * w.size(1), k = w.size(2), kb = (k + MX_BLOCK - 1) / MX_BLOCK;
  check_out(blocks, at::kByte, r_all * kb * (MX_BLOCK / 2), "blocks");
  check_out(scales, at::kByte, r_all * kb, "scales");
  auto* b = blocks.data_ptr<uint8_t>();
  auto* s = scales.data_ptr<uint8_t>();
  auto fn = [&](const auto& rows, int64_t r0, int64_t r1) { return mxfp4_span(rows, k, r0, r1, b, s); };
  return w.scalar_type() == at::kFloat ? over_rows<float>(w, fn) : over_rows<c10::BFloat16>(w, fn);
}

// w [E, N, K] -> out [R, KB] float32: max |w| over each block of `block` elements along K (written);
// false where w holds inf or NaN (those blocks' maxima are then not meaningful).
bool block_absmax(const at::Tensor& w, int64_t block, at::Tensor& out) {
  check_weight(w);
  TORCH_CHECK(block >= 1, "block: must be positive");
  const int64_t r_all = w.size(0) * w.size(1), k = w.size(2), kb = (k + block - 1) / block;
  check_out(out, at::kFloat, r_all * kb, "out");
  auto* o = out.data_ptr<float>();
  auto fn = [&](const auto& rows, int64_t r0, int64_t r1) { return absmax_span(rows, k, block, r0, r1, o); };
  return w.scalar_type() == at::kFloat ? over_rows<float>(w, fn) : over_rows<c10::BFloat16>(w, fn);
}

// w [E, N, K] (S row segments), bmax [R, KB] float32 (block_absmax, blocks of 16), s2 [E, S]
// float32 tensor scales -> out [R, KB, 8] packed E2M1 and scale [R, KB] e4m3 block scale bytes (written).
void nvfp4_encode(const at::Tensor& w, int64_t segments, const at::Tensor& bmax, const at::Tensor& s2, at::Tensor& out,
                  at::Tensor& scale) {
  check_weight(w);
  TORCH_CHECK(segments >= 1 && w.size(1) % segments == 0, "segments: must divide the row count");
  const int64_t r_all = w.size(0) * w.size(1), k = w.size(2), kb = (k + NV_BLOCK - 1) / NV_BLOCK;
  const int64_t seg_rows = w.size(1) / segments;
  check_out(bmax, at::kFloat, r_all * kb, "bmax");
  check_out(s2, at::kFloat, w.size(0) * segments, "s2");
  check_out(out, at::kByte, r_all * kb * (NV_BLOCK / 2), "out");
  check_out(scale, at::kByte, r_all * kb, "scale");
  const float* bm = bmax.data_ptr<float>();
  const float* t = s2.data_ptr<float>();
  auto* o = out.data_ptr<uint8_t>();
  auto* sc = scale.data_ptr<uint8_t>();
  auto fn = [&](const auto& rows, int64_t r0, int64_t r1) {
    std::vector<float> mult(kb);
    nvfp4_span(rows, k, seg_rows, segments, r0, r1, bm, t, mult.data(), sc, o);
    return true;
  };
  if (w.scalar_type() == at::kFloat)
    over_rows<float>(w, fn);
  else
    over_rows<c10::BFloat16>(w, fn);
}

template <typename T>
bool fp8_rows(const at::Tensor& w, int64_t segments, int64_t bn, int64_t bk, uint8_t* q, float* scale) {
  const RowsOf<T> rows(w);
  const int64_t e_all = w.size(0), n = w.size(1), k = w.size(2), seg_rows = n / segments;
  const int64_t nb = (seg_rows + bn - 1) / bn, kb = (k + bk - 1) / bk;
  std::atomic<bool> finite{true};
  // one work item: one block row (up to BN rows of one segment of one expert), all of K
  at::parallel_for(0, e_all * segments * nb, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint32_t> m(kb);
    std::vector<float> s(kb);
    bool ok = true;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t e = item / (segments * nb), seg = item / nb % segments, rb = item % nb;
      const int64_t first = e * n + seg * seg_rows + rb * bn;  // row index in [R]
      // scale [E, S * NB, KB]: row (e * S + seg) * NB + rb, which is `item`
      ok = fp8_block_row(rows, k, bk, first, std::min(bn, seg_rows - rb * bn), m.data(), s.data(), scale + item * kb, q) && ok;
    }
    if (!ok) finite = false;
  });
  return finite;
}

// w [E, N, K] (N = S segments of equal rows, each blocked apart) -> q [E, N, K] e4m3 bytes and
// scale [E, S * NB, KB] float32 multipliers (written); false where w holds inf or NaN.
bool quantize_fp8_block(const at::Tensor& w, int64_t segments, int64_t bn, int64_t bk, at::Tensor& q, at::Tensor& scale) {
  check_weight(w);
  TORCH_CHECK(segments >= 1 && w.size(1) % segments == 0, "segments: must divide the row count");
  TORCH_CHECK(bn >= 1 && bk >= 1, "block: must be positive");
  const int64_t e = w.size(0), n = w.size(1), k = w.size(2);
  const int64_t nb = (n / segments + bn - 1) / bn, kb = (k + bk - 1) / bk;
  check_out(q, at::kByte, e * n * k, "q");
  check_out(scale, at::kFloat, e * segments * nb * kb, "scale");
  auto* qp = q.data_ptr<uint8_t>();
  auto* sp = scale.data_ptr<float>();
  return w.scalar_type() == at::kFloat ? fp8_rows<float>(w, segments, bn, bk, qp, sp)
                                       : fp8_rows<c10::BFloat16>(w, segments, bn, bk, qp, sp);
}

}  // namespace

void bind_quantize(pybind11::module_& m) {
  m.def("quantize_mxfp4", &quantize_mxfp4, "w [E, N, K] -> MXFP4 blocks [R, KB, 16] and E8M0 scales [R, KB] (written); false on inf/NaN",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_absmax", &block_absmax, "w [E, N, K] -> max |w| per block along K [R, KB] (written); false on inf/NaN",
        py::call_guard<py::gil_scoped_release>());
  m.def("nvfp4_encode", &nvfp4_encode,
        "w [E, N, K], block maxima [R, KB], tensor scales [E, S] -> packed E2M1 [R, KB, 8] and e4m3 block scales [R, KB] (written)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_fp8_block", &quantize_fp8_block,
        "w [E, N, K] -> e4m3 bytes [E, N, K] and float32 scales [E, S * NB, KB] (written); false on inf/NaN",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace moemesh_cpu
