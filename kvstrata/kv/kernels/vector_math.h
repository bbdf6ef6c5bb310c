// The vector arithmetic the KV readers spend their time in, with F16C and AVX2 (built with -mf16c -mavx2): float16
// and 4-bit and 2-bit codes widened to float32, e^x of eight floats, and dot products.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvstrata {

// A float16 stored at any byte address (records pack them at odd offsets).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

// n float16 values (at any address) widened into out.
inline void widen_halves(const void* halves, int64_t n, float* out) {
  const uint8_t* p = static_cast<const uint8_t*>(halves);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
  }
  for (; i < n; ++i) out[i] = half_at(p + 2 * i);
}

// The 16 4-bit codes of 8 bytes (value 2j in the low nibble of byte j, 2j + 1 in the high one) as floats, in order:
// codes 0-7 in first, 8-15 in second.
inline void nibble_codes(const uint8_t* bytes, __m256& first, __m256& second) {
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  first = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  second = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
}

inline float nibble_at(const uint8_t* bytes, int64_t i) { return static_cast<float>((bytes[i / 2] >> (4 * (i % 2))) & 15); }

// A minimum or step for 8 values from value i, and for value i alone: one for all (a float), or one per value (an
// array).
inline __m256 eight_from(float p, int64_t) { return _mm256_set1_ps(p); }
inline __m256 eight_from(const float* p, int64_t i) { return _mm256_loadu_ps(p + i); }
inline float one_at(float p, int64_t) { return p; }
inline float one_at(const float* p, int64_t i) { return p[i]; }

// n codes as finish(low + code * step), low and step one for all or one per value (eight_from): 16 a vector, which
// `codes16(bytes, first, second)` reads from BytesPer16 bytes, and the tail one by one, `code_at(bytes, i)`, through
// lane 0 of finish (which takes and gives 8 floats).
template <int BytesPer16, typename Param, typename Codes16, typename CodeAt, typename Finish>
inline void widen_codes(const uint8_t* bytes, int64_t n, Param low, Param step, float* out, Codes16 codes16,
                        CodeAt code_at, Finish finish) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 first, second;
    codes16(bytes + i / 16 * BytesPer16, first, second);
    _mm256_storeu_ps(out + i, finish(_mm256_fmadd_ps(first, eight_from(step, i), eight_from(low, i))));
    _mm256_storeu_ps(out + i + 8, finish(_mm256_fmadd_ps(second, eight_from(step, i + 8), eight_from(low, i + 8))));
  }
  for (; i < n; ++i) {
    out[i] = _mm256_cvtss_f32(finish(_mm256_set1_ps(one_at(low, i) + code_at(bytes, i) * one_at(step, i))));
  }
}

inline __m256 as_is(__m256 x) { return x; }

// 2 * n_bytes 4-bit codes (laid out as nibble_codes reads them) as finish(low + code * step).
template <typename Finish>
inline void widen_nibbles(const uint8_t* bytes, int64_t n_bytes, float low, float step, float* out, Finish finish) {
  widen_codes<8>(bytes, 2 * n_bytes, low, step, out, nibble_codes, nibble_at, finish);
}

// 2 * n_bytes 4-bit codes as low + code * step (low and step: one for all, or one per value).
template <typename Param>
inline void widen_nibbles(const uint8_t* bytes, int64_t n_bytes, Param low, Param step, float* out) {
  widen_codes<8>(bytes, 2 * n_bytes, low, step, out, nibble_codes, nibble_at, as_is);
}

// The 16 2-bit codes of 4 bytes (value 4j + i at bits 2i of byte j: code c at bit 2c of the little-endian word) as
// floats, in order: codes 0-7 in first, 8-15 in second.
inline void crumb_codes(const uint8_t* bytes, __m256& first, __m256& second) {
  uint32_t word;
  std::memcpy(&word, bytes, sizeof(word));
  const __m256i all = _mm256_set1_epi32(static_cast<int>(word)), mask = _mm256_set1_epi32(3);
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  first = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(all, shifts), mask));
  second = _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srlv_epi32(all, _mm256_add_epi32(shifts, _mm256_set1_epi32(16))), mask));
}

inline float crumb_at(const uint8_t* bytes, int64_t i) { return static_cast<float>((bytes[i / 4] >> (2 * (i % 4))) & 3); }

// 4 * n_bytes 2-bit codes as low + code * step (low and step: one for all, or one per value).
template <typename Param>
inline void widen_crumbs(const uint8_t* bytes, int64_t n_bytes, Param low, Param step, float* out) {
  widen_codes<4>(bytes, 4 * n_bytes, low, step, out, crumb_codes, crumb_at, as_is);
}

// n (minimum, step) pairs of float16 (at any address) widened into two arrays.
inline void widen_pairs(const void* pairs, int64_t n, float* minimum, float* step) {
  const uint8_t* p = static_cast<const uint8_t*>(pairs);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // pairs 0-3 in a, 4-7 in b
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * i)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * i + 16)));
    // in-lane shuffles give each 128-bit lane two pairs' worth of a and of b: [0 1 4 5 | 2 3 6 7], put in order
    const auto ordered = [](__m256 x) {
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
    };
    _mm256_storeu_ps(minimum + i, ordered(_mm256_shuffle_ps(a, b, 0x88)));
    _mm256_storeu_ps(step + i, ordered(_mm256_shuffle_ps(a, b, 0xDD)));
  }
  for (; i < n; ++i) {
    minimum[i] = half_at(p + 4 * i);
    step[i] = half_at(p + 4 * i + 2);
  }
}

// e^x of 8 floats: 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two parts, so that r keeps its
// digits), e^r by its Taylor polynomial of degree 6 (|r| <= ln 2 / 2: relative error below 2e-7). x is clamped
// below at -87, where e^x nears float32's smallest normal (softmax weights that small vanish beside the peak's 1);
// a NaN stays NaN.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // this operand order returns x where x is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// row[t] = e^(row[t] - peak) for t < len; returns their sum.
inline float exp_minus_peak(float* row, int64_t len, float peak) {
  const __m256 peaks = _mm256_set1_ps(peak);
  __m256 sums = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), peaks));
    _mm256_storeu_ps(row + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sums);
  float total = 0.0f;
  for (const float lane : lanes) total += lane;
  for (; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));
  return total;
}

// The dot product of two float vectors of n values: two chains of 8 lanes, summed across lanes at the end (a
// compiler's reduction stores the lanes and adds them one after another, on the critical path of every score).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), odd);
  }
  const __m256 both = _mm256_add_ps(even, odd);
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  float total = _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

}  // namespace kvstrata
