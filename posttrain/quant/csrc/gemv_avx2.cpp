// Weight-streaming matmul kernels for small batches on AVX2+FMA CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Decode (M = 1..16) reads every weight once and does little arithmetic per byte, so the work is bounded by how
// fast the weights stream from DRAM. Each kernel therefore (1) widens a few weights at a time to fp32 in registers,
// never writing a dequantized matrix, (2) keeps 4 output rows in flight so the FMA chains and memory streams
// overlap, and (3) splits the output rows across threads with at::parallel_for (the same OpenMP pool as torch).
//
// Weight layout, all formats: output rows in tiles of 4 (N padded with zero rows to a multiple of 4); a tile stores,
// for each run of 16 columns, the 4 rows' codes one after another: codes [N_padded / 4, K / 16, 4, chunk bytes].
// A thread then reads its rows as one sequential stream; row-major rows read 4 at a time are 4 short streams that
// the prefetcher follows badly when K is ~1024 (bf16 [3072, 1024] went from ~10 to ~15 GB/s with tiles).
// K must be a multiple of 16. Per format, a 16-column chunk is:
//   fp32: 16 floats (64 bytes): torch's fp32 matrix-vector product streams well below the read bandwidth here.
//   bf16: 16 bf16 values (32 bytes).
//   int8: 16 int8 codes, fp32 scale [N_padded]: w = q * scale[n].
//   int4: 8 bytes, byte j = u[j] | u[j + 8] << 4 with u in [0, 15] (one zero-extending load widens the 8 bytes to
//         8 lanes); fp32 scale_offset [N_padded, K / group_size, 2]: w = u * scale + offset (offset = -zero * scale).
//   fp8:  16 float8_e4m3fn bytes, fp32 scale [N_padded]: w = fp8_value(q) * scale[n].
// x [..., K] may be fp32, bf16 or fp16; it is widened to fp32 once per call (it is small). y [..., N] has x's dtype.
#include "gemv_common.h"

namespace {

using namespace posttrain_gemv;

constexpr int64_t kMaxXRows = 3;  // activation rows per pass over a row tile (accumulators: 4 x 3 = 12 ymm)
constexpr int64_t kChunk = 16;    // columns decoded per step: two fp32 ymm vectors

// ---- per-format decoders: the 16 codes of one row at p -> lo (columns k..k+7), hi (k+8..k+15) as fp32 ----
// kPrefetch: software-prefetch kPrefetchBytes ahead in the stream. Measured on the 2-core EPYC (DRAM-bound shapes,
// 2 threads): +7-20 % for bf16, int8 and fp8; -3 % for fp32, whose hardware prefetch already keeps up, and -15 % for
// int4, which is compute-bound and pays for the extra instructions.
// Ungrouped formats multiply the finished dot product by row_scale(n). Grouped ones (int4) scale each group's
// partial dot product by group_scale(n, g) and add offset(n, m) = sum_g offset[n, g] * sum(x[m, group g]), which
// keeps the per-weight work to widening the code and one FMA.

struct Fp32Weights {
  static constexpr bool kPrefetch = false;
  static constexpr bool kGrouped = false;
  static constexpr int64_t kChunkBytes = 64;
  static inline void decode(const uint8_t* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    hi = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
  }
  inline float row_scale(int64_t) const { return 1.0f; }
};

struct Bf16Weights {
  static constexpr bool kPrefetch = true;
  static constexpr bool kGrouped = false;
  static constexpr int64_t kChunkBytes = 32;
  static inline void decode(const uint8_t* p, __m256& lo, __m256& hi) {
    // bf16 is the top half of an fp32: zero-extend each 16-bit value to 32 bits and shift it up.
    const __m128i* v = reinterpret_cast<const __m128i*>(p);
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v + 1)), 16));
  }
  inline float row_scale(int64_t) const { return 1.0f; }
};

// One byte per code and one fp32 scale per output row (int8, fp8).
struct ByteCodesRowScale {
  static constexpr bool kPrefetch = true;
  static constexpr bool kGrouped = false;
  static constexpr int64_t kChunkBytes = 16;
  const float* scale;  // [N_padded]
};

