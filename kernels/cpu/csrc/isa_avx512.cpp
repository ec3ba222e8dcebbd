// The AVX-512 kernels (F, BW, VL, DQ with FMA and F16C): SIMD traits for kernel_impl.h.
#include "api.h"
#include <cmath>
#include <cstring>
#ifdef MOEMESH_X86_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

namespace moemesh_cpu {
namespace avx512 {
namespace {

// The bfloat16 bits of the e4m3 magnitudes 0..127 (e = code >> 3, m = code & 7): 2^(e-7) (1 + m/8)
// for e >= 1, m 2^-9 for e == 0 (subnormals), NaN for 127; every one exact in bfloat16.
struct E4M3Table {
  alignas(64) uint16_t v[128];
  constexpr E4M3Table() : v() {
    constexpr uint16_t sub[8] = {0, 118 << 7, 119 << 7, (119 << 7) | 0x40, 120 << 7, (120 << 7) | 0x20, (120 << 7) | 0x40, (120 << 7) | 0x60};
    for (int c = 0; c < 128; ++c) v[c] = c < 8 ? sub[c] : uint16_t(((c >> 3) + 120) << 7 | (c & 7) << 4);
    v[127] = 0x7FC0;
  }
};
constexpr E4M3Table E4M3_TABLE{};
const uint16_t* const E4M3_BF16 = E4M3_TABLE.v;

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

