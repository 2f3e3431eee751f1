// int4 weights x int8-quantized activations on AVX2: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for decode.
//
// Widening int4 codes to fp32 costs ~6 vector ops per 16 weights (gemv_avx2.cpp), which on 2 AVX2 cores cannot
// keep up with DRAM. Here the activations are rounded to int8 once per call, per block of 32 columns with scale
// max|x| / 127 (as llama.cpp does), and the weights stay integer: _mm256_maddubs_epi16 multiplies 32 unsigned
// 4-bit codes by 32 int8 activations and adds pairs, _mm256_madd_epi16 adds pairs again, and only the 8 int32 sums
// of a block are converted to fp32, ~5 ops per 32 weights. The price is the activation rounding: |x - x_hat| <=
// max|x_block| / 254, an output error of ~0.5 % of the typical |y| on Gaussian data (bf16 activations, as on the
// aten int4 path, give ~0.2 %; the int4 weight rounding itself ~10 %).
//
// Weight layout: tiles of 4 output rows (N padded with zero rows), each [K / 64 chunks][4 rows][32 bytes]; byte i
// of a row's chunk holds u[i] in its low nibble and u[i + 32] in its high one (u in [0, 15], columns relative to the
// chunk), so masking the 32 bytes gives columns 0..31 in order and shifting gives 32..63. fp32 scale_offset
// [N_padded, K / group_size, 2]: w = u * scale + offset. group_size must be a multiple of 32, K of 64.
#include "gemv_common.h"

#include <limits>

namespace {

using namespace posttrain_gemv;

constexpr int64_t kBlock = 32;       // columns per activation scale, and per half of a chunk
constexpr int64_t kChunkCols = 64;   // columns per 32-byte chunk of one row
constexpr int64_t kChunkBytes = 32;

// Activations rounded to int8 per 32-column block: x ~ q * scale.
struct QuantizedActivations {
  std::vector<int8_t> q;            // [M, K]
  std::vector<float> scale;         // [M, K / 32]
  std::vector<float> group_sums;    // [M, groups]: sum of the rounded activations q * scale over each group
};

// Rounds 32 floats to int8 with scale max|x| / 127 (round half to even, the default MXCSR mode); returns the
// scale and adds the 32 codes into *code_sum. A NaN or infinite x gives a NaN scale, so it reaches the output
// as it would in fp32 instead of vanishing into a clamped code.
inline float quantize_block(const float* x, int8_t* q, int32_t* code_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps(), non_finite = _mm256_setzero_ps();  // x * 0 is NaN only for NaN / inf
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    non_finite = _mm256_add_ps(non_finite, _mm256_mul_ps(v[i], _mm256_setzero_ps()));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float block_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inverse = _mm256_set1_ps(block_max > 0.0f ? 127.0f / block_max : 0.0f);
  __m256i ints[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // in [-127, 127]
    sum = _mm256_add_epi32(sum, ints[i]);
  }
  // int32 -> int8: the packs interleave 128-bit lanes, the permute restores column order.
  const __m256i words = _mm256_packs_epi32(ints[0], ints[1]), words_hi = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes = _mm256_packs_epi16(words, words_hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  for (int i = 0; i < 8; ++i) *code_sum += lanes[i];
  return horizontal_sum(non_finite) == 0.0f ? block_max / 127.0f : std::numeric_limits<float>::quiet_NaN();
}

QuantizedActivations quantize_activations(const float* x, int64_t M, int64_t K, int64_t group) {
  const int64_t blocks = K / kBlock, groups = K / group;
  QuantizedActivations a{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * groups)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t code_sum = 0;
      const float scale = quantize_block(x + m * K + b * kBlock, a.q.data() + m * K + b * kBlock, &code_sum);
      a.scale[m * blocks + b] = scale;
      a.group_sums[m * groups + b * kBlock / group] += static_cast<float>(code_sum) * scale;
    }
  }
  return a;
}

// 8 fp32 partial sums of u[i] * xq[i] over the 32 columns of one block.
inline __m256 block_dot(__m256i u, __m256i xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // VNNI (Zen 4, Ice Lake and later): one instruction multiplies the 32 byte pairs and adds each 4 into an int32,
  // where AVX2 needs two (below); the same integer sums, so the same output bit for bit.
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xq));
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, xq);                       // 16 x int16, |.| <= 2 * 15 * 127
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));  // 8 x int32 -> fp32
#endif
}

template <bool HIGH>
inline __m256i nibbles(const uint8_t* p) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  return HIGH ? _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask) : _mm256_and_si256(bytes, mask);
}

