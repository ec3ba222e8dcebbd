// The expert GEMM kernels, written once over a SIMD traits struct `V` and compiled once per
// instruction set: isa_avx512.cpp and isa_avx2.cpp define `V` inside
// moemesh_cpu::<MOEMESH_ISA>::{anonymous} under their target pragma, then include this file.
// Everything here has internal linkage, so no code compiled for one instruction set can be picked
// by the linker for another unit.
//
// Shape legend: M rows of activations (tokens of one expert), K reduction dim, N weight rows
// (output columns), CH = 32 elements per chunk, W lanes per vector, VPC = CH / W vectors per chunk,
// NR weight rows and MR activation rows per register tile.
//
// A weight row is read in chunks of 32 elements straight from its stored bytes: a decoder turns one
// chunk (with its block scales) into VPC float32 vectors, exactly the values `dequantize` gives in
// float32, which meet the activations in fused multiply-adds with float32 accumulators. The packed
// E2M1 formats decode the low and high nibbles of the same bytes into separate vectors (even and
// odd elements); the activations are laid out to match (api.h: prepare_row). Up to MR rows run
// straight on the decoded registers (dense weights one row at a time, `stream_rows`; the quantized
// formats NR rows at a time); more rows first decode an NR-row tile into a cache-resident float32
// buffer (NR x K, never more) and run the float32 kernel over it, MR rows at a time.
// Where the activation rows hold bfloat16 values and the variant has bfloat16 dot products
// (Weights::bf16_x), bfloat16 weights above MR rows (matmul_bf16w) and FP8 at any number of rows
// instead meet them in bfloat16 dot products with float32 accumulators, the E2M1 formats at any
// number of rows in 16-bit integer dot products (matmul_bf16).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace moemesh_cpu {
namespace MOEMESH_ISA {
namespace {

constexpr int CH = 32;
using F = V::F;
constexpr int W = V::W;
constexpr int VPC = CH / W;
constexpr int NR = V::NR;

// One weight row: its bytes, its block scales (fp8: the row's float32 scales; mxfp4, nvfp4: the
// finished float32 multipliers that `scales` wrote into the tile's scratch).
struct Row {
  const uint8_t* d;
  const float* s;
};

// Decoders: row(n) -> Row (block scales not yet filled); scales(n, out) writes the finished block
// multipliers of row n (where the format needs it: `SCALES` floats per row); at(row, c, p, valid,
// out): chunk c of `row`, whose bytes start at p (the stored bytes, or a zero-padded copy for the
// last partial chunk), `valid` elements of it real -> out[VPC].
struct DecF32 {
  static constexpr int CB = CH * 4;  // bytes per chunk
  static constexpr bool SCALED = false;
  const uint8_t* base;
  int64_t stride;  // bytes per row
  Row row(int64_t n) const { return {base + n * stride, nullptr}; }
  void scales(int64_t, float*) const {}
  void at(const Row&, int64_t, const uint8_t* p, int, F* out) const {
    const float* f = reinterpret_cast<const float*>(p);
    for (int v = 0; v < VPC; ++v) out[v] = V::load(f + v * W);
  }
};

struct DecBF16 {
  static constexpr int CB = CH * 2;
  static constexpr bool SCALED = false;
  const uint8_t* base;
  int64_t stride;
  Row row(int64_t n) const { return {base + n * stride, nullptr}; }
  void scales(int64_t, float*) const {}
  void at(const Row&, int64_t, const uint8_t* p, int, F* out) const {
    V::bf16_chunk(reinterpret_cast<const uint16_t*>(p), out);
  }
};

struct DecFP8 {
  static constexpr int CB = CH;
  static constexpr bool SCALED = false;
  const uint8_t* base;
  int64_t stride;
  const float* scale;  // this expert's [NB, KB]
  int64_t ss_r, seg_rows, per_seg, qbn, qbk;
  Row row(int64_t n) const {
    const int64_t srow = (n / seg_rows) * per_seg + (n % seg_rows) / qbn;
    return {base + n * stride, scale + srow * ss_r};
  }
  void scales(int64_t, float*) const {}
  void at(const Row& r, int64_t c, const uint8_t* p, int, F* out) const {
    V::fp8_chunk(p, r.s[(c * CH) / qbk], out);
  }
};

struct DecMXFP4 {
  static constexpr int CB = CH / 2;
  static constexpr bool SCALED = true;
  const uint8_t* base;
  int64_t stride;
  const uint8_t* scale;  // this expert's [N, KB]
  int64_t ss_r, kb;
  Row row(int64_t n) const { return {base + n * stride, nullptr}; }
  const uint8_t* scale_row(int64_t n) const { return scale + n * ss_r; }
  void scales(int64_t n, float* out) const { V::e8m0_to_float(scale + n * ss_r, kb, out); }  // 2^(s - 127)
  // rows n.. n + rows - 1's multipliers one after another (kb each), where their scales are stored so
  bool scales_run_ok(int64_t, int64_t) const { return ss_r == kb; }
  void scales_run(int64_t n, int64_t rows, float* out) const { V::e8m0_to_float(scale + n * ss_r, rows * kb, out); }
  void at(const Row& r, int64_t c, const uint8_t* p, int, F* out) const { V::e2m1_chunk1(p, r.s[c], out); }
};

struct DecNVFP4 {
  static constexpr int CB = CH / 2;
  static constexpr bool SCALED = true;
  const uint8_t* base;
  int64_t stride;
  const uint8_t* scale;  // this expert's [N, KP/16]
  int64_t ss_r;
  const float* scale2;  // this expert's [S]
  int64_t seg_rows, kb;
  Row row(int64_t n) const { return {base + n * stride, nullptr}; }
  const uint8_t* scale_row(int64_t n) const { return scale + n * ss_r; }
  void scales(int64_t n, float* out) const {  // e4m3 block scale * weight_scale_2, and a 0 past the end
    V::e4m3_to_float(scale + n * ss_r, kb, scale2[n / seg_rows], out);
    out[kb] = 0.f;
  }
  // as DecMXFP4's, for rows of one weight_scale_2 segment
  bool scales_run_ok(int64_t n, int64_t rows) const { return ss_r == kb && n / seg_rows == (n + rows - 1) / seg_rows; }
  void scales_run(int64_t n, int64_t rows, float* out) const {
    V::e4m3_to_float(scale + n * ss_r, rows * kb, scale2[n / seg_rows], out);
  }
  void at(const Row& r, int64_t c, const uint8_t* p, int, F* out) const {
    V::e2m1_chunk(p, r.s[2 * c], r.s[2 * c + 1], out);
  }
};

// Decode chunk c of one row into w[VPC]; the last partial chunk goes through a zeroed copy.
template <class D>
inline void decode(const D& d, const Row& row, int64_t c, int valid, F* w) {
  if (valid == CH) return d.at(row, c, row.d + c * D::CB, CH, w);
  alignas(64) uint8_t buf[D::CB] = {0};
  std::memcpy(buf, row.d + c * D::CB, size_t((int64_t(valid) * D::CB + CH - 1) / CH));
  d.at(row, c, buf, valid, w);
}

// Prefetch distance within a row where rows are decoded one at a time (the buffered tiles); the
// register tiles prefetch the same chunk of the next tile's rows (NR rows further on), which keeps
// enough requests in flight for DRAM (decode streams faster than prefetching 8 chunks ahead in the
// row: docs/benchmarks.md).
constexpr int64_t PREFETCH_CHUNKS = 8;

// acc[m][j] += x[m] . row_j over chunk c (`valid` elements real; the last partial chunk is decoded
// from zero-padded copies).
template <class D, int MR, bool TAIL>
inline void step(const D& d, const Row* rows, const float* x, int64_t ldx, int64_t c, int valid, F (*acc)[NR]) {
  F xv[MR][VPC];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < VPC; ++v) xv[m][v] = V::load(x + m * ldx + c * CH + v * W);
  for (int j = 0; j < NR; ++j) {
    F w[VPC];
    if constexpr (TAIL) {
      decode(d, rows[j], c, valid, w);
    } else {
      __builtin_prefetch(rows[j].d + NR * d.stride + c * D::CB);  // the same chunk of the next tile's row
      d.at(rows[j], c, rows[j].d + c * D::CB, CH, w);
    }
    for (int v = 0; v < VPC; ++v)
      for (int m = 0; m < MR; ++m) acc[m][j] = V::fma(xv[m][v], w[v], acc[m][j]);
  }
}

// out[m * ldo + j] = sum_k x[m * ldx + k] * row_j[k] for m < MR, j < nvalid.
template <class D, int MR>
void micro(const D& d, const Row* rows, int nvalid, const float* x, int64_t ldx, int64_t k, float* out, int64_t ldo) {
  F acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = V::zero();
  const int64_t full = k / CH;
  for (int64_t c = 0; c < full; ++c) step<D, MR, false>(d, rows, x, ldx, c, CH, acc);
  if (k % CH) step<D, MR, true>(d, rows, x, ldx, full, int(k % CH), acc);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < nvalid; ++j) out[m * ldo + j] = V::hsum(acc[m][j]);
}

