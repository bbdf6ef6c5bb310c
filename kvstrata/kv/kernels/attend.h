// Decode attention read in place from the paged KV cache, shared by every storage's reader: one query token per
// sequence attends over the first context_lens[s] tokens of sequence s (token t at position t), found block by
// block through its block table. Each storage supplies a `Rows` reader that hands back a token's K or V row of one
// KV head (or, for whole-token records, of several side by side) as float32, decoding it into a tile of a few
// tokens' rows where the storage keeps another form; nothing else is copied (the torch path gathers, and for
// quantized storage decodes, every block first).
//
// q [n, heads, dim] float32; block_tables [n, width] int64; context_lens [n] int64. Query head h reads KV head
// h / (heads / kv_heads).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvstrata {

// Conversions the readers spend their time in, with F16C and AVX2 (built with -mf16c -mavx2).

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

// 2 * n_bytes 4-bit codes (laid out as nibble_codes reads them) as finish(low + code * step), finish taking and
// giving 8 floats (a scalar tail goes through lane 0).
template <typename Finish>
inline void widen_nibbles(const uint8_t* bytes, int64_t n_bytes, float low, float step, float* out, Finish finish) {
  const __m256 lows = _mm256_set1_ps(low), steps = _mm256_set1_ps(step);
  int64_t j = 0;
  for (; j + 8 <= n_bytes; j += 8) {  // 8 bytes: 16 codes in order
    __m256 first, second;
    nibble_codes(bytes + j, first, second);
    _mm256_storeu_ps(out + 2 * j, finish(_mm256_fmadd_ps(first, steps, lows)));
    _mm256_storeu_ps(out + 2 * j + 8, finish(_mm256_fmadd_ps(second, steps, lows)));
  }
  for (int64_t i = 2 * j; i < 2 * n_bytes; ++i) {
    out[i] = _mm256_cvtss_f32(finish(_mm256_set1_ps(low + nibble_at(bytes, i) * step)));
  }
}

inline void widen_nibbles(const uint8_t* bytes, int64_t n_bytes, float low, float step, float* out) {
  widen_nibbles(bytes, n_bytes, low, step, out, [](__m256 x) { return x; });
}

// 2 * n_bytes 4-bit codes as low[i] + code * step[i]: every value with a minimum and a step of its own.
inline void widen_nibbles(const uint8_t* bytes, int64_t n_bytes, const float* low, const float* step, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n_bytes; j += 8) {
    __m256 first, second;
    nibble_codes(bytes + j, first, second);
    const int64_t i = 2 * j;
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(first, _mm256_loadu_ps(step + i), _mm256_loadu_ps(low + i)));
    _mm256_storeu_ps(out + i + 8, _mm256_fmadd_ps(second, _mm256_loadu_ps(step + i + 8), _mm256_loadu_ps(low + i + 8)));
  }
  for (int64_t i = 2 * j; i < 2 * n_bytes; ++i) out[i] = low[i] + nibble_at(bytes, i) * step[i];
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

// The slot of a sequence's token t (block table entry t / block, offset t % block) for many tokens of one block size
// (>= 1): a shift and a mask where it is a power of two (it is by default), since a division per row read is a
// visible share of a loop that reads rows one by one.
struct BlockSlots {
  const int64_t block;
  const int shift = (block & (block - 1)) == 0 ? __builtin_ctzll(block) : -1;

  int64_t entry(int64_t t) const { return shift < 0 ? t / block : t >> shift; }  // token t's block table entry
  int64_t offset(int64_t t) const { return shift < 0 ? t % block : t & (block - 1); }  // and its place there
  int64_t of(const int64_t* table, int64_t t) const { return table[entry(t)] * block + offset(t); }
};

// Two kinds of reader. Stable rows (kStableRows true: a float32 pool read in place) hand back where a token's row
// lies, `key(t)` and `value(t)`, and it stays there until the reader is gone. Other readers decode a token's row
// into a place the caller gives, `key(t, out)` and `value(t, out)`, and may use out[row width], the float after
// it, as a scratch place; the loop below decodes kTileTokens of them at a time, in order, into a DecodedTile, which
// then reads as stable rows, so that both kinds share the arithmetic below.
template <typename Rows, typename = void>
struct stable_rows : std::false_type {};
template <typename Rows>
struct stable_rows<Rows, std::void_t<decltype(Rows::kStableRows)>> : std::bool_constant<Rows::kStableRows> {};