struct Int4Q8Weights {
  const uint8_t* codes;       // [tiles, K / 64, 4, 32]
  const float* scale_offset;  // [N_padded, groups, 2]
  int64_t K, group, groups;
};

// Add block b (32 columns) of the 4 rows of tile t times the activation row to acc (fp32, before the group scale).
template <bool HIGH>
inline void add_block(const Int4Q8Weights& w, int64_t t, int64_t b, const int8_t* xq, const float* xs, __m256 acc[4]) {
  const uint8_t* chunk = w.codes + (t * (w.K / kChunkCols) + b / 2) * kRowsPerTile * kChunkBytes;
  const __m256i xq_block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
  const __m256 x_scale = _mm256_set1_ps(xs[b]);
  if (!(b & 1)) {  // a new chunk: 4 rows x 32 bytes = 2 cache lines (+15-20 % from DRAM, measured)
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes + 64), _MM_HINT_T0);
  }
  for (int r = 0; r < kRowsPerTile; ++r)
    acc[r] = _mm256_fmadd_ps(block_dot(nibbles<HIGH>(chunk + r * kChunkBytes), xq_block), x_scale, acc[r]);
}

// Dot products of the 4 rows of tile t with activation row m, offsets included.
inline void dot_tile(const Int4Q8Weights& w, int64_t t, const QuantizedActivations& a, int64_t m, float dots[4]) {
  const int8_t* xq = a.q.data() + m * w.K;
  const float* xs = a.scale.data() + m * (w.K / kBlock);
  const float* x_group_sums = a.group_sums.data() + m * w.groups;
  __m256 total[kRowsPerTile];
  for (int r = 0; r < kRowsPerTile; ++r) total[r] = _mm256_setzero_ps();
  const int64_t blocks_per_group = w.group / kBlock;
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 acc[kRowsPerTile];
    for (int r = 0; r < kRowsPerTile; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      if (b & 1) add_block<true>(w, t, b, xq, xs, acc);  // odd blocks are the high nibbles of chunk b / 2
      else add_block<false>(w, t, b, xq, xs, acc);
    }
    for (int r = 0; r < kRowsPerTile; ++r) {
      const float scale = w.scale_offset[((t * kRowsPerTile + r) * w.groups + g) * 2];
      total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(scale), total[r]);
    }
  }
  for (int r = 0; r < kRowsPerTile; ++r) {
    const float* so = w.scale_offset + (t * kRowsPerTile + r) * w.groups * 2;
    float offset = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) offset += so[g * 2 + 1] * x_group_sums[g];
    dots[r] = horizontal_sum(total[r]) + offset;
  }
}

at::Tensor gemv_int4_q8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale_offset,
                        int64_t group_size, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  const int64_t K = check_codes(codes, at::kByte, kChunkCols, kChunkBytes, out_features);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "group_size must be a multiple of ", kBlock, " dividing K = ", K, ", got ", group_size);
  const int64_t groups = K / group_size, tiles = codes.size(0), N = out_features;
  check_fp32(scale_offset, "scale_offset [N_padded, groups, 2]", tiles * kRowsPerTile * groups * 2);
  check_bias(bias, N);
  const at::Tensor x = as_rows(x_in, K);
  const int64_t M = x.size(0);
  std::vector<float> x_storage;
  const QuantizedActivations a = quantize_activations(activations_as_fp32(x, x_storage), M, K, group_size);
  const Int4Q8Weights w{codes.data_ptr<uint8_t>(), scale_offset.data_ptr<float>(), K, group_size, groups};
  const float* bias_ptr = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::Tensor y = empty_output(x_in, N);
  with_output_pointer(y, [&](auto* out) {
    using OutT = std::remove_pointer_t<decltype(out)>;
    // Each thread walks its tiles in memory order; all activation rows go past a tile while it sits in L1.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (K * kRowsPerTile));
    at::parallel_for(0, tiles, grain, [&](int64_t tile_begin, int64_t tile_end) {
      for (int64_t t = tile_begin; t < tile_end; ++t) {
        for (int64_t m = 0; m < M; ++m) {
          float dots[kRowsPerTile];
          dot_tile(w, t, a, m, dots);
          for (int r = 0; r < kRowsPerTile && t * kRowsPerTile + r < N; ++r) {
            const int64_t n = t * kRowsPerTile + r;
            out[m * N + n] = static_cast<OutT>(dots[r] + (bias_ptr ? bias_ptr[n] : 0.0f));
          }
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posttrain_quant, m) {
  m.def("gemv_int4_q8(Tensor x, Tensor codes, Tensor scale_offset, int group_size, int out_features, Tensor? bias)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(posttrain_quant, CPU, m) { m.impl("gemv_int4_q8", &gemv_int4_q8); }