template <class D, int MR = V::MR>
void micro_rows(const D& d, const Row* rows, int nvalid, const float* x, int64_t ldx, int64_t k, float* out,
                int64_t ldo, int64_t mr) {
  if constexpr (MR > 1) {
    if (mr < MR) return micro_rows<D, MR - 1>(d, rows, nvalid, x, ldx, k, out, ldo, mr);
  }
  micro<D, MR>(d, rows, nvalid, x, ldx, k, out, ldo);
}

// How far ahead the row-streaming kernels prefetch (the rows of a stretch are contiguous, so past a
// row's end is the next row; the first bytes of the stretch are requested up front): the hardware
// prefetchers do not ramp up over the short stretches a work item streams (its rows of one expert:
// 24-64 KiB), so this keeps enough lines in flight to cover DRAM latency (a shorter
// distance measured slower than the tiles; docs/benchmarks.md). Each line is requested twice: into
// L2 at this distance (prefetcht2, which holds no L1 fill buffer while it waits on memory, so more
// lines are in flight than L1 requests allow), then into L1 STREAM_NEAR_BYTES ahead, from L2. Against
// one L1 request at this distance: bfloat16 expert calls 1.00-1.13x faster, the LM head's stream
// from 0.83-0.88x to 0.92x of a plain read of the same bytes (docs/benchmarks.md).
constexpr int64_t STREAM_PREFETCH_BYTES = 4096;
constexpr int64_t STREAM_NEAR_BYTES = 512;
// bfloat16 weights at MR < M <= STREAM_MAX_ROWS rows against float32 activations (or without
// bfloat16 dot products; else matmul_bf16w runs): blocks of STREAM_BLOCK_ROWS weight rows, each
// streamed from memory for the first MR activation rows and read again from L2 for the others, in
// place of decoding float32 tiles into a buffer (float32 weights keep the register tiles, which
// reuse each loaded weight vector for MR rows and measured faster there).
constexpr int64_t STREAM_MAX_ROWS = 16;
constexpr int64_t STREAM_BLOCK_ROWS = 16;