// Tokens decoded together: a block of the default size. Their K (or V) rows of 3 KV heads of 64 take 12 KiB, within
// the level-1 cache beside what the arithmetic reads.
constexpr int64_t kTileTokens = 16;

// Decoded rows of tokens [first, first + kTileTokens), `width` floats each, read as stable rows.
struct DecodedTile {
  static constexpr bool kStableRows = true;
  const float* rows;
  int64_t first, width;
  const float* key(int64_t t) const { return rows + (t - first) * width; }
  const float* value(int64_t t) const { return key(t); }
};

// The sums across lanes of eight vectors, as the lanes of one.
inline __m256 sum_lanes_of_8(const __m256* x) {
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
}

// Scores of one query head (query: dim values) against tokens [first, last) of stable rows, at `offset` in each key
// row: where dim is a multiple of 8, eight keys at a time, their dot products summed across lanes together.
template <typename Rows>
void score_stable_rows(const Rows& rows, const float* query, int64_t offset, int64_t first, int64_t last,
                       int64_t dim, float scale, float* scores) {
  int64_t t = first;
  for (; dim % 8 == 0 && t + 8 <= last; t += 8) {
    const float* keys[8];
    for (int i = 0; i < 8; ++i) keys[i] = rows.key(t + i) + offset;
    __m256 sums[8];
    for (auto& sum : sums) sum = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 q = _mm256_loadu_ps(query + d);
      for (int i = 0; i < 8; ++i) sums[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(keys[i] + d), sums[i]);
    }
    _mm256_storeu_ps(scores + t - first, _mm256_mul_ps(sum_lanes_of_8(sums), _mm256_set1_ps(scale)));
  }
  for (; t < last; ++t) scores[t - first] = dot(query, rows.key(t) + offset, dim) * scale;
}

// output[0 .. 8 * Lanes) += the sum over tokens [first, last) of weights[t - first] times the value row at `offset`,
// kept in registers over every token.
template <int Lanes, typename Rows>
void weigh_stable_rows(const Rows& rows, const float* weights, int64_t offset, int64_t first, int64_t last,
                       float* output) {
  __m256 sums[Lanes];
  for (int c = 0; c < Lanes; ++c) sums[c] = _mm256_loadu_ps(output + 8 * c);
  for (int64_t t = first; t < last; ++t) {
    const float* value = rows.value(t) + offset;
    const __m256 weight = _mm256_set1_ps(weights[t - first]);
    for (int c = 0; c < Lanes; ++c) sums[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * c), sums[c]);
  }
  for (int c = 0; c < Lanes; ++c) _mm256_storeu_ps(output + 8 * c, sums[c]);
}

// weigh_stable_rows over a head's dim values: 64 at a time where dim is a multiple of 8, else value by value.
template <typename Rows>
void weigh_stable_rows(const Rows& rows, const float* weights, int64_t offset, int64_t first, int64_t last,
                       int64_t dim, float* output) {
  if (dim % 8 != 0) {
    for (int64_t t = first; t < last; ++t) {
      const float* __restrict value = rows.value(t) + offset;
      const float weight = weights[t - first];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) output[d] += weight * value[d];
    }
    return;
  }
  for (int64_t d = 0; d < dim; d += 64) {
    switch (std::min<int64_t>(dim - d, 64) / 8) {
      case 1: weigh_stable_rows<1>(rows, weights, offset + d, first, last, output + d); break;
      case 2: weigh_stable_rows<2>(rows, weights, offset + d, first, last, output + d); break;
      case 3: weigh_stable_rows<3>(rows, weights, offset + d, first, last, output + d); break;
      case 4: weigh_stable_rows<4>(rows, weights, offset + d, first, last, output + d); break;
      case 5: weigh_stable_rows<5>(rows, weights, offset + d, first, last, output + d); break;
      case 6: weigh_stable_rows<6>(rows, weights, offset + d, first, last, output + d); break;
      case 7: weigh_stable_rows<7>(rows, weights, offset + d, first, last, output + d); break;
      default: weigh_stable_rows<8>(rows, weights, offset + d, first, last, output + d); break;
    }
  }
}

