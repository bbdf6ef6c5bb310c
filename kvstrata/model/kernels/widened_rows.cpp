// Products of a handful of rows (decode steps of 4 to 127 sequences) over GGUF-style blocks, in float32: each
// weight row is widened once into a small buffer (widen_blocks.h) and multiplied there by every row of
// the activations with fused multiply-adds.
//
// Why, beside the integer dot products (block_dot.cpp): without VNNI, a 32-column block costs those two integer
// multiplies per activation row (maddubs, madd) plus a float scale, and they stay at 42-48 GFLOP/s from 4 rows up
// on a 2-core AMD EPYC (AVX2); widening is paid once per weight row whatever the number of activation rows, and
// with the float multiply-adds that follow, the products run at 49-118 GFLOP/s from 4 to 128 rows there
// (docs/BENCHMARKS.md). The activations are not rounded to int8 either:
// these products are float32 products of the dequantized weights.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "block_product.h"
#include "widen_blocks.h"

namespace kvstrata {

namespace {

constexpr int64_t kRowsTogether = 4;  // activation rows that share one read of the widened weights
constexpr int64_t kWeightRows = 3;  // widened weight rows multiplied together: 4 x 3 sums and 3 weights in registers

// y[r, t] (row stride n) = x[r] . w[t] for R rows of x [R, k] and T widened rows w [T, k]
template <int R, int T>
inline void tile(const float* x, int64_t k, const float* w, float* y, int64_t n) {
  __m256 sums[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) sums[r][t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += 8) {
    __m256 weights[T];
    for (int t = 0; t < T; ++t) weights[t] = _mm256_loadu_ps(w + t * k + c);
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_loadu_ps(x + r * k + c);
      for (int t = 0; t < T; ++t) sums[r][t] = _mm256_fmadd_ps(xs, weights[t], sums[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[r * n + t] = lane_sum(sums[r][t]);
}

// Every row of x [m, k] against T widened rows: tiles of kRowsTogether rows, then the rest
template <int T>
void all_rows(const float* x, int64_t m, int64_t k, const float* w, float* y, int64_t n) {
  int64_t r = 0;
  for (; r + kRowsTogether <= m; r += kRowsTogether) tile<kRowsTogether, T>(x + r * k, k, w, y + r * n, n);
  switch (m - r) {
    case 1: tile<1, T>(x + r * k, k, w, y + r * n, n); break;
    case 2: tile<2, T>(x + r * k, k, w, y + r * n, n); break;
    case 3: tile<3, T>(x + r * k, k, w, y + r * n, n); break;
    default: break;
  }
}

template <int Bits, typename S>
void product(const float* x, int64_t m, int64_t k, const uint8_t* codes, const S* scales, const S* mins, int64_t n,
             float* y) {
  const int64_t blocks = k / 32, row_bytes = k * Bits / 8;
  const int64_t groups = (n + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> widened;  // kWeightRows x k: 18 KB at 1,536 columns, within L1 while used
    widened.resize(kWeightRows * k);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first = group * kWeightRows, count = std::min(kWeightRows, n - first);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t row = first + t;
        widen_row<Bits>(codes + row * row_bytes, scales + row * blocks, Bits == 4 ? mins + row * blocks : nullptr,
                        blocks, widened.data() + t * k);
      }
      if (count == kWeightRows) {
        all_rows<kWeightRows>(x, m, k, widened.data(), y + first, n);
      } else {
        for (int64_t t = 0; t < count; ++t) all_rows<1>(x, m, k, widened.data() + t * k, y + first + t, n);
      }
    }
  });
}

}  // namespace

template <typename S>
void widened_rows_product(const float* x, int64_t m, int64_t k, const uint8_t* codes, const S* scales, const S* mins,
                          int bits, int64_t n, float* y) {
  if (bits == 4) {
    product<4>(x, m, k, codes, scales, mins, n, y);
  } else {
    product<8>(x, m, k, codes, scales, mins, n, y);
  }
}

template void widened_rows_product<float>(const float*, int64_t, int64_t, const uint8_t*, const float*,
                                          const float*, int, int64_t, float*);
template void widened_rows_product<uint16_t>(const float*, int64_t, int64_t, const uint8_t*, const uint16_t*,
                                             const uint16_t*, int, int64_t, float*);

}  // namespace kvstrata