// Dense weights (float32, bfloat16), up to MR activation rows: one weight row at a time, so that the
// rows [n0, n1) of an expert, contiguous in memory, are read as one sequential stream (the hardware
// prefetchers and the prefetches below keep it at bandwidth; the NR-row tiles above interleave NR
// streams). Two chunks per step, VPC accumulators each, keep 2 x VPC independent
// FMA chains per activation row; the x chunks come from L1.
template <class D, int MR>
void stream_rows(const D& d, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t k, float* out, int64_t ldo) {
  const int64_t full = k / CH;
  const uint8_t* first = d.row(n0).d;
  for (int64_t b = 0; b < STREAM_PREFETCH_BYTES; b += 64) __builtin_prefetch(first + b);
  for (int64_t n = n0; n < n1; ++n) {
    const Row row = d.row(n);
    F acc[MR][2 * VPC];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2 * VPC; ++v) acc[m][v] = V::zero();
    int64_t c = 0;
    for (; c + 2 <= full; c += 2) {
      F w[2 * VPC];
      for (int b = 0; b < 2 * D::CB; b += 64) {
        __builtin_prefetch(row.d + c * D::CB + STREAM_PREFETCH_BYTES + b, 0, 1);
        __builtin_prefetch(row.d + c * D::CB + STREAM_NEAR_BYTES + b);
      }
      d.at(row, c, row.d + c * D::CB, CH, w);
      d.at(row, c + 1, row.d + (c + 1) * D::CB, CH, w + VPC);
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2 * VPC; ++v) acc[m][v] = V::fma(V::load(x + m * ldx + c * CH + v * W), w[v], acc[m][v]);
    }
    for (; c * CH < k; ++c) {  // an odd last full chunk, then a partial one (zero-padded copy)
      const int valid = int(k - c * CH < CH ? k - c * CH : CH);
      F w[VPC];
      decode(d, row, c, valid, w);
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < VPC; ++v) acc[m][v] = V::fma(V::load(x + m * ldx + c * CH + v * W), w[v], acc[m][v]);
    }
    for (int m = 0; m < MR; ++m) {
      F s = acc[m][0];
      for (int v = 1; v < 2 * VPC; ++v) s = V::add(s, acc[m][v]);
      out[m * ldo + (n - n0)] = V::hsum(s);
    }
  }
}

