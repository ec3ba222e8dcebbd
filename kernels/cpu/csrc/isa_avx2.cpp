// The AVX2 kernels (with FMA and F16C): SIMD traits for kernel_impl.h.
#include "api.h"
#ifdef MOEMESH_X86_KERNELS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace moemesh_cpu {
namespace avx2 {
namespace {

struct V {
  using F = __m256;
  static constexpr int W = 8;   // float32 lanes
  static constexpr int NR = 2;  // weight rows per register tile
  static constexpr int MR = 3;  // activation rows per register tile (16 ymm registers in all)
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2n(F n) {  // 2^n for integral n in [-126, 127]
    const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(i, 23));
  }

  static void bf16_chunk(const uint16_t* p, F* out) {
    for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * v)));
      out[v] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
  }

  // See the AVX-512 version: the e4m3 byte as a float16 of 1/2^8 its value.
  static void fp8_chunk(const uint8_t* p, float scale, F* out) {
    const F s = _mm256_set1_ps(scale * 256.0f);
    for (int v = 0; v < 4; ++v) {
      __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
      h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(short(0xBFFF)));
      out[v] = _mm256_mul_ps(_mm256_cvtph_ps(h), s);
    }
  }

  // n e4m3 bytes -> n float32 times `mult` (the float16 trick, 8 at a time).
  static void e4m3_to_float(const uint8_t* p, int64_t n, float mult, float* out) {
    const F s = _mm256_set1_ps(mult * 256.0f);
    for (int64_t i = 0; i < n; i += 8) {
      alignas(16) uint8_t t[16] = {0};
      alignas(32) float o[8];
      const int64_t m = n - i < 8 ? n - i : 8;
      __builtin_memcpy(t, p + i, m);
      __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t)));
      h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(short(0xBFFF)));
      _mm256_store_ps(o, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
      __builtin_memcpy(out + i, o, m * 4);
    }
  }

  // E8M0 block scales -> float32 multipliers 2^(s - 127) (s == 0: the subnormal 2^-127)
  static void e8m0_to_float(const uint8_t* p, int64_t n, float* out) {
    uint32_t* bits = reinterpret_cast<uint32_t*>(out);
    for (int64_t i = 0; i < n; ++i) bits[i] = p[i] ? uint32_t(p[i]) << 23 : 0x00400000u;
  }

  static constexpr bool BF16_DOT = false;  // no bfloat16 dot products in this variant

  static void e2m1_chunk1(const uint8_t* p, float a, F* out) { e2m1_chunk(p, a, a, out); }

  // 16 bytes of E2M1 pairs -> [even, odd] of bytes 0-7 (scaled by a), [even, odd] of bytes 8-15
  // (scaled by b). vpermps reads the magnitude (low 3 bits) from an 8-entry table; bit 3 is the sign.
  static void e2m1_chunk(const uint8_t* p, float a, float b, F* out) {
    const F lut = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
    for (int g = 0; g < 2; ++g) {
      const F t = _mm256_mul_ps(lut, _mm256_set1_ps(g ? b : a));
      const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * g)));
      const __m256i h = _mm256_srli_epi32(d, 4);
      const F lo = _mm256_permutevar8x32_ps(t, d), hi = _mm256_permutevar8x32_ps(t, h);
      out[2 * g] = _mm256_xor_ps(lo, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
      out[2 * g + 1] = _mm256_xor_ps(hi, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(h, 28), sign)));
    }
  }
};

}  // namespace
}  // namespace avx2
}  // namespace moemesh_cpu

#define MOEMESH_ISA avx2
#include "kernel_impl.h"
#pragma GCC pop_options
#endif
