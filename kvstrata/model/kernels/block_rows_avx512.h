// The product loop of block_dot.cpp on CPUs with AVX-512 VNNI (included under a target pragma in namespace
// `avx512`): two blocks of 32 columns per 512-bit dot product. K / 32 must be even.
//
// Per pair of blocks (b, b + 1) the activations are the 64 bytes [x_b, x_b+1]. 4-bit weights are unpacked into
// the same order (16 low nibbles of block b, its 16 high ones, then block b + 1's); 8-bit codes c, signed, enter
// the unsigned side of the dot product as c + 128, and 128 * scale * (sum of x's codes) is taken off afterwards.
template <int Bits, int R, int T>
inline void block_tile(const Activations a, const uint8_t* codes, const float* scales, const float* mins, int64_t k,
                       int64_t n, int64_t n_total, float* y) {
  const int64_t blocks = k / 32, row_bytes = k * Bits / 8;
  const __m512i low_mask = _mm512_set1_epi8(0x0F), sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 2) {
    __m512i x[R];
    __m512 x_scale[R];  // lanes of block b, then of block b + 1
    for (int r = 0; r < R; ++r) {
      x[r] = _mm512_loadu_si512(a.codes + (r * blocks + b) * 32);
      x_scale[r] = _mm512_insertf32x8(_mm512_set1_ps(a.scales[r * blocks + b]), _mm256_set1_ps(a.scales[r * blocks + b + 1]), 1);
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* pair = codes + (n + t) * row_bytes + b * 32 * Bits / 8;
      _mm_prefetch(reinterpret_cast<const char*>(pair + kPrefetchRows * row_bytes), _MM_HINT_T0);
      __m512i w;
      if constexpr (Bits == 4) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
        // 128-bit chunks [low b, low b+1, high b, high b+1] -> [low b, high b, low b+1, high b+1]
        const __m512i nibbles = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1), low_mask);
        w = _mm512_shuffle_i64x2(nibbles, nibbles, _MM_SHUFFLE(3, 1, 2, 0));
      } else {
        w = _mm512_xor_si512(_mm512_loadu_si512(pair), sign_bit);
      }
      const float* w_scales = scales + (n + t) * blocks + b;
      const __m512 w_scale = _mm512_insertf32x8(_mm512_set1_ps(w_scales[0]), _mm256_set1_ps(w_scales[1]), 1);
      for (int r = 0; r < R; ++r) {
        const __m512 products = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x[r]));
        acc[r][t] = _mm512_fmadd_ps(products, _mm512_mul_ps(w_scale, x_scale[r]), acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const float* row_scales = scales + (n + t) * blocks;
    const float* row_mins = Bits == 4 ? mins + (n + t) * blocks : nullptr;
    for (int r = 0; r < R; ++r) {
      // sum over blocks of min * dx * (sum of x's codes); 8-bit: min = -128 * scale
      __m512 offset = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 valid = static_cast<__mmask16>(blocks - b >= 16 ? 0xFFFF : (1u << (blocks - b)) - 1);
        const __m512 sums = _mm512_maskz_loadu_ps(valid, a.sums + r * blocks + b);
        const __m512 block_mins = Bits == 4 ? _mm512_maskz_loadu_ps(valid, row_mins + b)
                                            : _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, row_scales + b), _mm512_set1_ps(-128.0f));
        offset = _mm512_fmadd_ps(block_mins, sums, offset);
      }
      y[r * n_total + n + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t], offset));
    }
  }
}