template <class D, int MR = V::MR>
void stream_rows_m(const D& d, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t k, float* out, int64_t ldo,
                   int64_t mr) {
  if constexpr (MR > 1) {
    if (mr < MR) return stream_rows_m<D, MR - 1>(d, n0, n1, x, ldx, k, out, ldo, mr);
  }
  stream_rows<D, MR>(d, n0, n1, x, ldx, k, out, ldo);
}

template <class D>
void matmul_fmt(const D& d, int64_t n0, int64_t n1, const float* x, int64_t M, int64_t ldx, int64_t k, float* out,
                int64_t ldo, bool dense_f32) {
  const int64_t kp = padded_k(k);
  if constexpr (std::is_same<D, DecF32>::value || std::is_same<D, DecBF16>::value) {
    if (M <= V::MR) return stream_rows_m(d, n0, n1, x, ldx, k, out, ldo, M);
    if (std::is_same<D, DecBF16>::value && M <= STREAM_MAX_ROWS) {  // MR rows at a time over a block of rows in L2
      for (int64_t nb = n0; nb < n1; nb += STREAM_BLOCK_ROWS) {
        const int64_t ne = nb + STREAM_BLOCK_ROWS < n1 ? nb + STREAM_BLOCK_ROWS : n1;
        for (int64_t m = 0; m < M; m += V::MR)
          stream_rows_m(d, nb, ne, x + m * ldx, ldx, k, out + m * ldo + (nb - n0), ldo, M - m < V::MR ? M - m : V::MR);
      }
      return;
    }
  }
  const bool buffered = M > V::MR && !dense_f32;
  const int64_t per_row = kp / 16 + 16;  // room for the block multipliers of one row
  float* buf = buffered ? static_cast<float*>(std::aligned_alloc(64, sizeof(float) * NR * kp)) : nullptr;
  float* sbuf = D::SCALED ? static_cast<float*>(std::aligned_alloc(64, sizeof(float) * NR * per_row)) : nullptr;
  for (int64_t n = n0; n < n1; n += NR) {
    const int nvalid = int(n1 - n < NR ? n1 - n : NR);
    Row rows[NR];
    for (int j = 0; j < NR; ++j) {
      const int64_t nj = n + (j < nvalid ? j : nvalid - 1);
      rows[j] = d.row(nj);
      if (D::SCALED) {
        d.scales(nj, sbuf + j * per_row);
        rows[j].s = sbuf + j * per_row;
      }
    }
    float* o = out + (n - n0);
    if (!buffered) {
      for (int64_t m = 0; m < M; m += V::MR)
        micro_rows(d, rows, nvalid, x + m * ldx, ldx, k, o + m * ldo, ldo, M - m < V::MR ? M - m : V::MR);
      continue;
    }
    for (int j = 0; j < NR; ++j) {  // decode the tile once, row by row (one stream at a time): NR x kp floats
      for (int64_t c = 0; c < kp / CH; ++c) {
        const int valid = int(k - c * CH <= 0 ? 0 : (k - c * CH < CH ? k - c * CH : CH));
        F w[VPC];
        for (int v = 0; v < VPC; ++v) w[v] = V::zero();
        __builtin_prefetch(rows[j].d + (c + 4 * PREFETCH_CHUNKS) * D::CB);
        if (valid == CH) {
          d.at(rows[j], c, rows[j].d + c * D::CB, CH, w);
        } else if (valid > 0) {
          decode(d, rows[j], c, valid, w);
        }
        for (int v = 0; v < VPC; ++v) V::store(buf + j * kp + c * CH + v * W, w[v]);
      }
    }
    const DecF32 f{reinterpret_cast<const uint8_t*>(buf), int64_t(sizeof(float)) * kp};  // rows already scaled
    Row brows[NR];
    for (int j = 0; j < NR; ++j) brows[j] = f.row(j);
    for (int64_t m = 0; m < M; m += V::MR)
      micro_rows(f, brows, nvalid, x + m * ldx, ldx, kp, o + m * ldo, ldo, M - m < V::MR ? M - m : V::MR);
  }
  std::free(buf);
  std::free(sbuf);
}

