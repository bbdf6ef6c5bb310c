// The product loop of block_dot.cpp on CPUs with AVX-512 VNNI (included under a target pragma in namespace
// `avx512`).
//
// 4-bit: four blocks per step. 64 bytes of codes are four blocks' bytes; their low nibbles are columns 0-15 of
// each block and their high nibbles columns 16-31, which is the order the activations were laid out in
// (quantize_rows), so two dot products, one per nibble, leave each block's sum in four int32 lanes with no
// shuffling of the weights. A last group of fewer than four blocks is read under a mask.
// 8-bit: two blocks per step; codes c, signed, enter the unsigned side of the dot product as c + 128, and
// 128 * scale * (sum of x's codes) is taken off afterwards. K / 32 must be even.
//
// y[r, n] for R rows of activations and T consecutive output rows from n: R x T accumulators, so successive
// steps do not wait on each other, and each step's activations are read once per T output rows.

// Output rows per tile (T) for R rows of activations: the R x T accumulators and the R rows' codes and scales
// must stay in the 32 vector registers. 4-bit codes take two vectors a row: 4 x 4 sent the accumulators to the
// stack, and tiles of 3 (with the offsets added per 16 blocks below) ran the default model's products of 4-64
// rows 1.14-1.37x faster on an AMD Zen 5 (docs/BENCHMARKS.md, "The weight products' tiles on AVX-512").
constexpr int tile_outputs(int bits, int rows) { return bits == 4 && rows > 2 ? 3 : 4; }

// the first `count` (at most 4) of four scales, float32 or float16 bits (block_dot.cpp's to_float)
inline __m128 load_four(const float* first, int count) {
  return _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << count) - 1), first);
}
inline __m128 load_four(const uint16_t* first, int count) {
  return _mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << count) - 1), first));
}

// the values of sixteen scales or mins where `valid`
inline __m512 load_sixteen(const float* first, __mmask16 valid) { return _mm512_maskz_loadu_ps(valid, first); }
inline __m512 load_sixteen(const uint16_t* first, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, first));
}

// lanes 4i..4i+3 <- scale i: a group's four block scales spread over the lanes of their blocks' sums
template <typename S>
inline __m512 spread_over_blocks(const S* first, int count) {
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(load_four(first, count)));
}

// lanes 0-7 <- first[0], lanes 8-15 <- first[1]: a pair's block scales spread over their blocks' sums
template <typename S>
inline __m512 spread_over_pair(const S* first) {
  return _mm512_insertf32x8(_mm512_set1_ps(to_float(first[0])), _mm256_set1_ps(to_float(first[1])), 1);
}

template <int R, int T, typename S>
inline void nibble_tile(const Activations a, const uint8_t* codes, const S* scales, int64_t k, int64_t n,
                        __m512 (&acc)[R][T]) {
  const int64_t blocks = k / 32, row_bytes = k / 2;
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  for (int64_t first = 0; first < blocks; first += 4) {
    const int count = static_cast<int>(std::min<int64_t>(4, blocks - first));
    const __mmask64 bytes = count == 4 ? ~0ULL : (1ULL << (16 * count)) - 1;
    __m512 x_scale[R];
    for (int r = 0; r < R; ++r) x_scale[r] = spread_over_blocks(a.scales + r * blocks + first, count);
    for (int t = 0; t < T; ++t) {
      const uint8_t* group = codes + (n + t) * row_bytes + first * 16;
      _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetchRows * row_bytes), _MM_HINT_T0);
      const __m512i packed = _mm512_maskz_loadu_epi8(bytes, group);
      const __m512i low = _mm512_and_si512(packed, low_mask), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
      const __m512 w_scale = spread_over_blocks(scales + (n + t) * blocks + first, count);
      for (int r = 0; r < R; ++r) {
        const __m512i low_x = _mm512_loadu_si512(a.at(r, 4, first, 0));  // the four blocks' columns 0-15
        const __m512i high_x = _mm512_loadu_si512(a.at(r, 4, first, 16));  // and 16-31
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, low_x), high, high_x);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(w_scale, x_scale[r]), acc[r][t]);
      }
    }
  }
}

