// The AVX-512 kernels (F, BW, VL, DQ with FMA and F16C): SIMD traits for kernel_impl.h.
#include "api.h"
#ifdef MOEMESH_X86_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

namespace moemesh_cpu {
namespace avx512 {
namespace {

struct V {
  using F = __m512;
  static constexpr int W = 16;  // float32 lanes
  static constexpr int NR = 4;  // weight rows per register tile
  static constexpr int MR = 4;  // activation rows per register tile (16 accumulators)
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2n(F n) {  // 2^n for integral n in [-126, 127]
    const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(i, 23));
  }

  // 32 bfloat16 -> 2 x 16 float32 (a bfloat16 is the high half of its float32).
  static void bf16_chunk(const uint16_t* p, F* out) {
    for (int v = 0; v < 2; ++v) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * v)));
      out[v] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
  }

  // 32 e4m3 bytes -> 2 x 16 float32 times `scale`. Byte s.eeee.mmm sign-extended to 16 bits and
  // shifted left by 7 is the float16 s.0eeee.mmm0000000, whose value is the e4m3 value / 2^8
  // (subnormals included), widened exactly by vcvtph2ps.
  static void fp8_chunk(const uint8_t* p, float scale, F* out) {
    const F s = _mm512_set1_ps(scale * 256.0f);
    for (int v = 0; v < 2; ++v) {
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
      h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(short(0xBFFF)));
      out[v] = _mm512_mul_ps(_mm512_cvtph_ps(h), s);
    }
  }

  // n e4m3 bytes -> n float32 times `mult` (the same float16 trick).
  static void e4m3_to_float(const uint8_t* p, int64_t n, float mult, float* out) {
    const F s = _mm512_set1_ps(mult * 256.0f);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);  // the last may be partial
      __m256i h = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(live, p + i));
      h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(short(0xBFFF)));
      _mm512_mask_storeu_ps(out + i, live, _mm512_mul_ps(_mm512_cvtph_ps(h), s));
    }
  }

  // The 4-bit formats against activation rows that hold bfloat16 values (the bfloat16 compute dtype),
  // where the CPU has AVX512-BF16 (the caller checks): E2M1 values are bfloat16 values, so vdpbf16ps
  // multiplies exactly and accumulates in float32, two elements per lane, at half the instructions
  // of a float32 FMA; the block scales are applied once per block after the dot product.
  // Per step of 64 elements (32 bytes): the bytes widened to words, low and high nibbles looked up
  // in a 16-word table of bfloat16 (vpermw) -> 32 even and 32 odd elements; lane i of the products
  // holds bytes 2i, 2i+1, so lanes 0-7 belong to the first 16 bytes (an MXFP4 block of 32) and every
  // 4 lanes to 8 bytes (an NVFP4 block of 16): LPB lanes per block. The activations, prepared as
  // groups of [16 even, 16 odd] float32 (api.h), are narrowed to bfloat16 (exactly) to match.
  // rows(n) -> (bytes of row n, its block multipliers with zeros past the end); kp elements per row.
  static constexpr bool BF16_DOT = true;

  template <int LPB, int MR, int NR_, class Rows>
  __attribute__((target("avx512bf16"))) static void e2m1_bf16_tile(const Rows& rows, int nvalid, const float* x,
                                                                   int64_t ldx, int64_t kp, float* out, int64_t ldo) {
    // the 16 E2M1 values as bfloat16, twice: vpermw reads the low 5 bits of each index, so a whole
    // byte (bit 4 the high nibble's lowest) picks its low nibble's value without masking
    const __m512i table = _mm512_setr_epi32(0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080, 0xBF008000, 0xBFC0BF80,
                                            0xC040C000, 0xC0C0C080, 0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080,
                                            0xBF008000, 0xBFC0BF80, 0xC040C000, 0xC0C0C080);
    __m512i sidx = _mm512_setzero_si512();  // lane i -> block i / LPB of the step
    for (int i = 0; i < 16; ++i) sidx = _mm512_mask_set1_epi32(sidx, __mmask16(1u << i), i / LPB);
    constexpr int BPS = 16 / LPB;  // blocks per step
    const uint8_t* d[NR_];
    const float* s[NR_];
    for (int j = 0; j < NR_; ++j) rows.at(j, d[j], s[j]);
    F acc[MR][NR_];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NR_; ++j) acc[m][j] = zero();
    for (int64_t e0 = 0; e0 < kp; e0 += 64) {
      const int64_t rem = kp - e0 < 64 ? kp - e0 : 64;
      const __mmask32 bytes = rem == 64 ? ~__mmask32(0) : __mmask32((1ull << (rem / 2)) - 1);
      const __mmask16 second = rem > 32 ? 0xFFFF : 0;  // x group 1 (elements 32-63) present
      __m512bh xe[MR], xo[MR];
      for (int m = 0; m < MR; ++m) {
        const float* xr = x + m * ldx + e0;
        xe[m] = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(second, xr + 32), _mm512_loadu_ps(xr));
        xo[m] = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(second, xr + 48), _mm512_loadu_ps(xr + 16));
      }
      for (int j = 0; j < NR_; ++j) {
        const uint8_t* p = d[j] + e0 / 2;
        __builtin_prefetch(p + rows.ahead);  // the same bytes of the next tile's row
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bytes, p));
        const __m512bh we = (__m512bh)_mm512_permutexvar_epi16(b, table);
        const __m512bh wo = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
        const F sv = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(s[j] + (e0 / 64) * BPS)));
        for (int m = 0; m < MR; ++m) {
          const F t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(zero(), we, xe[m]), wo, xo[m]);
          acc[m][j] = fma(t, sv, acc[m][j]);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < nvalid; ++j) out[m * ldo + j] = hsum(acc[m][j]);
  }

  template <int LPB, class Rows, int MR = 4>
  static void e2m1_bf16(const Rows& rows, int nvalid, const float* x, int64_t ldx, int64_t kp, float* out,
                        int64_t ldo, int64_t mr) {
    if constexpr (MR > 1) {
      if (mr < MR) return e2m1_bf16<LPB, Rows, MR - 1>(rows, nvalid, x, ldx, kp, out, ldo, mr);
    }
    e2m1_bf16_tile<LPB, MR, NR>(rows, nvalid, x, ldx, kp, out, ldo);
  }

  // 16 bytes of E2M1 pairs, one scale -> even elements (low nibbles) and odd elements (high
  // nibbles); vpermps reads the low 4 bits of each index from the 16 scaled values.
  static void e2m1_chunk1(const uint8_t* p, float a, F* out) {
    const F lut = _mm512_mul_ps(_mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f), _mm512_set1_ps(a));
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    out[0] = _mm512_permutexvar_ps(d, lut);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
  }

  // 16 bytes of E2M1 pairs -> even elements (low nibbles) and odd elements (high nibbles); bytes
  // 0-7 are scaled by `a`, bytes 8-15 by `b` (one table of the 16 scaled values for each, picked by
  // bit 4 of the vpermt2ps index).
  static void e2m1_chunk(const uint8_t* p, float a, float b, F* out) {
    const F lut = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
    const F la = _mm512_mul_ps(lut, _mm512_set1_ps(a)), lb = _mm512_mul_ps(lut, _mm512_set1_ps(b));
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i upper = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
    const __m512i lo = _mm512_ternarylogic_epi32(d, _mm512_set1_epi32(15), upper, 0xEA);  // (d & 15) | upper
    const __m512i hi = _mm512_srli_epi32(_mm512_or_si512(d, _mm512_slli_epi32(upper, 4)), 4);
    out[0] = _mm512_permutex2var_ps(la, lo, lb);
    out[1] = _mm512_permutex2var_ps(la, hi, lb);
  }
};

}  // namespace
}  // namespace avx512
}  // namespace moemesh_cpu

#define MOEMESH_ISA avx512
#include "kernel_impl.h"
#pragma GCC pop_options
#endif