// Requests the bytes of rows [n, n + rows) of d, `bytes` per row: the rows of a range that no
// earlier tile prefetches as it runs (a work item's range starts cold in a decode step).
template <class D>
inline void prefetch_rows(const D& d, int64_t n, int64_t rows, int64_t bytes) {
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* p = d.row(n + j).d;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
  }
}

// How far ahead the quantized decode tiles (4-bit, FP8) prefetch, in bytes of the rows they stream:
// each step requests the same line of the row QUANT_PREFETCH_BYTES further on (rounded up to whole
// tiles), and a range's first rows up to that distance are requested up front.
constexpr int64_t QUANT_PREFETCH_BYTES = 4096;

// Rows ahead for a tile of tr rows of `stride` bytes: at least one tile, at least `bytes`.
inline int64_t rows_ahead(int64_t stride, int tr, int64_t bytes) {
  const int64_t rows = stride > 0 ? (bytes + stride - 1) / stride : tr;
  return (rows + tr - 1) / tr * tr;
}

// The 4-bit formats (LPB: product lanes per block, see V::e2m1_i16_tile) on the variant's 16-bit
// integer dot products, V::bf16_tile_rows rows at a time, for any number of activation rows that hold
// bfloat16 values, MR at a time (a tile is read from memory for the first MR rows and decoded again
// from L1 for the others: cheaper than the float32 kernels' decode into a buffer, whose
// multiply-adds take twice the instructions); false (nothing done) where the variant has none. kb
// blocks per row, kp elements per row (a multiple of 16). The activation rows are converted to
// 16-bit integers with a power-of-two multiplier per 128-element step once per call, in the layout
// the tiles read.
template <int LPB, class D, class VV = V>
bool matmul_bf16(const D& d, int64_t kb, int64_t n0, int64_t n1, const float* x, int64_t M, int64_t ldx, int64_t kp,
                 float* out, int64_t ldo) {
  if constexpr (!VV::BF16_DOT) {
    return false;
  } else {
    constexpr int TR = VV::BF16_TILE_ROWS;  // the most rows a tile takes
    const int tr = VV::bf16_tile_rows(M < VV::MR ? M : VV::MR);
    const int64_t steps = (kp + VV::BF16_STEP - 1) / VV::BF16_STEP;
    const int64_t per_row = (kb + 8 + 15) / 16 * 16;  // the multipliers, then zeros the last step may read
    float* sbuf = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * TR * per_row));
    // the rows up to the prefetch distance and their block scales, requested up front; then each
    // tile requests the block scales of the rows `ahead` rows on (the tiles request their bytes)
    const int64_t ahead = rows_ahead(d.stride, tr, QUANT_PREFETCH_BYTES);
    prefetch_rows(d, n0, n1 - n0 < ahead ? n1 - n0 : ahead, kp / 2);
    for (int64_t b = 0; b < (ahead + tr) * d.ss_r; b += 64) __builtin_prefetch(d.scale_row(n0) + b);
    auto* xi = static_cast<typename VV::IX*>(std::aligned_alloc(64, (64 * 4 + 64) * steps * M));
    float* xs = reinterpret_cast<float*>(xi + 4 * steps * M);  // the rows' step multipliers
    VV::i16_x_e2m1(x, ldx, kp, M, xi, xs);
    for (int64_t n = n0; n < n1; n += tr) {
      const int nvalid = int(n1 - n < tr ? n1 - n : tr);
      const uint8_t* rd[TR];
      const float* rs[TR];
      if (kb % (16 / LPB) == 0 && d.scales_run_ok(n, nvalid)) {
        // every step of a row takes whole blocks (no zeros past a row's last one), and the tile's
        // rows' scales lie one after another: decoded in one pass, row j's at sbuf + j * kb
        d.scales_run(n, nvalid, sbuf);
        for (int j = 0; j < tr; ++j) {
          const int jj = j < nvalid ? j : nvalid - 1;
          rd[j] = d.row(n + jj).d;
          rs[j] = sbuf + jj * kb;
        }
      } else {
        for (int j = 0; j < tr; ++j) {
          const int64_t nj = n + (j < nvalid ? j : nvalid - 1);
          float* sj = sbuf + j * per_row;
          d.scales(nj, sj);
          std::memset(sj + kb, 0, sizeof(float) * 8);
          rd[j] = d.row(nj).d;
          rs[j] = sj;
        }
      }
      for (int64_t b = 0; b < tr * d.ss_r; b += 64) __builtin_prefetch(d.scale_row(n + ahead + tr) + b);
      for (int64_t m = 0; m < M; m += VV::MR)  // the tile from memory for the first MR rows, from L1 after
        VV::template e2m1_i16<LPB>(rd, rs, m == 0 ? ahead * d.stride : 0, nvalid, xi + m * steps * 4, xs + m * steps,
                                   kp, out + m * ldo + (n - n0), ldo, M - m < VV::MR ? M - m : VV::MR, tr);
    }
    std::free(xi);
    std::free(sbuf);
    return true;
  }
}