struct Int8Weights : ByteCodesRowScale {
  static inline void decode(const uint8_t* p, __m256& lo, __m256& hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
  inline float row_scale(int64_t n) const { return scale[n]; }
};

struct Fp8Weights : ByteCodesRowScale {
  static inline void decode(const uint8_t* p, __m256& lo, __m256& hi) {
    // E4M3 byte s eeee mmm -> fp16 bits s 0 eeee mmm 0000000 (sign-extend to 16 bits, shift, mask), which is
    // the value times 2^-8 (exponent bias 7 -> 15), subnormal codes included; F16C widens that to fp32 exactly and
    // row_scale puts the 2^8 back. NaN codes (0x7F, 0xFF) decode as +-480: quantizers never emit them.
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(short(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
  }
  inline float row_scale(int64_t n) const { return scale[n] * 256.0f; }
};

// The low nibble is never masked out: the low lanes decode to u[j] + 16 u[j + 8] and the high lanes to u[j + 8],
// and `run` feeds them x[j] and x[j + 8] - 16 x[j] instead of x[j] and x[j + 8]; the products sum to the same dot
// product with one integer op fewer per 16 weights (int4 decode is compute-bound here). The price is rounding
// error relative to 255 |x| instead of 15 |x| per term, still ~1e-6 in fp32.
struct Int4Weights {
  static constexpr bool kPrefetch = false;
  static constexpr bool kGrouped = true;
  static constexpr int64_t kChunkBytes = 8;
  const float* scale_offset;  // [N_padded, groups, 2]
  const float* x_group_sums;  // [M, groups]: sum of x over each group's columns
  int64_t group;   // columns per group (a multiple of 16, so a decoded chunk never straddles two groups)
  int64_t groups;  // K / group
  static inline void decode(const uint8_t* p, __m256& lo, __m256& hi) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(wide);                        // lane j: u[j] + 16 u[j + 8]
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));  // lane j: u[j + 8]
  }
  inline float group_scale(int64_t n, int64_t g) const { return scale_offset[(n * groups + g) * 2]; }
  inline float offset(int64_t n, int64_t m) const {
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; ++g) sum += scale_offset[(n * groups + g) * 2 + 1] * x_group_sums[m * groups + g];
    return sum;
  }
};

// ---- the shared driver ----

// Start of the codes of row r of tile t, columns [k, k + 16): tiles are [K / 16 chunks][4 rows][chunk bytes].
template <class Weights>
inline const uint8_t* chunk_at(const uint8_t* codes, int64_t K, int64_t t, int64_t r, int64_t k) {
  return codes + ((t * (K / kChunk) + k / kChunk) * kRowsPerTile + r) * Weights::kChunkBytes;
}

