// Shared pieces of the weight-streaming kernels (gemv_avx2.cpp, gemv_int4_q8.cpp): argument checks, activation
// widening, output dtype dispatch. Weights are stored in tiles of kRowsPerTile output rows (see gemv_avx2.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace posttrain_gemv {

constexpr int64_t kRowsPerTile = 4;       // output rows decoded together (4+ independent FMA chains)
constexpr int64_t kPrefetchBytes = 4096;  // software prefetch distance in a thread's weight stream

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of n floats, n a multiple of 8: eight running sums instead of one serial chain of adds.
inline float sum_floats(const float* p, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i));
  return horizontal_sum(acc);
}

// x [M, K] of any float dtype -> fp32 [M, K] (a copy only when x is not already contiguous fp32).
inline const float* activations_as_fp32(const at::Tensor& x, std::vector<float>& storage) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  storage.resize(xc.numel());
  if (xc.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* p = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < xc.numel(); ++i) storage[i] = static_cast<float>(p[i]);
  } else if (xc.scalar_type() == at::kHalf) {
    const c10::Half* p = xc.data_ptr<c10::Half>();
    for (int64_t i = 0; i < xc.numel(); ++i) storage[i] = static_cast<float>(p[i]);
  } else {
    const at::Tensor xf = xc.to(at::kFloat);
    std::copy(xf.data_ptr<float>(), xf.data_ptr<float>() + xf.numel(), storage.data());
  }
  return storage.data();
}

// x [..., K] -> [M, K] (a view when possible). Leading dimensions are handled here, not in Python, because every
// extra op in the module's forward costs about a microsecond per call, hundreds of times per decoded token.
inline at::Tensor as_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x has shape ", x.sizes(), ", expected [..., K = ", K, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be fp32, bf16 or fp16, got ", x.scalar_type());
  return x.dim() == 2 ? x : x.reshape({-1, K});
}

// codes [tiles, K / chunk_cols, 4, chunk_elems] of dtype `dtype`; returns K.
inline int64_t check_codes(const at::Tensor& codes, at::ScalarType dtype, int64_t chunk_cols, int64_t chunk_elems,
                           int64_t out_features) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == dtype && codes.is_contiguous() &&
                  codes.size(2) == kRowsPerTile && codes.size(3) == chunk_elems,
              "codes must be contiguous ", dtype, " [tiles, K / ", chunk_cols, ", ", kRowsPerTile, ", ", chunk_elems,
              "], got ", codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(out_features > (codes.size(0) - 1) * kRowsPerTile && out_features <= codes.size(0) * kRowsPerTile,
              "out_features ", out_features, " does not fit ", codes.size(0), " tiles of ", kRowsPerTile, " rows");
  return codes.size(1) * chunk_cols;
}

inline void check_fp32(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel, name,
              " must be contiguous fp32 with ", numel, " elements, got ", t.scalar_type(), " ", t.sizes());
}

inline void check_bias(const c10::optional<at::Tensor>& bias, int64_t out_features) {
  if (bias.has_value()) check_fp32(*bias, "bias [out_features]", out_features);
}

// y = empty [..., N] shaped like x_in [..., K], with x_in's dtype.
inline at::Tensor empty_output(const at::Tensor& x_in, int64_t N) {
  std::vector<int64_t> sizes(x_in.sizes().begin(), x_in.sizes().end());
  sizes.back() = N;
  return at::empty(sizes, x_in.options());
}

// Calls f(typed pointer to y's data) for y of dtype fp32, bf16 or fp16.
template <typename F>
inline void with_output_pointer(const at::Tensor& y, F&& f) {
  switch (y.scalar_type()) {
    case at::kFloat: f(y.data_ptr<float>()); break;
    case at::kBFloat16: f(y.data_ptr<c10::BFloat16>()); break;
    default: f(y.data_ptr<c10::Half>()); break;
  }
}

}  // namespace posttrain_gemv