// Whether a decoding reader can start fetching a token's K or V bytes into the cache, `prefetch(keys, t)`: the loop
// below asks it for the next tile's tokens before it decodes a tile, so that the records of a cache larger than the
// processor's caches arrive while it works (blocks lie anywhere in the pool, too far apart for the hardware to guess).
template <typename Rows, typename = void>
struct prefetches : std::false_type {};
template <typename Rows>
struct prefetches<Rows, std::void_t<decltype(std::declval<Rows&>().prefetch(true, int64_t{}))>> : std::true_type {};

// Every cache line of n bytes from p, asked for.
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* bytes = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(bytes + i, _MM_HINT_T0);
  _mm_prefetch(bytes + n - 1, _MM_HINT_T0);
}

// A worker's scratch: the scores of its item's heads and the decoded rows of a tile.
struct SpanScratch {
  std::vector<float> scores, tile;
};

// read(stable, a, b) over tokens [first, last): once over `rows` where they are stable, else tile by tile over the
// tile's K rows (keys) or V rows (values), decoded by `rows` into the scratch's tile.
template <typename Rows, typename Read>
void in_tiles(Rows& rows, bool keys, int64_t first, int64_t last, int64_t width, SpanScratch& scratch, Read read) {
  if constexpr (stable_rows<Rows>::value) {
    read(rows, first, last);
  } else {
    scratch.tile.resize(kTileTokens * width + 1);  // and the last row's scratch place
    for (int64_t a = first; a < last; a += kTileTokens) {
      const int64_t b = std::min(last, a + kTileTokens);
      if constexpr (prefetches<Rows>::value) {
        for (int64_t t = b; t < std::min(last, b + kTileTokens); ++t) rows.prefetch(keys, t);
      }
      for (int64_t t = a; t < b; ++t) {
        float* row = scratch.tile.data() + (t - a) * width;
        if (keys) {
          rows.key(t, row);
        } else {
          rows.value(t, row);
        }
      }
      read(DecodedTile{scratch.tile.data(), a, width}, a, b);
    }
  }
}

// Tokens [first, last) of one item of one sequence: `row_heads` KV heads, whose rows the reader hands back side by
// side, and their `group` query heads each (query head g reads KV head g / group of the row). Leaves per query head
// g its peak score peaks[g], the sum of its weights e^(score - peak) totals[g] and, in outputs, the weighted sum of
// the values, not yet divided by the total. Rows are read head by head, with a head's sums in registers.
template <typename Rows>
void attend_span(Rows& rows, const float* queries, float* outputs, int64_t first, int64_t last, int64_t group,
                 int64_t row_heads, int64_t dim, float scale, SpanScratch& scratch, float* peaks, float* totals) {
  const int64_t heads = group * row_heads, len = last - first, width = row_heads * dim;
  scratch.scores.resize(heads * len);
  float* scores = scratch.scores.data();
  in_tiles(rows, true, first, last, width, scratch, [&](const auto& readable, int64_t a, int64_t b) {
    for (int64_t g = 0; g < heads; ++g) {
      score_stable_rows(readable, queries + g * dim, g / group * dim, a, b, dim, scale, scores + g * len + a - first);
    }
  });
  for (int64_t g = 0; g < heads; ++g) {
    float* row = scores + g * len;
    peaks[g] = *std::max_element(row, row + len);
    totals[g] = exp_minus_peak(row, len, peaks[g]);
  }
  std::fill(outputs, outputs + heads * dim, 0.0f);
  in_tiles(rows, false, first, last, width, scratch, [&](const auto& readable, int64_t a, int64_t b) {
    for (int64_t g = 0; g < heads; ++g) {
      weigh_stable_rows(readable, scores + g * len + a - first, g / group * dim, a, b, dim, outputs + g * dim);
    }
  });
}

// The whole item: its first `len` tokens, outputs divided by their totals (peaks and totals: a place per head).
template <typename Rows>
void attend_head(Rows& rows, const float* queries, float* outputs, int64_t len, int64_t group, int64_t row_heads,
                 int64_t dim, float scale, SpanScratch& scratch, std::vector<float>& peaks,
                 std::vector<float>& totals) {
  attend_span(rows, queries, outputs, 0, len, group, row_heads, dim, scale, scratch, peaks.data(), totals.data());
  for (int64_t g = 0; g < group * row_heads; ++g) {
    const float inverse = 1.0f / totals[g];
    for (int64_t d = 0; d < dim; ++d) outputs[g * dim + d] *= inverse;
  }
}

