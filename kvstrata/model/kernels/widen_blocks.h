// One weight row of GGUF-style blocks (block_dot.cpp's layout) widened to float32, eight columns to a vector: shared
// by the widened-rows product (widened_rows.cpp) and the dense weights for prefill (block_to_dense); and the lane sum
// that ends the AVX2 products of both files.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvstrata {

// Scales and mins as float32, or float16 given as their bits
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return _cvtsh_ss(v); }

// The sum of a vector's eight lanes (a dot product's partial sums)
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Row `row` (K * Bits / 8 bytes) into w [K]: code * scale + min (one fused multiply-add) for 4 bits, code * scale for
// 8 (`min` unused).
template <int Bits, typename S>
inline void widen_row(const uint8_t* row, const S* scale, const S* min, int64_t blocks, float* w) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256 s = _mm256_set1_ps(to_float(scale[b]));
    float* columns = w + b * 32;
    if constexpr (Bits == 4) {  // byte j: column j in its low nibble, column 16 + j in its high one
      const __m256 z = _mm256_set1_ps(to_float(min[b]));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
      const __m128i eights[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
      for (int i = 0; i < 4; ++i) {
        const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[i]));
        _mm256_storeu_ps(columns + 8 * i, _mm256_fmadd_ps(codes, s, z));
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * 32 + 8 * i));
        _mm256_storeu_ps(columns + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), s));
      }
    }
  }
}

}  // namespace kvstrata
