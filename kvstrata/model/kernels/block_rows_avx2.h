// The product loop of block_dot.cpp with AVX2 (included in namespace `avx2`): one block of 32 columns per step.
//
// y[r, n] for R rows of activations and T consecutive output rows from n: R x T independent accumulators, so
// the multiply-adds of successive blocks do not wait on each other, and each block of activations is read once
// per T output rows.
// Output rows per tile (T), whatever the bits and the rows of activations.
constexpr int tile_outputs(int, int) { return 4; }

// eight int32 partial sums of unsigned bytes u times signed bytes s; each pair's sum must stay within int16
// (maddubs saturates), which 4-bit codes, and 8-bit magnitudes against signs moved onto the activations, do
inline __m256i dot(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

template <int Bits, int R, int T, typename S>
inline void block_tile(const Activations a, const uint8_t* codes, const S* scales, const S* mins, int64_t k,
                       int64_t n, int64_t n_total, float* y) {
  const int64_t blocks = k / 32, row_bytes = k * Bits / 8;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i x[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (Bits == 4) {  // block b's low columns and high columns in its group of four (quantize_rows)
        x[r] = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.at(r, 4, b, 16))),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.at(r, 4, b, 0))));
      } else {
        x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.at(r, 8, b, 0)));
      }
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* block = codes + (n + t) * row_bytes + b * 32 * Bits / 8;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchRows * row_bytes), _MM_HINT_T0);
      __m256i w;
      if constexpr (Bits == 4) {  // low nibbles are columns 0-15, high ones 16-31
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low_mask), _mm_and_si128(packed, low_mask));
      } else {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
      }
      const float scale = to_float(scales[(n + t) * blocks + b]);
      for (int r = 0; r < R; ++r) {
        // signed 8-bit codes: |w| times x with w's sign, as dot wants unsigned bytes first
        const __m256i products = Bits == 4 ? dot(w, x[r]) : dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x[r], w));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(scale * a.scales[r * blocks + b]),
                                    acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float offset = 0.0f;  // 4-bit: sum over blocks of min * dx * (sum of x's codes)
      if constexpr (Bits == 4)
        for (int64_t b = 0; b < blocks; ++b) offset += to_float(mins[(n + t) * blocks + b]) * a.sums[r * blocks + b];
      y[r * n_total + n + t] = lane_sum(acc[r][t]) + offset;
    }
  }
}