// Checks shared by every storage; bad input must raise here, not inside the parallel region.
inline void check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block,
                         int64_t num_blocks) {
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && context_lens.size(0) == block_tables.size(0),
              "paged_decode_attention: one block table and one context length per sequence");
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < block_tables.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block, "paged_decode_attention: context length out of range");
    for (int64_t b = 0; b < (lens[s] + block - 1) / block; ++b) {
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks,
                  "paged_decode_attention: block id out of range");
    }
  }
}

inline void check_inputs(const at::Tensor& q, const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t kv_heads, int64_t block, int64_t num_blocks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "paged_decode_attention: q must be float32 [n, heads, dim]");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == q.size(0), "paged_decode_attention: one block table per query");
  check_tables(block_tables, context_lens, block, num_blocks);
}

// Where an item's tokens are split (below), its parts hold at least this many
constexpr int64_t kMinPartTokens = 64;

// The sequences of a step of decodes: runs of rows with the same block table are one sequence's (speculative
// decoding's rows for its last token and drafts), counted once, so that they are split as the sequence alone is.
inline int64_t count_sequences(const int64_t* tables, int64_t n, int64_t width) {
  int64_t sequences = n > 0;
  for (int64_t s = 1; s < n; ++s) {
    sequences += !std::equal(tables + s * width, tables + (s + 1) * width, tables + (s - 1) * width);
  }
  return sequences;
}

// Checks the inputs, then one work item per sequence and `row_heads` KV heads over torch's threads;
// make_rows(table, first KV head, row_heads) builds the reader of one item, whose rows hold its KV heads side by
// side. A reader of whole-token records (whole_tokens) gets all of a token's KV heads in one item where there are
// enough sequences to keep every thread busy: the heads then share the record's bookkeeping (its slot, scales,
// outlier entries), which otherwise each head pays again. Else, and for float pools, each KV head is an item.
// Where there are fewer than two items per thread (a decode of one sequence: one item per KV head, 3 for the default
// model on 2 threads), each item's tokens are split into parts attended apart and merged by their peaks and totals,
// so that every thread has work (the split-softmax of flash-decoding). How a row is split depends only on the
// number of sequences in the step and its own length: a sequence's rows for its drafts are attended as it is alone,
// in the same order of sums, so drafts do not change the numbers a decode gives.
template <typename MakeRows>
at::Tensor run(at::Tensor q, at::Tensor block_tables, at::Tensor context_lens, int64_t kv_heads, int64_t block,
               int64_t num_blocks, double scale, MakeRows make_rows, bool whole_tokens = false) {
  q = q.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  context_lens = context_lens.to(at::kLong).contiguous();
  check_inputs(q, block_tables, context_lens, kv_heads, block, num_blocks);
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), group = heads / kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t sequences = count_sequences(block_tables.data_ptr<int64_t>(), n, block_tables.size(1));
  const int64_t row_heads = whole_tokens && sequences >= 2 * threads ? kv_heads : 1;
  const int64_t items = kv_heads / row_heads, width = block_tables.size(1), item_heads = group * row_heads;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  if (n == 0) return out;
  const int64_t longest = *std::max_element(lens, lens + n);
  const int64_t parts = sequences * items >= 2 * threads ? 1 : std::clamp<int64_t>(
      (4 * threads + sequences * items - 1) / (sequences * items), 1, std::max<int64_t>(1, longest / kMinPartTokens));
  // a row's own parts: as many as its length allows, each of at least kMinPartTokens tokens
  auto parts_of = [&](int64_t s) { return std::min(parts, std::max<int64_t>(1, lens[s] / kMinPartTokens)); };
  if (parts == 1) {
    at::parallel_for(0, n * items, 1, [&](int64_t begin, int64_t end) {
      SpanScratch scratch;
      std::vector<float> peaks(item_heads), totals(item_heads);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / items, h = item % items * row_heads;
        auto rows = make_rows(tables + s * width, h, row_heads);
        attend_head(rows, qp + (s * heads + h * group) * dim, op + (s * heads + h * group) * dim, lens[s], group,
                    row_heads, dim, static_cast<float>(scale), scratch, peaks, totals);
      }
    });
    return out;
  }
  // part p of an item of sequence s holds its tokens [p * span, (p + 1) * span); parts past its own stay empty, and a
  // row of one part is attended whole, as unsplit
  auto span_of = [&](int64_t s) { return (lens[s] + parts_of(s) - 1) / parts_of(s); };
  const int64_t units = n * items * parts;
  std::vector<float> partial(units * item_heads * dim), peaks(units * item_heads), totals(units * item_heads);
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    SpanScratch scratch;
    std::vector<float> item_peaks(item_heads), item_totals(item_heads);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / parts, part = unit % parts, s = item / items, h = item % items * row_heads;
      if (parts_of(s) == 1) {  // attended whole, as unsplit
        if (part == 0) {
          auto rows = make_rows(tables + s * width, h, row_heads);
          attend_head(rows, qp + (s * heads + h * group) * dim, op + (s * heads + h * group) * dim, lens[s], group,
                      row_heads, dim, static_cast<float>(scale), scratch, item_peaks, item_totals);
        }
        continue;
      }
      const int64_t first = part * span_of(s), last = std::min(lens[s], first + span_of(s));
      if (first >= last) continue;
      auto rows = make_rows(tables + s * width, h, row_heads);
      attend_span(rows, qp + (s * heads + h * group) * dim, partial.data() + unit * item_heads * dim, first, last,
                  group, row_heads, dim, static_cast<float>(scale), scratch, peaks.data() + unit * item_heads,
                  totals.data() + unit * item_heads);
    }
  });
  for (int64_t item = 0; item < n * items; ++item) {
    const int64_t s = item / items, h = item % items * row_heads;
    if (parts_of(s) == 1) continue;  // attended whole above
    const int64_t used = (lens[s] + span_of(s) - 1) / span_of(s);  // the parts that hold tokens
    for (int64_t g = 0; g < item_heads; ++g) {
      float peak = -INFINITY;
      for (int64_t p = 0; p < used; ++p) peak = std::max(peak, peaks[(item * parts + p) * item_heads + g]);
      float* o = op + (s * heads + h * group + g) * dim;
      std::fill(o, o + dim, 0.0f);
      float total = 0.0f;
      for (int64_t p = 0; p < used; ++p) {
        const int64_t at = (item * parts + p) * item_heads + g;
        // a part whose scores are all -inf weighs nothing; NaN where a part's scores were: the head's output is
        // then NaN, as unsplit
        const float weight = peaks[at] == -INFINITY ? 0.0f : std::exp(peaks[at] - peak);
        total += weight * totals[at];
        const float* part_out = partial.data() + at * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] += weight * part_out[d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= total;
    }
  }
  return out;
}