// FP8 weights on the variant's bfloat16 dot products (V::fp8_tiles), V::bf16_tile_rows rows at a
// time, for any number of activation rows that hold bfloat16 values, MR at a time (as matmul_bf16);
// false (nothing done) where the variant has none. With `vbmi` (and block widths a multiple of V::FP8_VBMI_STEP) the tiles decode
// with byte permutes, else word permutes. The activation rows are converted to
// bfloat16 once per call, in the layout the chosen tiles read.
template <class VV = V>
bool matmul_fp8_bf16(const DecFP8& d, int64_t k, int64_t n0, int64_t n1, const float* x, int64_t M, int64_t ldx,
                     float* out, int64_t ldo, bool vbmi) {
  if constexpr (!VV::BF16_DOT) {
    return false;
  } else {
    constexpr int TR = VV::BF16_TILE_ROWS;
    const int tr = VV::bf16_tile_rows(M < VV::MR ? M : VV::MR);
    const bool bytes = vbmi && d.qbk % VV::FP8_VBMI_STEP == 0;
    const int64_t kp = bytes ? (k + VV::FP8_VBMI_STEP - 1) / VV::FP8_VBMI_STEP * VV::FP8_VBMI_STEP : padded_k(k);
    const int64_t ahead = rows_ahead(d.stride, tr, QUANT_PREFETCH_BYTES);
    prefetch_rows(d, n0, n1 - n0 < ahead ? n1 - n0 : ahead, k);  // the rows up to the prefetch distance, up front
    auto* xb = static_cast<typename VV::BX*>(std::aligned_alloc(64, 64 * (kp / 32) * M));
    if (bytes) {
      VV::bf16_x_fp8_vbmi(x, ldx, padded_k(k), kp, M, xb);
    } else {
      VV::bf16_x_plain(x, ldx, kp, M, xb);
    }
    for (int64_t n = n0; n < n1; n += tr) {
      const int nvalid = int(n1 - n < tr ? n1 - n : tr);
      const uint8_t* rd[TR];
      const float* rs[TR];
      for (int j = 0; j < tr; ++j) {
        const Row r = d.row(n + (j < nvalid ? j : nvalid - 1));
        rd[j] = r.d;
        rs[j] = r.s;
      }
      for (int64_t m = 0; m < M; m += VV::MR) {  // the tile from memory for the first MR rows, from L1 after
        const int64_t pf = m == 0 ? ahead * d.stride : 0, mr = M - m < VV::MR ? M - m : VV::MR;
        if (bytes) {
          VV::template fp8_tiles<true>(rd, rs, pf, nvalid, xb + m * (kp / 32), k, d.qbk, out + m * ldo + (n - n0), ldo, mr, tr);
        } else {
          VV::template fp8_tiles<false>(rd, rs, pf, nvalid, xb + m * (kp / 32), k, d.qbk, out + m * ldo + (n - n0), ldo, mr, tr);
        }
      }
    }
    std::free(xb);
    return true;
  }
}