template <int R, int T, typename S>
inline void byte_tile(const Activations a, const uint8_t* codes, const S* scales, int64_t k, int64_t n,
                      __m512 (&acc)[R][T]) {
  const int64_t blocks = k / 32;
  const __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; b += 2) {
    __m512 x_scale[R];
    for (int r = 0; r < R; ++r) x_scale[r] = spread_over_pair(a.scales + r * blocks + b);
    for (int t = 0; t < T; ++t) {
      const uint8_t* pair = codes + (n + t) * k + b * 32;
      _mm_prefetch(reinterpret_cast<const char*>(pair + kPrefetchRows * k), _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(pair), sign_bit);
      const __m512 w_scale = spread_over_pair(scales + (n + t) * blocks + b);
      for (int r = 0; r < R; ++r) {
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(a.at(r, 8, b, 0)));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(w_scale, x_scale[r]), acc[r][t]);
      }
    }
  }
}

// The sums of the lanes of four vectors, as the four lanes of one: pairs of vectors interleaved and added, then
// the four 128-bit quarters added, so that four outputs take a few shuffles instead of four whole reductions.
inline __m128 sum_lanes_of_4(const __m512 (&v)[4]) {
  // in each quarter: [v0 lanes 0+2, v1 lanes 0+2, v0 lanes 1+3, v1 lanes 1+3], the same of v2 and v3
  const __m512 pair01 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 pair23 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  // in each quarter: the quarter's sum of v0, v1, v2, v3
  const __m512 quarters = _mm512_add_ps(_mm512_shuffle_ps(pair01, pair23, _MM_SHUFFLE(1, 0, 1, 0)),
                                        _mm512_shuffle_ps(pair01, pair23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(quarters), _mm512_extractf32x8_ps(quarters, 1));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

template <int Bits, int R, int T, typename S>
inline void block_tile(const Activations a, const uint8_t* codes, const S* scales, const S* mins, int64_t k,
                       int64_t n, int64_t n_total, float* y) {
  const int64_t blocks = k / 32;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  if constexpr (Bits == 4) {
    nibble_tile<R, T>(a, codes, scales, k, n, acc);
  } else {
    byte_tile<R, T>(a, codes, scales, k, n, acc);
  }
  // what each block's offset adds, min * dx * (sum of x's codes) (8-bit: min = -128 * scale), into its lanes:
  // sixteen blocks at a time, their sums of x read once for the T output rows
  for (int64_t b = 0; b < blocks; b += 16) {
    const __mmask16 valid = static_cast<__mmask16>(blocks - b >= 16 ? 0xFFFF : (1u << (blocks - b)) - 1);
    __m512 x_sums[R];
    for (int r = 0; r < R; ++r) x_sums[r] = _mm512_maskz_loadu_ps(valid, a.sums + r * blocks + b);
    for (int t = 0; t < T; ++t) {
      const __m512 block_mins = Bits == 4 ? load_sixteen(mins + (n + t) * blocks + b, valid)
                                          : _mm512_mul_ps(load_sixteen(scales + (n + t) * blocks + b, valid),
                                                          _mm512_set1_ps(-128.0f));
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(block_mins, x_sums[r], acc[r][t]);
    }
  }
  // every output's lanes summed in the same order, whatever T: a row's outputs do not depend on the rows beside it
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; t += 4) {
      const int count = T - t < 4 ? T - t : 4;
      __m512 four[4];
      for (int i = 0; i < 4; ++i) four[i] = i < count ? acc[r][t + i] : _mm512_setzero_ps();
      _mm_mask_storeu_ps(y + r * n_total + n + t, static_cast<__mmask8>((1u << count) - 1), sum_lanes_of_4(four));
    }
  }
}

// A block of 32 activations v as int8 codes: columns 0-15 at `low`, 16-31 at `high`, with its scale (max |v| / 127)
// and the scale times the codes' sum; false, with nothing written, where a value is not finite (the caller's scalar
// loop then makes the row NaN). Rounds v * (127 / max |v|) to nearest, ties to even, as the scalar loop does.
inline bool quantize_block(const float* v, int8_t* low, int8_t* high, float& scale, float& scaled_sum) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16), zero = _mm512_setzero_ps();
  // x - x is 0 for a finite x and NaN for an infinite or NaN one
  if (_mm512_cmp_ps_mask(_mm512_sub_ps(a, a), zero, _CMP_NEQ_UQ) | _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), zero, _CMP_NEQ_UQ)) {
    return false;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i codes_a = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)), codes_b = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low), _mm512_cvtepi32_epi8(codes_a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(high), _mm512_cvtepi32_epi8(codes_b));
  scale = amax / 127.0f;
  scaled_sum = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(codes_a, codes_b)));
  return true;
}