// Tokens of one sequence a work item of `read_rows` reads.
constexpr int64_t kReadPartTokens = 256;

// Every cached row of n sequences read out by make_rows' readers (whole-token ones: an item reads all kv_heads KV
// heads of a token), for attention over more than one new token (a prefill chunk): K and V float32 [n, T, kv_heads *
// dim], T = block_tables' width in tokens, row t of sequence s its token t, zeros from context_lens[s] on. A reader
// may write one value past a row (its scratch place), so each row is decoded into a place of its own first.
template <typename MakeRows>
std::vector<at::Tensor> read_rows(at::Tensor block_tables, at::Tensor context_lens, int64_t kv_heads, int64_t dim,
                                  int64_t block, int64_t num_blocks, MakeRows make_rows) {
  block_tables = block_tables.to(at::kLong).contiguous();
  context_lens = context_lens.to(at::kLong).contiguous();
  check_tables(block_tables, context_lens, block, num_blocks);
  const int64_t n = block_tables.size(0), tokens = block_tables.size(1) * block, width = kv_heads * dim;
  const int64_t parts = (tokens + kReadPartTokens - 1) / kReadPartTokens;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  std::vector<at::Tensor> out = {at::empty({n, tokens, width}, at::kFloat), at::empty({n, tokens, width}, at::kFloat)};
  float* k = out[0].data_ptr<float>();
  float* v = out[1].data_ptr<float>();
  at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width + 1);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / parts, first = unit % parts * kReadPartTokens;
      const int64_t last = std::min(tokens, first + kReadPartTokens), filled = std::clamp(lens[s], first, last);
      auto rows = make_rows(tables + s * block_tables.size(1), 0, kv_heads);
      for (int64_t t = first; t < filled; ++t) {
        const int64_t at = (s * tokens + t) * width;
        rows.key(t, row.data());
        std::memcpy(k + at, row.data(), width * sizeof(float));
        rows.value(t, row.data());
        std::memcpy(v + at, row.data(), width * sizeof(float));
      }
      const int64_t tail = (s * tokens + filled) * width, tail_values = (last - filled) * width;
      std::fill(k + tail, k + tail + tail_values, 0.0f);
      std::fill(v + tail, v + tail + tail_values, 0.0f);
    }
  });
  return out;
}

