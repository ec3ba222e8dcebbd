// The interface between the torch binding (moe_cpu.cpp) and the per-ISA kernel units
// (isa_avx512.cpp, isa_avx2.cpp). Plain C++ only: the kernel units are compiled for their
// instruction set and must not instantiate any inline function that other units also use.
#pragma once
#include <cstdint>

// The x86 kernel units need GCC's per-unit target pragmas; elsewhere only the torch path runs.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOEMESH_X86_KERNELS 1
#endif

namespace moemesh_cpu {

// Stored weight formats (see kernels/formats and DESIGN.md section 4).
enum Fmt : int { FMT_F32 = 0, FMT_BF16 = 1, FMT_FP8 = 2, FMT_MXFP4 = 3, FMT_NVFP4 = 4 };
enum Act : int { ACT_SILU = 0, ACT_SWIGLU_OAI = 1 };

// One projection of every expert, [E, N, K] logically, read in place.
//   f32/bf16  data [E, N, K] elements
//   fp8       data [E, N, K] e4m3 bytes; scale [E, NB, KB] float32, one per qbn x qbk block; a row's
//             scale row is (n / seg_rows) * per_seg + (n % seg_rows) / qbn
//   mxfp4     data [E, N, KB*16] bytes (two E2M1 per byte, element 2i low); scale [E, N, KB] E8M0 bytes
//   nvfp4     data [E, N, KP/2] bytes; scale [E, N, KP/16] e4m3 bytes; scale2 [E, S] float32, row
//             segment n / seg_rows
// Strides are in elements of the tensor they belong to.
struct Weights {
  int fmt;
  const void* data;
  int64_t sd_e, sd_n;
  const void* scale;
  int64_t ss_e, ss_r;
  const float* scale2;
  int64_t s2_e;
  int64_t k;        // logical K
  int64_t seg_rows; // rows per segment (fp8, nvfp4)
  int64_t per_seg;  // fp8 scale rows per segment
  int64_t qbn, qbk; // fp8 block
  int bf16_x;       // the activation rows hold bfloat16 values and the CPU has AVX512-BF16 and -VNNI
  int vbmi;         // bf16_x, and the CPU has AVX512-VBMI (byte permutes: the FP8 table decode)
};

// Activations are handed to the kernels as float32 rows of `padded_k(k)` values, zero beyond k,
// laid out as `prepare_row` writes them: the packed E2M1 formats take each group of G element pairs
// as [G even elements, G odd elements] (G = pair_group()), so that the low and high nibbles of the
// same bytes meet their activations without a shuffle; the other formats take the row as is.
static inline int64_t padded_k(int64_t k) { return (k + 31) / 32 * 32; }

// Decode attention's inner loops (step_ops.cpp drives them), over cached key/value rows of d
// elements (float32, or bfloat16 bits where bf16 != 0), row j at rows + j * ld elements. The ISA
// units take d a multiple of ATTN_D_MULTIPLE; step_ops.cpp has plain versions for any d.
constexpr int64_t ATTN_D_MULTIPLE = 16;
constexpr int64_t ATTN_ROWS = 8;  // key rows a score block converts at once: scratch holds ATTN_ROWS * d floats
#define ATTENTION_FUNCTIONS                                                                          \
  /* s[g * lds + j] = scale * sum_e q[g * d + e] * k_j[e] for g < group, j < n */                     \
  void attn_scores(const float* q, int64_t group, int64_t d, const void* k, int64_t ld, int bf16, int64_t n, \
                   float scale, float* s, int64_t lds, float* scratch);                              \
  /* max of s[j] for j < n (n >= 1) */                                                               \
  float attn_max(const float* s, int64_t n);                                                         \
  /* s[j] = exp(s[j] - m) for j < n (rounded to bfloat16 where round_bf16 != 0); the sum of the     \
     unrounded values */                                                                             \
  float attn_exp(float* s, int64_t n, float m, int round_bf16);                                      \
  /* acc[g * d + e] += p[g * ldp + j] * v_j[e] for g < group, j < n, e < d */                         \
  void attn_values(const float* p, int64_t ldp, int64_t group, const void* v, int64_t ld, int bf16, int64_t n, \
                   int64_t d, float* acc);

// The functions each ISA unit defines, in namespace moemesh_cpu::<isa>.
#define MOEMESH_ISA_FUNCTIONS                                                                        \
  /* out[m * ldo + (n - n0)] = sum_k x[m * ldx + k] * W[e, n, k] for m < M, n0 <= n < n1 */          \
  void matmul(const Weights& w, int64_t e, int64_t n0, int64_t n1, const float* x, int64_t M,        \
              int64_t ldx, float* out, int64_t ldo);                                                 \
  /* h[i] = act(g[i], u[i]) for i < count */                                                         \
  void activation(int act, const float* g, const float* u, float* h, int64_t count);                 \
  /* src [k] -> dst [padded_k(k)] in the layout the format's kernels read */                       \
  void prepare_row(int fmt, const float* src, int64_t k, float* dst);                                 \
  /* x [n] (n >= 1) every value finite -> true, *mx its largest value, *first that value's first   \
     index, *sumexp the sum of exp(x[j] - *mx); false (nothing written) where one is not finite */   \
  bool max_sumexp(const float* x, int64_t n, float* mx, int64_t* first, float* sumexp);               \
  ATTENTION_FUNCTIONS

#ifdef MOEMESH_X86_KERNELS
namespace avx512 { MOEMESH_ISA_FUNCTIONS }
namespace avx2 { MOEMESH_ISA_FUNCTIONS }
#endif

}  // namespace moemesh_cpu
