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
      alignas(16) uint8_t t[16] = {0};
      const uint8_t* src = p + i;
      if (n - i < 16) {
        __builtin_memcpy(t, p + i, n - i);
        src = t;
      }
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(short(0xBFFF)));
      const F v = _mm512_mul_ps(_mm512_cvtph_ps(h), s);
      if (n - i >= 16) {
        _mm512_storeu_ps(out + i, v);
      } else {
        _mm512_mask_storeu_ps(out + i, __mmask16((1u << (n - i)) - 1), v);
      }
    }
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