// bfloat16 weights on the variant's bfloat16 dot products (V::bf16w_rows), for any number of
// activation rows that hold bfloat16 values (`matmul` takes it above MR rows); false (nothing done)
// where the variant has none. The rows [n0, n1) are read once, as one stream, for all activation
// rows (half the instructions per weight of the float32 kernels, which widen every weight and read
// blocks of rows again per tile of MR activation rows: 1.8x faster for an expert layer at 8 rows per
// expert, docs/benchmarks.md). The activation rows are converted to bfloat16 once per call.
template <class VV = V>
bool matmul_bf16w(const DecBF16& d, int64_t k, int64_t n0, int64_t n1, const float* x, int64_t M, int64_t ldx,
                  float* out, int64_t ldo) {
  if constexpr (!VV::BF16_DOT) {
    return false;
  } else {
    const int64_t chunks = padded_k(k) / 32;
    auto* xb = static_cast<typename VV::BX*>(std::aligned_alloc(64, 64 * chunks * M));
    VV::bf16_x_plain(x, ldx, padded_k(k), M, xb);
    const uint8_t* first = d.row(n0).d;
    for (int64_t b = 0; b < STREAM_PREFETCH_BYTES; b += 64) __builtin_prefetch(first + b);
    VV::bf16w_rows(first, d.stride, n1 - n0, xb, k, out, ldo, STREAM_PREFETCH_BYTES, STREAM_NEAR_BYTES, M);
    std::free(xb);
    return true;
  }
}

// exp(x) for the activations: Cephes' single-precision polynomial on x - n ln2, times 2^n
// (relative error about 2 ulp); the argument is clamped to [-87, 88] so 2^n stays a normal float.
F vexp(F x) {
  x = V::min(V::max(x, V::set1(-87.0f)), V::set1(88.0f));
  const F n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  F r = V::fma(n, V::set1(-0.693359375f), x);
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  F p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  p = V::fma(V::mul(p, r), r, V::add(r, V::set1(1.0f)));
  return V::mul(p, V::pow2n(n));
}

F act_vec(int act, F g, F u) {
  const F one = V::set1(1.0f);
  if (act == ACT_SILU) return V::mul(V::div(g, V::add(one, vexp(V::sub(V::zero(), g)))), u);
  g = V::min(g, V::set1(7.0f));
  u = V::min(V::max(u, V::set1(-7.0f)), V::set1(7.0f));
  const F sig = V::div(one, V::add(one, vexp(V::mul(g, V::set1(-1.702f)))));
  return V::mul(V::mul(V::add(u, one), g), sig);
}

}  // namespace

void matmul(const Weights& w, int64_t e, int64_t n0, int64_t n1, const float* x, int64_t M, int64_t ldx, float* out,
            int64_t ldo) {
  if (M <= 0 || n1 <= n0) return;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  switch (w.fmt) {
    case FMT_F32: {
      const DecF32 d{data + e * w.sd_e * 4, w.sd_n * 4};
      return matmul_fmt(d, n0, n1, x, M, ldx, w.k, out, ldo, true);
    }
    case FMT_BF16: {
      const DecBF16 d{data + e * w.sd_e * 2, w.sd_n * 2};
      // up to MR rows the float32 stream (as fast at these sizes, with no conversion of x per call)
      if (w.bf16_x && M > V::MR && matmul_bf16w(d, w.k, n0, n1, x, M, ldx, out, ldo)) return;
      return matmul_fmt(d, n0, n1, x, M, ldx, w.k, out, ldo, false);
    }
    case FMT_FP8: {
      const DecFP8 d{data + e * w.sd_e, w.sd_n, static_cast<const float*>(w.scale) + e * w.ss_e, w.ss_r,
                     w.seg_rows, w.per_seg, w.qbn, w.qbk};
      if (w.bf16_x && matmul_fp8_bf16(d, w.k, n0, n1, x, M, ldx, out, ldo, w.vbmi != 0)) return;
      return matmul_fmt(d, n0, n1, x, M, ldx, w.k, out, ldo, false);
    }
    case FMT_MXFP4: {
      const DecMXFP4 d{data + e * w.sd_e, w.sd_n, static_cast<const uint8_t*>(w.scale) + e * w.ss_e, w.ss_r,
                       padded_k(w.k) / 32};
      if (w.bf16_x && matmul_bf16<4>(d, d.kb, n0, n1, x, M, ldx, padded_k(w.k), out, ldo)) return;
      return matmul_fmt(d, n0, n1, x, M, ldx, padded_k(w.k), out, ldo, false);
    }
    case FMT_NVFP4: {
      const DecNVFP4 d{data + e * w.sd_e, w.sd_n, static_cast<const uint8_t*>(w.scale) + e * w.ss_e, w.ss_r,
                       w.scale2 + e * w.s2_e, w.seg_rows, (w.k + 15) / 16};
      if (w.bf16_x && matmul_bf16<2>(d, d.kb, n0, n1, x, M, ldx, (w.k + 15) / 16 * 16, out, ldo)) return;
      return matmul_fmt(d, n0, n1, x, M, ldx, (w.k + 15) / 16 * 16, out, ldo, false);
    }
  }
}