  // W bfloat16 -> W float32 (a bfloat16 is the high half of its float32).
  static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // v rounded to the nearest bfloat16 (ties to even), as float32; v finite
  static F round_bf16(F v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  // out[i] = the sum of a[i]'s lanes for i < 8: each folded to 8 lanes, then pairwise horizontal adds
  static void hsum8(const F* a, float* out) {
    __m256 h[8];
    for (int i = 0; i < 8; ++i) h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31)));
  }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }

  // The quantized tiles' second prefetch, beside the one `ahead` bytes on into L1: row j of a tile,
  // if even, also requests the line twice that distance on into L2 (prefetcht2). The L1 requests
  // alone leave fewer of a stream's lines in flight than the memory keeps busy with on this Xeon; a
  // second request per line (every row) or none were slower (docs/benchmarks.md).
  static void prefetch_far(const uint8_t* p, int64_t ahead, int j) {
    if ((j & 1) == 0) __builtin_prefetch(p + 2 * ahead, 0, 1);
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

  // E8M0 block scales -> float32 multipliers 2^(s - 127) by placing s in the exponent field; s == 0
  // (no exponent field for 2^-127) is the subnormal 0x00400000.
  static void e8m0_to_float(const uint8_t* p, int64_t n, float* out) {
    const __m512i sub = _mm512_set1_epi32(0x00400000);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);  // the last may be partial
      const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, p + i));
      const __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(b, 23), _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()), sub);
      _mm512_mask_storeu_epi32(out + i, live, bits);
    }
  }

  // The 4-bit formats against activation rows that hold bfloat16 values (the bfloat16 compute dtype),
  // where the CPU has AVX512-BF16 and AVX512-VNNI (the caller checks): twice an E2M1 value is an
  // integer of at most 12 in magnitude, and each activation row is held as 16-bit integers with one
  // power-of-two scale per step of 128 elements (the step's largest magnitude at 2^14 to 2^15, so
  // every element within 2^7 of it, all 8 bits of its bfloat16, is exact, and a smaller one is off
  // by at most 2^-15 of that largest). vpdpwssd multiplies them exactly and sums pairs in 32-bit
  // integers: a third of the cost of vdpbf16ps where that is slow (2.8x its throughput on the Xeon
  // this was tuned on, equal on AMD Zen 4). The block scales (times the row's step scale) are applied
  // once per step, after the products.
  // A step covers 128 elements (64 bytes, one cache line of a row): word lane l of the bytes holds
  // bytes 2l, 2l+1, i.e. elements 4l..4l+3 as its nibbles q = 0..3; nibble q (the word shifted right
  // by 4q) looked up in a 16-word table (vpermw) gives twice element 4l+q in word lane l, with no
  // widening of the bytes. The activations are converted once per call (i16_x_e2m1) to match: for
  // each step and q, word lane l holds element 4l+q. The products' lane i sums word lanes 2i, 2i+1
  // over the four q, elements 8i..8i+7: lanes 4b..4b+3 belong to MXFP4 block b of the step (32
  // elements), lanes 2b, 2b+1 to NVFP4 block b (16): LPB lanes per block.
  static constexpr bool BF16_DOT = true;
  using BX = __m512bh;  // the activations' bfloat16 vectors (bfloat16 and FP8 weights)
  using IX = __m512i;   // the activations' 16-bit integer vectors (4-bit weights)
  static constexpr int BF16_STEP = 128;  // elements per step of e2m1_i16_tile

  // x: M rows of kp float32 in prepare_row's layout (groups of 32: 16 even, then 16 odd elements) ->
  // xi: M rows of `steps` x 4 vectors of 32 16-bit integers (row m, step s, nibble q at
  // xi[(m * steps + s) * 4 + q]), zero past kp, and xs[m * steps + s]: the multiplier of the step's
  // integers (its power of two, halved for the table's doubled E2M1 values). A step whose largest
  // magnitude is not finite gets the multiplier NaN (its sums are NaN, as the float products' would
  // be NaN or infinite); one below 2^-113 (zero included) keeps the smallest multiplier.
  static void i16_x_e2m1(const float* x, int64_t ldx, int64_t kp, int64_t M, __m512i* xi, float* xs) {
    const int64_t steps = (kp + BF16_STEP - 1) / BF16_STEP;
    // vector q, lanes l < 8 from group 2h (lanes l >= 8 from group 2h + 1) of the half (q & 1):
    // float 2 (l % 8) + (q >> 1) of it
    __m512i idx[2];
    for (int hi = 0; hi < 2; ++hi) {
      alignas(64) int32_t v[16];
      for (int l = 0; l < 16; ++l) v[l] = (l < 8 ? 0 : 16) + 2 * (l % 8) + hi;
      idx[hi] = _mm512_load_si512(v);
    }
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * ldx;
      for (int64_t st = 0; st < steps; ++st) {
        F g[4][2];  // groups of the step: [even, odd] halves, zero past kp
        __m512i big = _mm512_setzero_si512();  // the largest magnitude's bits (ordered as integers)
        for (int gi = 0; gi < 4; ++gi) {
          const int64_t e0 = st * BF16_STEP + gi * 32;
          const __mmask16 live = e0 < kp ? __mmask16(0xFFFF) : __mmask16(0);
          for (int h = 0; h < 2; ++h) {
            g[gi][h] = _mm512_maskz_loadu_ps(live, xr + (e0 < kp ? e0 + 16 * h : 0));
            big = _mm512_max_epu32(big, _mm512_and_si512(_mm512_castps_si512(g[gi][h]), magnitude));
          }
        }
        int e = int(uint32_t(_mm512_reduce_max_epu32(big)) >> 23);  // the biased exponent of the largest
        F mult;
        if (e == 255) {
          mult = zero();
          xs[m * steps + st] = __builtin_nanf("");
        } else {
          e = e < 14 ? 14 : e;  // 2^(141 - e) takes the largest to [2^14, 2^15)
          mult = _mm512_castsi512_ps(_mm512_set1_epi32((268 - e) << 23));
          xs[m * steps + st] = std::ldexp(1.0f, e - 142);  // the inverse, halved
        }
        for (int q = 0; q < 4; ++q) {
          const F lo = _mm512_permutex2var_ps(g[0][q & 1], idx[q >> 1], g[1][q & 1]);  // lanes 0-15
          const F hi = _mm512_permutex2var_ps(g[2][q & 1], idx[q >> 1], g[3][q & 1]);  // lanes 16-31
          const __m256i l16 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(mul(lo, mult)));
          const __m256i h16 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(mul(hi, mult)));
          xi[(m * steps + st) * 4 + q] = _mm512_inserti64x4(_mm512_castsi256_si512(l16), h16, 1);
        }
      }
    }
  }

  // out[m * ldo + j] = sum_k x[m, k] * row_j[k] for m < MR, j < nvalid, over an NR_-row tile: rows d[j]
  // with their block multipliers s[j] (zeros for 8 past the last block); `ahead` bytes from each
  // row is the same row of a later tile (the caller's prefetch distance), prefetched one cache line
  // per step as the tile runs. xi, xs: the activation rows as i16_x_e2m1 writes them.
  // kp elements per row (a multiple of 16); the last step's bytes past the row are not read.
  template <int LPB, int MR, int NR_>
  __attribute__((target("avx512vnni"))) static void e2m1_i16_tile(const uint8_t* const* d, const float* const* s,
                                                                  int64_t ahead, int nvalid, const __m512i* xi,
                                                                  const float* xs, int64_t kp, float* out,
                                                                  int64_t ldo) {
    // twice the 16 E2M1 values as 16-bit integers, twice: vpermw reads the low 5 bits of each index,
    // so a word shifted right by 4q picks its nibble q's value without masking
    const __m512i table = _mm512_setr_epi32(0x00010000, 0x00030002, 0x00060004, 0x000C0008, 0xFFFF0000, 0xFFFDFFFE,
                                            0xFFFAFFFC, 0xFFF4FFF8, 0x00010000, 0x00030002, 0x00060004, 0x000C0008,
                                            0xFFFF0000, 0xFFFDFFFE, 0xFFFAFFFC, 0xFFF4FFF8);
    alignas(64) int32_t sv_idx[16];
    for (int i = 0; i < 16; ++i) sv_idx[i] = i / LPB;  // lane i -> block i / LPB of the step
    const __m512i sidx = _mm512_load_si512(sv_idx);
    constexpr int BPS = 16 / LPB;  // blocks per step
    const int64_t steps = (kp + BF16_STEP - 1) / BF16_STEP;
    const int64_t full = kp / BF16_STEP;
    const __mmask64 tail = (kp % BF16_STEP) ? (~__mmask64(0) >> (64 - (kp % BF16_STEP) / 2)) : ~__mmask64(0);
    F acc[MR][NR_];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NR_; ++j) acc[m][j] = zero();
    for (int64_t st = 0; st < steps; ++st) {
      const bool last = st == full;  // a partial last step
      F xm[MR];  // the rows' step multipliers
      for (int m = 0; m < MR; ++m) xm[m] = set1(xs[m * steps + st]);
      for (int j = 0; j < NR_; ++j) {
        const uint8_t* p = d[j] + st * (BF16_STEP / 2);
        __m512i b;
        if (last) {
          b = _mm512_maskz_loadu_epi8(tail, p);
        } else {
          __builtin_prefetch(p + ahead);
          prefetch_far(p, ahead, j);
          b = _mm512_loadu_si512(p);
        }
        const __m512i w0 = _mm512_permutexvar_epi16(b, table);
        const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
        const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 8), table);
        const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 12), table);
        const F sv = _mm512_permutexvar_ps(sidx, _mm512_castps256_ps512(_mm256_loadu_ps(s[j] + st * BPS)));
        for (int m = 0; m < MR; ++m) {
          const __m512i* xq = xi + (m * steps + st) * 4;
          __m512i t = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, xq[0]);
          t = _mm512_dpwssd_epi32(t, w1, xq[1]);
          t = _mm512_dpwssd_epi32(t, w2, xq[2]);
          t = _mm512_dpwssd_epi32(t, w3, xq[3]);
          acc[m][j] = fma(_mm512_cvtepi32_ps(t), mul(sv, xm[m]), acc[m][j]);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < nvalid; ++j) out[m * ldo + j] = hsum(acc[m][j]);
  }

  // Weight rows per tile of the 4-bit and FP8 tiles for a call of mr activation rows (at most MR):
  // more rows (more independent accumulators and load streams) where few activation rows leave
  // registers for them. A call of more rows keeps 4-row tiles for every group of MR rows.
  static constexpr int BF16_TILE_ROWS = 8;
  static int bf16_tile_rows(int64_t mr) { return mr <= 2 ? 8 : 4; }

  // The E2M1 tiles for mr activation rows over a tile of tr (bf16_tile_rows) weight rows.
  template <int LPB, int MR = 4>
  static void e2m1_i16(const uint8_t* const* d, const float* const* s, int64_t ahead, int nvalid, const __m512i* xi,
                       const float* xs, int64_t kp, float* out, int64_t ldo, int64_t mr, int tr) {
    if constexpr (MR > 1) {
      if (mr < MR) return e2m1_i16<LPB, MR - 1>(d, s, ahead, nvalid, xi, xs, kp, out, ldo, mr, tr);
    }
    if (MR <= 2 && tr == 8) return e2m1_i16_tile<LPB, MR, 8>(d, s, ahead, nvalid, xi, xs, kp, out, ldo);
    e2m1_i16_tile<LPB, MR, 4>(d, s, ahead, nvalid, xi, xs, kp, out, ldo);
  }

  // FP8 (E4M3) weights against activation rows that hold bfloat16 values, where the CPU has
  // AVX512-BF16: every E4M3 value is a bfloat16 value (3 mantissa bits, exponents within range), so
  // each 32-byte chunk becomes one vector of 32 bfloat16 (looked up in E4M3_BF16: two word
  // permutes, a blend and the sign, in place of widening through float16 and float32) that
  // vdpbf16ps multiplies exactly; the
  // products of a block's chunks are summed, then scaled once by the block's scale.
  // x: M rows of kp float32 (as prepare_row writes them: as is) -> xb: M rows of kp / 32 bfloat16
  // vectors in element order (row m, chunk c at xb[m * (kp / 32) + c]).
  __attribute__((target("avx512bf16"))) static void bf16_x_plain(const float* x, int64_t ldx, int64_t kp, int64_t M,
                                                                 __m512bh* xb) {
    const int64_t chunks = kp / 32;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < chunks; ++c)
        xb[m * chunks + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + 32 * c + 16), _mm512_loadu_ps(x + m * ldx + 32 * c));
  }

  // out[m * ldo + j] = sum_k x[m, k] * row_j[k] for m < MR, j < nvalid over an NR_-row tile: rows d[j]
  // of k e4m3 bytes (the last chunk's bytes past k are not read) with their scale rows s[j] (one
  // float per qbk elements; qbk a multiple of 32); `ahead` bytes from each row is the same row of a
  // later tile (the caller's prefetch distance), prefetched a cache line per two chunks.
  template <int MR, int NR_>
  __attribute__((target("avx512bf16"))) static void fp8_bf16_tile(const uint8_t* const* d, const float* const* s,
                                                                  int64_t ahead, int nvalid, const __m512bh* xb,
                                                                  int64_t k, int64_t qbk, float* out, int64_t ldo) {
    const int64_t chunks = (k + 31) / 32, full = k / 32, per_block = qbk / 32;
    const __mmask32 tail = (k % 32) ? __mmask32((1u << (k % 32)) - 1) : ~__mmask32(0);
    __m512i lut[4];
    for (int i = 0; i < 4; ++i) lut[i] = _mm512_load_si512(E4M3_BF16 + 32 * i);
    F acc[MR][NR_];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NR_; ++j) acc[m][j] = zero();
    for (int64_t c0 = 0; c0 < chunks; c0 += per_block) {
      const int64_t c1 = c0 + per_block < chunks ? c0 + per_block : chunks;
      F t[MR][NR_];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NR_; ++j) t[m][j] = zero();
      for (int64_t c = c0; c < c1; ++c) {
        for (int j = 0; j < NR_; ++j) {
          const uint8_t* p = d[j] + 32 * c;
          __m256i raw;
          if (c < full) {
            if (!(c & 1)) {
              __builtin_prefetch(p + ahead);
              prefetch_far(p, ahead, j);
            }
            raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          } else {
            raw = _mm256_maskz_loadu_epi8(tail, p);
          }
          // e4m3 -> bfloat16 by table: the magnitude's 7 bits pick one of 128 words (two 64-word
          // lookups, the seventh bit choosing between them), the sign bit is or-ed in
          const __m512i code = _mm512_cvtepu8_epi16(raw);
          const __m512i lo = _mm512_permutex2var_epi16(lut[0], code, lut[1]);
          const __m512i hi = _mm512_permutex2var_epi16(lut[2], code, lut[3]);
          const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40)), lo, hi);
          const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(code, 8), _mm512_set1_epi16(short(0x8000)), 0xF8);
          for (int m = 0; m < MR; ++m) t[m][j] = _mm512_dpbf16_ps(t[m][j], w, xb[m * chunks + c]);
        }
      }
      for (int j = 0; j < NR_; ++j) {
        const F sc = set1(s[j][c0 / per_block]);
        for (int m = 0; m < MR; ++m) acc[m][j] = fma(t[m][j], sc, acc[m][j]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < nvalid; ++j) out[m * ldo + j] = hsum(acc[m][j]);
  }

  // The FP8 tiles for mr activation rows over a tile of tr (bf16_tile_rows) weight rows: byte
  // permutes (fp8_vbmi_tile, BYTES) or word permutes (fp8_bf16_tile).
  template <bool BYTES, int MR = 4>
  static void fp8_tiles(const uint8_t* const* d, const float* const* s, int64_t ahead, int nvalid, const __m512bh* xb,
                        int64_t k, int64_t qbk, float* out, int64_t ldo, int64_t mr, int tr) {
    if constexpr (MR > 1) {
      if (mr < MR) return fp8_tiles<BYTES, MR - 1>(d, s, ahead, nvalid, xb, k, qbk, out, ldo, mr, tr);
    }
    if (MR <= 2 && tr == 8) return fp8_tile<BYTES, MR, 8>(d, s, ahead, nvalid, xb, k, qbk, out, ldo);
    fp8_tile<BYTES, MR, 4>(d, s, ahead, nvalid, xb, k, qbk, out, ldo);
  }
  template <bool BYTES, int MR, int NR_>
  static void fp8_tile(const uint8_t* const* d, const float* const* s, int64_t ahead, int nvalid, const __m512bh* xb,
                       int64_t k, int64_t qbk, float* out, int64_t ldo) {
    if constexpr (BYTES) {
      fp8_vbmi_tile<MR, NR_>(d, s, ahead, nvalid, xb, k, qbk, out, ldo);
    } else {
      fp8_bf16_tile<MR, NR_>(d, s, ahead, nvalid, xb, k, qbk, out, ldo);
    }
  }

  // bfloat16 weights against activation rows that hold bfloat16 values: each 64-byte step of a row
  // (32 elements, one cache line) is one vector that vdpbf16ps multiplies exactly against the
  // activations' vector in element order (bf16_x_plain), with no widening of either side.
  // bf16w_block: R consecutive rows from `row` (`stride` bytes apart) against MR activation rows
  // (from L1): out[m * ldo + r] = sum_k x[m, k] * row_r[k]; the bytes `prefetch` further on are
  // requested into L2 as it reads, and those `near` on into L1 (as stream_rows; both 0: the rows are
  // read again from the caches). U chains per product (more
  // where few activation rows leave registers for them) hide the dot products' latency; a row's
  // result does not depend on R (whether it ran in a pair), so not on how rows are split over
  // threads. The last step's bytes past k are not read.
  template <int MR, int R>
  __attribute__((target("avx512bf16"))) static void bf16w_block(const uint8_t* row, int64_t stride,
                                                                const __m512bh* xb, int64_t k, float* out,
                                                                int64_t ldo, int64_t prefetch, int64_t near) {
    constexpr int U = MR <= 2 ? 4 : (MR <= 4 ? 2 : 1);  // by MR only: a row's sums do not depend on R
    const int64_t chunks = (k + 31) / 32, full = k / 32, body = full / U * U;
    const __mmask32 tail = (k % 32) ? __mmask32((1u << (k % 32)) - 1) : ~__mmask32(0);
    F acc[MR][R][U];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) acc[m][r][u] = zero();
    int64_t c = 0;
    for (; c < body; c += U) {
      __m512i w[R][U];
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) {
          const uint8_t* p = row + r * stride + 64 * (c + u);
          __builtin_prefetch(p + prefetch, 0, 1);
          __builtin_prefetch(p + near);
          w[r][u] = _mm512_loadu_si512(p);
        }
      for (int m = 0; m < MR; ++m)
        for (int u = 0; u < U; ++u) {
          const __m512bh xv = xb[m * chunks + c + u];
          for (int r = 0; r < R; ++r) acc[m][r][u] = _mm512_dpbf16_ps(acc[m][r][u], (__m512bh)w[r][u], xv);
        }
    }
    for (; c < chunks; ++c) {  // the steps past the last whole group of U, the last one maybe partial
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = row + r * stride + 64 * c;
        const __m512i w = c < full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(tail, p);
        for (int m = 0; m < MR; ++m) acc[m][r][0] = _mm512_dpbf16_ps(acc[m][r][0], (__m512bh)w, xb[m * chunks + c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      F sum[MR];
      for (int m = 0; m < MR; ++m) {
        sum[m] = acc[m][r][0];
        for (int u = 1; u < U; ++u) sum[m] = add(sum[m], acc[m][r][u]);
      }
      if constexpr (MR == 8) {
        alignas(32) float t[8];
        hsum8(sum, t);
        for (int m = 0; m < 8; ++m) out[m * ldo + r] = t[m];
      } else {
        for (int m = 0; m < MR; ++m) out[m * ldo + r] = hsum(sum[m]);
      }
    }
  }

  // One block of R rows against mr <= BF16W_GROUP activation rows.
  template <int R, int MR = 8>
  static void bf16w_block_m(const uint8_t* row, int64_t stride, const __m512bh* xb, int64_t k, float* out,
                            int64_t ldo, int64_t prefetch, int64_t near, int64_t mr) {
    if constexpr (MR > 1) {
      if (mr < MR) return bf16w_block_m<R, MR - 1>(row, stride, xb, k, out, ldo, prefetch, near, mr);
    }
    bf16w_block<MR, R>(row, stride, xb, k, out, ldo, prefetch, near);
  }

  // Rows [0, rows) of `stride` bytes from `base` against M activation rows (xb: M rows of
  // (k + 31) / 32 vectors, as bf16_x_plain writes them): out[m * ldo + n]. The rows are read once, in
  // order, as one stream prefetched `prefetch` bytes ahead into L2 and `near` into L1: one at a time
  // against up to 4 activation rows, else two at a time against groups of up to BF16W_GROUP (the pair
  // read again from L1 for each further group).
  static constexpr int BF16W_GROUP = 8;
  static void bf16w_rows(const uint8_t* base, int64_t stride, int64_t rows, const __m512bh* xb, int64_t k,
                         float* out, int64_t ldo, int64_t prefetch, int64_t near, int64_t M) {
    const int64_t chunks = (k + 31) / 32;
    const int R = M <= 4 ? 1 : 2;
    int64_t n = 0;
    for (; n + R <= rows; n += R) {
      const uint8_t* row = base + n * stride;
      for (int64_t m = 0; m < M; m += BF16W_GROUP) {
        const int64_t mr = M - m < BF16W_GROUP ? M - m : BF16W_GROUP;
        const int64_t pf = m == 0 ? prefetch : 0, nr = m == 0 ? near : 0;
        if (R == 2) {
          bf16w_block_m<2>(row, stride, xb + m * chunks, k, out + m * ldo + n, ldo, pf, nr, mr);
        } else {
          bf16w_block_m<1>(row, stride, xb + m * chunks, k, out + m * ldo + n, ldo, pf, nr, mr);
        }
      }
    }
    for (; n < rows; ++n)  // the rows past the last whole block
      for (int64_t m = 0; m < M; m += BF16W_GROUP)
        bf16w_block_m<1>(base + n * stride, stride, xb + m * chunks, k, out + m * ldo + n, ldo, 0, 0,
                         M - m < BF16W_GROUP ? M - m : BF16W_GROUP);
  }

  // FP8 (E4M3) weights with byte permutes (AVX512-VBMI), 64 bytes of a row per step: the magnitude's
  // 7 bits pick the high and the low byte of its bfloat16 (E4M3_BF16) from two 128-byte tables, one
  // vpermt2b each, the sign bit is or-ed into the high bytes, and byte unpacks pair them into two
  // vectors of 32 bfloat16: vector 0 holds elements 16L + 0..7 in its 128-bit lane L, vector 1
  // elements 16L + 8..15 (the activations are converted to match, bf16_x_fp8_vbmi). A third of the
  // instructions of the word-permute decode per element.
  static constexpr int FP8_VBMI_STEP = 64;  // elements per step; the block width must be a multiple

  // x: M rows of kx float32 (zero past the row's k) -> xb: M rows of kp / 32 bfloat16 vectors, zero
  // past kx (kp a multiple of 64 >= kx): row m, step s, vector h at xb[m * (kp / 32) + 2 s + h].
  __attribute__((target("avx512bf16"))) static void bf16_x_fp8_vbmi(const float* x, int64_t ldx, int64_t kx, int64_t kp,
                                                                    int64_t M, __m512bh* xb) {
    alignas(64) int32_t lo_idx[16], hi_idx[16];
    for (int l = 0; l < 16; ++l) {
      lo_idx[l] = (l < 8 ? 0 : 16) + l % 8;  // floats 0-7 of the first vector, then 0-7 of the second
      hi_idx[l] = lo_idx[l] + 8;
    }
    const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
    const int64_t steps = kp / FP8_VBMI_STEP;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * ldx;
      for (int64_t st = 0; st < steps; ++st) {
        F f[4];  // elements 16i .. 16i + 15 of the step, zero past kx
        for (int i = 0; i < 4; ++i) {
          const int64_t e0 = st * FP8_VBMI_STEP + 16 * i;
          f[i] = e0 < kx ? _mm512_loadu_ps(xr + e0) : zero();
        }
        // vector 0: elements 0-7, 16-23 (floats), then 32-39, 48-55; vector 1 the other halves
        xb[m * (kp / 32) + 2 * st] = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(f[2], il, f[3]), _mm512_permutex2var_ps(f[0], il, f[1]));
        xb[m * (kp / 32) + 2 * st + 1] = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(f[2], ih, f[3]), _mm512_permutex2var_ps(f[0], ih, f[1]));
      }
    }
  }

  // out[m * ldo + j] = sum_k x[m, k] * row_j[k] for m < MR, j < nvalid over an NR_-row tile: rows d[j]
  // of k e4m3 bytes (the last step's bytes past k are not read) with their scale rows s[j] (one float
  // per qbk elements, qbk a multiple of 64); `ahead` bytes from each row is the same row of a later
  // tile, prefetched a cache line per step.
  template <int MR, int NR_>
  __attribute__((target("avx512bf16,avx512vbmi"))) static void fp8_vbmi_tile(const uint8_t* const* d,
                                                                            const float* const* s, int64_t ahead,
                                                                            int nvalid, const __m512bh* xb, int64_t k,
                                                                            int64_t qbk, float* out, int64_t ldo) {
    const int64_t steps = (k + FP8_VBMI_STEP - 1) / FP8_VBMI_STEP, full = k / FP8_VBMI_STEP;
    const int64_t per_block = qbk / FP8_VBMI_STEP, ldx = 2 * steps;
    const __mmask64 tail = (k % FP8_VBMI_STEP) ? (~__mmask64(0) >> (64 - k % FP8_VBMI_STEP)) : ~__mmask64(0);
    alignas(64) uint8_t hb[128], lb[128];
    for (int c = 0; c < 128; ++c) {
      hb[c] = uint8_t(E4M3_BF16[c] >> 8);
      lb[c] = uint8_t(E4M3_BF16[c] & 0xFF);
    }
    const __m512i h0 = _mm512_load_si512(hb), h1 = _mm512_load_si512(hb + 64);
    const __m512i l0 = _mm512_load_si512(lb), l1 = _mm512_load_si512(lb + 64);
    const __m512i sign = _mm512_set1_epi8(char(0x80));
    F acc[MR][NR_];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NR_; ++j) acc[m][j] = zero();
    for (int64_t s0 = 0; s0 < steps; s0 += per_block) {
      const int64_t s1 = s0 + per_block < steps ? s0 + per_block : steps;
      F t[MR][NR_];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NR_; ++j) t[m][j] = zero();
      for (int64_t st = s0; st < s1; ++st) {
        for (int j = 0; j < NR_; ++j) {
          const uint8_t* p = d[j] + FP8_VBMI_STEP * st;
          __m512i code;
          if (st < full) {
            __builtin_prefetch(p + ahead);
            prefetch_far(p, ahead, j);
            code = _mm512_loadu_si512(p);
          } else {
            code = _mm512_maskz_loadu_epi8(tail, p);
          }
          const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(h0, code, h1), code, sign, 0xF8);
          const __m512i lo = _mm512_permutex2var_epi8(l0, code, l1);
          const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
          const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
          for (int m = 0; m < MR; ++m) {
            t[m][j] = _mm512_dpbf16_ps(t[m][j], w0, xb[m * ldx + 2 * st]);
            t[m][j] = _mm512_dpbf16_ps(t[m][j], w1, xb[m * ldx + 2 * st + 1]);
          }
        }
      }
      for (int j = 0; j < NR_; ++j) {
        const F sc = set1(s[j][s0 / per_block]);
        for (int m = 0; m < MR; ++m) acc[m][j] = fma(t[m][j], sc, acc[m][j]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < nvalid; ++j) out[m * ldo + j] = hsum(acc[m][j]);
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
#include "attention_impl.h"
#pragma GCC pop_options
#endif