// Whether readers with AVX-512 code (Oaken's dense values) take it: where the CPU has AVX-512 (F, BW, VL) and tests
// have not turned it off to check the AVX2 code on such a CPU (allow_avx512, in paged_decode.cpp).
bool avx512_path();

// The storages' entry points (one file each), bound in paged_decode.cpp.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale);
at::Tensor paged_decode_attention_int8(at::Tensor q, at::Tensor k_records, at::Tensor v_records,
                                       at::Tensor block_tables, at::Tensor context_lens, int64_t block,
                                       int64_t kv_heads, double scale);
at::Tensor paged_decode_attention_int4(at::Tensor q, at::Tensor k_records, at::Tensor v_records,
                                       at::Tensor block_tables, at::Tensor context_lens, int64_t block,
                                       int64_t kv_heads, int64_t group_size, double scale);
at::Tensor paged_decode_attention_kivi(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                       at::Tensor window_slot, at::Tensor block_tables, at::Tensor context_lens,
                                       int64_t bits, int64_t kv_heads, double scale);
at::Tensor paged_decode_attention_oaken(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        std::vector<double> key_shift, std::vector<double> value_shift,
                                        std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                        at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t block, int64_t kv_heads, double scale);
// The same readers' rows read out (read_rows): K and V of whole-block keys, for a prefill chunk's attention.
std::vector<at::Tensor> paged_read_int8(at::Tensor k_records, at::Tensor v_records, at::Tensor block_tables,
                                        at::Tensor context_lens, int64_t block, int64_t kv_heads, int64_t dim);
std::vector<at::Tensor> paged_read_int4(at::Tensor k_records, at::Tensor v_records, at::Tensor block_tables,
                                        at::Tensor context_lens, int64_t block, int64_t kv_heads, int64_t dim,
                                        int64_t group_size);
std::vector<at::Tensor> paged_read_kivi(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        at::Tensor window_slot, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t bits, int64_t kv_heads, int64_t dim);
std::vector<at::Tensor> paged_read_oaken(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                         std::vector<double> key_shift, std::vector<double> value_shift,
                                         std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                         at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                         int64_t block, int64_t kv_heads, int64_t dim);

void integer_store(at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor k_records, at::Tensor v_records,
                   int64_t bits, int64_t group_size);
int64_t sparse_write(std::vector<at::Tensor> layer_tensors, at::Tensor slots, at::Tensor bytes, at::Tensor counts,
                     int64_t block_size, int64_t page_bytes);
void kivi_window_store(at::Tensor k, at::Tensor v, at::Tensor rows, at::Tensor places, at::Tensor window_k,
                       at::Tensor window_v, int64_t layer);
std::vector<int64_t> oaken_store(at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor slots,
                                 std::vector<at::Tensor> k_side, std::vector<at::Tensor> v_side,
                                 std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos, at::Tensor sin);
// InfiniGen's speculation of the tokens a layer's decodes fetch (infinigen_select.cpp), their gather from float
// pools (gather_rows.cpp) and attention over them (fetched_attention.cpp).
std::vector<at::Tensor> gather_rows(std::vector<at::Tensor> pools, at::Tensor slots);
at::Tensor fetched_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor starts, at::Tensor lengths,
                             double scale);
std::vector<at::Tensor> infinigen_select(at::Tensor q_partial, at::Tensor partial_keys, at::Tensor block_tables,
                                         at::Tensor q_positions, at::Tensor dead, int64_t block, double alpha,
                                         double max_fraction, int64_t recent);
std::vector<at::Tensor> oaken_encode(at::Tensor x, at::Tensor bounds, at::Tensor shift_lo, at::Tensor shift_hi,
                                     at::Tensor slot_of_group, std::vector<int64_t> layout);

}  // namespace kvstrata