void activation(int act, const float* g, const float* u, float* h, int64_t count) {
  int64_t i = 0;
  for (; i + W <= count; i += W) V::store(h + i, act_vec(act, V::load(g + i), V::load(u + i)));
  if (i < count) {
    alignas(64) float gt[W] = {0}, ut[W] = {0}, ht[W];
    std::memcpy(gt, g + i, (count - i) * 4);
    std::memcpy(ut, u + i, (count - i) * 4);
    V::store(ht, act_vec(act, V::load(gt), V::load(ut)));
    std::memcpy(h + i, ht, (count - i) * 4);
  }
}

void prepare_row(int fmt, const float* src, int64_t k, float* dst) {
  const int64_t kp = padded_k(k);
  std::memset(dst, 0, kp * sizeof(float));
  if (fmt != FMT_MXFP4 && fmt != FMT_NVFP4) {
    std::memcpy(dst, src, k * sizeof(float));
    return;
  }
  // element i = pair p (= i / 2), low or high nibble: each group of 2W elements becomes its W even
  // elements, then its W odd ones
  const int64_t whole = k / (2 * W) * (2 * W);
  for (int64_t g = 0; g < whole; g += 2 * W) {
    for (int p = 0; p < W; ++p) {
      dst[g + p] = src[g + 2 * p];
      dst[g + W + p] = src[g + 2 * p + 1];
    }
  }
  for (int64_t i = whole; i < k; ++i) dst[whole + (i & 1) * W + (i - whole) / 2] = src[i];
}

// One pass for the block maxima (blocks of SEARCH_BLOCK elements: the first block that holds the
// row's maximum is searched for its first index afterwards) and the non-finite check (x - x is 0 for
// a finite x, NaN otherwise), one for the exponentials (vexp: within about 2 ulp; a term below
// exp(-87) counts as exp(-87), at most n * 2^-125 in all against a sum of at least 1).
bool max_sumexp(const float* x, int64_t n, float* mx, int64_t* first, float* sumexp) {
  constexpr int64_t SEARCH_BLOCK = 16 * W;
  const int64_t whole = n / W * W;
  F bad = V::zero();
  float m = -INFINITY, tail_bad = 0.f;
  int64_t block = -1, at = -1;  // the first block holding m, or (at) its index past the whole vectors
  for (int64_t b0 = 0; b0 < whole; b0 += SEARCH_BLOCK) {
    const int64_t b1 = b0 + SEARCH_BLOCK < whole ? b0 + SEARCH_BLOCK : whole;
    F mv = V::load(x + b0);
    bad = V::add(bad, V::sub(mv, mv));
    for (int64_t j = b0 + W; j < b1; j += W) {
      const F v = V::load(x + j);
      mv = V::max(mv, v);
      bad = V::add(bad, V::sub(v, v));
    }
    const float bm = V::hmax(mv);
    if (bm > m) m = bm, block = b0;
  }
  for (int64_t j = whole; j < n; ++j) {
    tail_bad += x[j] - x[j];
    if (x[j] > m) m = x[j], at = j;
  }
  if (!(V::hsum(bad) + tail_bad == 0.f)) return false;  // a NaN or an infinity
  if (at < 0) {
    const int64_t b1 = block + SEARCH_BLOCK < whole ? block + SEARCH_BLOCK : whole;
    for (at = block; at < b1 && x[at] != m; ++at) {
    }
  }
  const F mv = V::set1(m);
  F acc = V::zero();
  for (int64_t j = 0; j < whole; j += W) acc = V::add(acc, vexp(V::sub(V::load(x + j), mv)));
  float s = V::hsum(acc);
  for (int64_t j = whole; j < n; ++j) s += std::exp(x[j] - m);
  *mx = m;
  *first = at;
  *sumexp = s;
  return true;
}

}  // namespace MOEMESH_ISA
}  // namespace moemesh_cpu