// Dot products of the 4 rows of tile t with MB activation rows (x_rows[0..MB)), before row scale / offset.
// With one activation row (and no groups, whose accumulators already fill the registers) the lo and hi halves go to
// separate accumulators so each FMA chain waits less; grouped formats fold each group's partial sums into `total`
// with the group's scale.
template <class Weights, int MB>
inline void dot_tile(const Weights& w, const uint8_t* codes, int64_t t, const float* const* x_rows, int64_t K,
                     float dots[kRowsPerTile][MB]) {
  constexpr int R = kRowsPerTile;
  int64_t span = K;
  if constexpr (Weights::kGrouped) span = w.group;
  __m256 total[R][MB];
  for (int64_t k0 = 0; k0 < K; k0 += span) {
    __m256 acc_lo[R][MB], acc_hi[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc_lo[r][m] = acc_hi[r][m] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + span; k += kChunk) {
      const uint8_t* p = chunk_at<Weights>(codes, K, t, 0, k);  // the 4 rows' chunks follow one another
      if constexpr (Weights::kPrefetch) {
        for (int64_t off = 0; off < R * Weights::kChunkBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + off), _MM_HINT_T0);
      }
      __m256 x_lo[MB], x_hi[MB];  // loaded once for the 4 rows
      for (int m = 0; m < MB; ++m) {
        x_lo[m] = _mm256_loadu_ps(x_rows[m] + k);
        x_hi[m] = _mm256_loadu_ps(x_rows[m] + k + 8);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256 lo, hi;
        Weights::decode(p + r * Weights::kChunkBytes, lo, hi);
#pragma GCC unroll 3
        for (int m = 0; m < MB; ++m) {
          acc_lo[r][m] = _mm256_fmadd_ps(lo, x_lo[m], acc_lo[r][m]);
          if (MB == 1 && !Weights::kGrouped)
            acc_hi[r][m] = _mm256_fmadd_ps(hi, x_hi[m], acc_hi[r][m]);
          else
            acc_lo[r][m] = _mm256_fmadd_ps(hi, x_hi[m], acc_lo[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < MB; ++m) {
        const __m256 partial = _mm256_add_ps(acc_lo[r][m], acc_hi[r][m]);
        if constexpr (Weights::kGrouped) {
          const __m256 s = _mm256_set1_ps(w.group_scale(t * R + r, k0 / span));
          total[r][m] = k0 == 0 ? _mm256_mul_ps(partial, s) : _mm256_fmadd_ps(partial, s, total[r][m]);
        } else {
          total[r][m] = partial;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) dots[r][m] = horizontal_sum(total[r][m]);
}

template <typename OutT>
struct Output {
  OutT* y;            // [M, N]
  const float* bias;  // [N] or nullptr
  int64_t N;          // rows to store: padding rows of the last tile are computed but dropped
};

template <class Weights, int MB, typename OutT>
inline void tile_and_store(const Weights& w, const uint8_t* codes, int64_t t, const float* const* x_rows, int64_t m0,
                           int64_t K, const Output<OutT>& out) {
  float dots[kRowsPerTile][MB];
  dot_tile<Weights, MB>(w, codes, t, x_rows, K, dots);
  for (int r = 0; r < kRowsPerTile; ++r) {
    const int64_t n = t * kRowsPerTile + r;
    if (n >= out.N) break;
    for (int m = 0; m < MB; ++m) {
      float v;
      if constexpr (Weights::kGrouped) v = dots[r][m] + w.offset(n, m0 + m);
      else v = dots[r][m] * w.row_scale(n);
      if (out.bias) v += out.bias[n];
      out.y[(m0 + m) * out.N + n] = static_cast<OutT>(v);
    }
  }
}

// Each thread walks its tiles in memory order, one sequential stream the hardware prefetcher follows. For each tile
// all activation rows go past it in groups of up to kMaxXRows while its 4 rows sit in L1/L2, so DRAM sees each
// weight once even when M > kMaxXRows.
template <class Weights, typename OutT>
void run_tiles(const Weights& w, const uint8_t* codes, const float* x, int64_t M, int64_t K, int64_t tiles,
               const Output<OutT>& out) {
  // Below ~64k weights per task, thread start-up costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (K * kRowsPerTile));
  at::parallel_for(0, tiles, grain, [&](int64_t tile_begin, int64_t tile_end) {
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {
        const float* x_rows[kMaxXRows];
        const int64_t mb = std::min(kMaxXRows, M - m0);
        for (int64_t i = 0; i < mb; ++i) x_rows[i] = x + (m0 + i) * K;
        if (mb == 1) tile_and_store<Weights, 1>(w, codes, t, x_rows, m0, K, out);
        else if (mb == 2) tile_and_store<Weights, 2>(w, codes, t, x_rows, m0, K, out);
        else tile_and_store<Weights, 3>(w, codes, t, x_rows, m0, K, out);
      }
    }
  });
}

// ---- argument handling ----

// y [..., N] in x_in's dtype from x_in [..., K]; the activations are widened to fp32 once (they are small).
template <class Weights>
at::Tensor run(Weights w, const at::Tensor& codes, const at::Tensor& x_in, int64_t N, int64_t K,
               const c10::optional<at::Tensor>& bias) {
  const at::Tensor x = as_rows(x_in, K);
  const int64_t M = x.size(0);
  std::vector<float> x_storage;
  const float* xf = activations_as_fp32(x, x_storage);
  std::vector<float> x_group_sums, x_mixed;
  if constexpr (Weights::kGrouped) {
    x_group_sums.assign(M * w.groups, 0.0f);  // [M, groups], for the offset (zero-point) term
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < w.groups; ++g)
        x_group_sums[m * w.groups + g] = sum_floats(xf + m * K + g * w.group, w.group);
    w.x_group_sums = x_group_sums.data();
    // Int4Weights::decode's low lanes hold u[j] + 16 u[j + 8]: feed them x[j] and the high lanes x[j + 8] - 16 x[j].
    x_mixed.assign(xf, xf + M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += kChunk)
        for (int j = 0; j < 8; ++j) x_mixed[m * K + k + 8 + j] = xf[m * K + k + 8 + j] - 16.0f * xf[m * K + k + j];
    xf = x_mixed.data();
  }
  at::Tensor y = empty_output(x_in, N);
  const float* bias_ptr = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* c = static_cast<const uint8_t*>(codes.data_ptr());
  with_output_pointer(y, [&](auto* out) {
    using OutT = std::remove_pointer_t<decltype(out)>;
    run_tiles(w, c, xf, M, K, codes.size(0), Output<OutT>{out, bias_ptr, N});
  });
  return y;
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& codes, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  const int64_t K = check_codes(codes, at::kBFloat16, kChunk, kChunk, out_features);
  check_bias(bias, out_features);
  return run(Bf16Weights{}, codes, x, out_features, K, bias);
}

at::Tensor gemv_fp32(const at::Tensor& x, const at::Tensor& codes, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  const int64_t K = check_codes(codes, at::kFloat, kChunk, kChunk, out_features);
  check_bias(bias, out_features);
  return run(Fp32Weights{}, codes, x, out_features, K, bias);
}

// int8 and fp8: one byte per code (ByteCodesRowScale), stored as `code_type`.
template <typename Weights>
at::Tensor gemv_row_scaled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           int64_t out_features, const c10::optional<at::Tensor>& bias, at::ScalarType code_type) {
  const int64_t K = check_codes(codes, code_type, kChunk, kChunk, out_features);
  check_fp32(scale, "scale [N_padded]", codes.size(0) * kRowsPerTile);
  check_bias(bias, out_features);
  return run(Weights{{scale.data_ptr<float>()}}, codes, x, out_features, K, bias);
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  return gemv_row_scaled<Int8Weights>(x, codes, scale, out_features, bias, at::kChar);
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_offset,
                     int64_t group_size, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  const int64_t K = check_codes(codes, at::kByte, kChunk, kChunk / 2, out_features);
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0 && K % group_size == 0,
              "group_size must be a multiple of ", kChunk, " dividing K = ", K, ", got ", group_size);
  const int64_t groups = K / group_size;
  check_fp32(scale_offset, "scale_offset [N_padded, groups, 2]", codes.size(0) * kRowsPerTile * groups * 2);
  check_bias(bias, out_features);
  return run(Int4Weights{scale_offset.data_ptr<float>(), nullptr, group_size, groups}, codes, x, out_features, K,
             bias);
}

at::Tensor gemv_fp8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t out_features,
                    const c10::optional<at::Tensor>& bias) {
  return gemv_row_scaled<Fp8Weights>(x, codes, scale, out_features, bias, at::kByte);
}

}  // namespace

TORCH_LIBRARY(posttrain_quant, m) {
  m.def("gemv_fp32(Tensor x, Tensor codes, int out_features, Tensor? bias) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor codes, int out_features, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor codes, Tensor scale, int out_features, Tensor? bias) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor codes, Tensor scale_offset, int group_size, int out_features, Tensor? bias)"
        " -> Tensor");
  m.def("gemv_fp8(Tensor x, Tensor codes, Tensor scale, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(posttrain_quant, CPU, m) {
  m.impl("gemv_fp32", &gemv_fp32);
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int4", &gemv_int4);
  m.impl("gemv_fp8", &gemv_fp8);
}
