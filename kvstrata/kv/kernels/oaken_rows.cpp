// Oaken's records (kv/formats/oaken/codec.py) and sparse pages (kv/sparse_pages.py), one layer, decoded one item's
// KV heads (a row) at a time exactly as decode_tokens does:
//   dense record: width / 2 bytes of nibbles | groups x float16 (minimum, step) | per 64 values, the outlier count;
//   dense value = code * step + minimum of the dense group, plus the group's lo or hi threshold by the sign of that
//   sum where the dense group is shifted;
//   an outlier's entry (1 byte: index | slot << 6 | high bit << 7; 2 bytes for more than 3 groups) names its group
//   and side through the key tables, and its value is (code * step + minimum) * sign + threshold of that side, or
//   its float16 value where outliers are kept as float16.
// Each side (K or V) is [records, sparse data, block pages, token offsets, token counts, key group, key sign, key
// threshold], the layout [groups, dense group, entry bytes, float16 outliers, page bytes, add mean, rotate key]:
// keys add the model's mean key back (1: as it is, 2: rotated to the token's position) and are rotated to their
// position afterwards (rotate key: keys quantized before RoPE), with RoPE's cos and sin tables [positions, dim].
#include "attend.h"
#include "oaken_encode.h"

namespace kvstrata {

constexpr int64_t kBlockValues = 64;  // values addressed by one 6-bit index

// A record's dense values on AVX-512: the 16 codes' values are worked out once per row by the AVX2 loop's arithmetic
// (code * step + minimum, then the group shift: lo below zero, hi at or above, where `shifted`), and each code looks
// its value up, 16 in one permute, where AVX2 converts, multiplies and shifts 8 at a time. 2 * n_bytes values.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace avx512 {
static void dense_values(const uint8_t* bytes, int64_t n_bytes, float minimum, float step, bool shifted, float lo,
                         float hi, float* out) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(step), _mm512_set1_ps(minimum));
  if (shifted) {
    const __mmask16 at_or_above_zero = _mm512_cmp_ps_mask(table, _mm512_setzero_ps(), _CMP_GE_OQ);
    table = _mm512_add_ps(table, _mm512_mask_blend_ps(at_or_above_zero, _mm512_set1_ps(lo), _mm512_set1_ps(hi)));
  }
  const __m128i nibble = _mm_set1_epi8(15);
  int64_t j = 0;
  for (; j + 16 <= n_bytes; j += 16) {  // 16 bytes: 32 codes, in order (value 2i in the low nibble of byte i)
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
    const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    _mm512_storeu_ps(out + 2 * j, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)), table));
    _mm512_storeu_ps(out + 2 * j + 16,
                     _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(low, high)), table));
  }
  alignas(64) float values[16];
  _mm512_store_ps(values, table);
  for (; j < n_bytes; ++j) {
    out[2 * j] = values[bytes[j] & 15];
    out[2 * j + 1] = values[bytes[j] >> 4];
  }
}
}  // namespace avx512
#pragma GCC pop_options

struct OakenSide {
  const uint8_t* records;
  const uint8_t* sparse;
  const uint8_t* sparse_end;
  const int64_t* block_pages;
  const int32_t* token_offset;
  const int16_t* token_count;
  const int64_t* key_group;
  const float* key_sign;
  const float* key_threshold;
  bool shifted;
  float shift_lo, shift_hi;
  int64_t pages_per_block;
  // For one-byte entries (2 or 3 groups), the four keys' tables in the lanes of a vector (keys 0-3, then again):
  // where a key's group's minimum and step lie among a record's parameters widened to 8 floats, its sign and its
  // threshold. Entries then patch 8 at a time (OakenRows::patch_one_byte_entries).
  __m256i key_minimum_lane, key_step_lane;
  __m256 key_sign8, key_threshold8;
};

struct OakenRows {
  OakenSide k, v;
  const int64_t* table;
  BlockSlots slots;
  BlockSlots sparse_places;  // a byte's place in the sparse data from its block's pages and its offset in them
  int64_t dim, head_dim, width, record_bytes, groups, dense_group, entry_bytes, head_offset;
  bool fp16_outliers;
  bool wide_vectors;  // AVX-512 for the dense values (avx512_path)
  int64_t add_mean;  // 0 none, 1 the mean key as it is, 2 rotated to the position
  bool rotate_key;
  const float* mean;  // the layer's mean key [width]
  const float* cos;   // [positions, dim]
  const float* sin;
  std::vector<float> unrotated;  // a key quantized before RoPE, before its rotation (and a place after it)
  std::vector<uint8_t> scratch;

  // The `n` bytes of a token's sparse entries from logical offset `begin` within its block's pages: a pointer into
  // the page where they lie in one, else a copy into `scratch` (entries may straddle a page boundary). At least 8
  // bytes past the last entry can be read (their values are not used): the vector patch loads 8 entries at once.
  const uint8_t* sparse_bytes(const OakenSide& side, int64_t block_id, int64_t begin, int64_t n) {
    if (n == 0) return nullptr;  // a block without outliers may own no page
    const int64_t* pages = side.block_pages + block_id * side.pages_per_block;
    if (sparse_places.entry(begin) == sparse_places.entry(begin + n - 1)) {
      const uint8_t* bytes = side.sparse + sparse_places.of(pages, begin);
      if (bytes + n + 8 <= side.sparse_end) return bytes;
    }
    scratch.assign(n + 8, 0);
    for (int64_t i = 0; i < n; ++i) scratch[i] = side.sparse[sparse_places.of(pages, begin + i)];
    return scratch.data();
  }

  // Token t's record and the first of its sparse bytes.
  void prefetch(bool keys, int64_t t) const {
    const OakenSide& side = keys ? k : v;
    const int64_t slot = slots.of(table, t);
    prefetch_bytes(side.records + slot * record_bytes, record_bytes);
    const int64_t* pages = side.block_pages + table[slots.entry(t)] * side.pages_per_block;
    const int64_t begin = side.token_offset[slot];
    if (side.token_count[slot] > 0) _mm_prefetch(side.sparse + sparse_places.of(pages, begin), _MM_HINT_T0);
  }

  // Token t's row of one side into out: the dense values, then the outliers of the 64-value blocks the row covers
  // (entries run in (block, index) order) in their places.
  void decode(const OakenSide& side, int64_t t, float* out) {
    const int64_t slot = slots.of(table, t), block_id = table[slots.entry(t)];
    const uint8_t* rec = side.records + slot * record_bytes;
    const uint8_t* params = rec + width / 2;
    const uint8_t* counts = params + 4 * groups;
    const float low = half_at(params + 4 * dense_group), step_size = half_at(params + 4 * dense_group + 2);
    if (wide_vectors) {
      avx512::dense_values(rec + head_offset / 2, dim / 2, low, step_size, side.shifted, side.shift_lo, side.shift_hi,
                           out);
    } else if (side.shifted) {  // each dense value moved by its side's shift: lo below zero, hi at or above
      const __m256 lo = _mm256_set1_ps(side.shift_lo), hi = _mm256_set1_ps(side.shift_hi), zero = _mm256_setzero_ps();
      widen_nibbles(rec + head_offset / 2, dim / 2, low, step_size, out, [&](__m256 x) {
        return _mm256_add_ps(x, _mm256_blendv_ps(lo, hi, _mm256_cmp_ps(x, zero, _CMP_GE_OQ)));
      });
    } else {
      widen_nibbles(rec + head_offset / 2, dim / 2, low, step_size, out);
    }
    const int64_t first = head_offset / kBlockValues, last = (head_offset + dim - 1) / kBlockValues;
    int64_t skipped = 0, count = 0;
    for (int64_t b = 0; b < first; ++b) skipped += counts[b];
    for (int64_t b = first; b <= last; ++b) count += counts[b];
    const uint8_t* entry =
        sparse_bytes(side, block_id, side.token_offset[slot] + skipped * entry_bytes, count * entry_bytes);
    if (count == 0) return;
    float* at = out - head_offset;  // indexed by the value's place in the record
    if (fp16_outliers) {
      for (int64_t b = first; b <= last; ++b) {
        for (int64_t e = 0; e < counts[b]; ++e, entry += entry_bytes) {
          const int64_t flat = b * kBlockValues + (entry[0] & 63);
          if (flat >= head_offset && flat < head_offset + dim) at[flat] = half_at(entry + entry_bytes - 2);
        }
      }
      return;
    }
    if (entry_bytes == 1) {
      if (head_offset == 0 && dim == width) {
        patch_one_byte_entries<true>(side, rec, params, counts, entry, first, last, out);
      } else {
        patch_one_byte_entries<false>(side, rec, params, counts, entry, first, last, out);
      }
      return;
    }
    float step[kMaxGroups], minimum[kMaxGroups];  // each group's parameters, widened once per row
    for (int64_t g = 0; g < groups; ++g) {
      minimum[g] = half_at(params + 4 * g);
      step[g] = half_at(params + 4 * g + 2);
    }
    for (int64_t b = first; b <= last; ++b) {
      for (int64_t e = 0; e < counts[b]; ++e, entry += entry_bytes) {
        const int64_t flat = b * kBlockValues + (entry[0] & 63);
        if (flat < head_offset || flat >= head_offset + dim) continue;
        const int64_t key = entry[1], g = side.key_group[key];
        at[flat] = (nibble_at(rec, flat) * step[g] + minimum[g]) * side.key_sign[key] + side.key_threshold[key];
      }
    }
  }

  // A row's outliers in one-byte entries (index | key << 6), 8 at a time, by the scalar loop's arithmetic:
  // (code * step + minimum) * sign + threshold, the code being the value's nibble in the record. Lanes past a
  // block's entries or outside the row write to out[dim], the place after the row (a reader's scratch place: see
  // in_tiles); blocks first to last are the row's. A row of all the record's values (WholeRecord) needs no check
  // that an entry lies in it.
  template <bool WholeRecord>
  void patch_one_byte_entries(const OakenSide& side, const uint8_t* rec, const uint8_t* params, const uint8_t* counts,
                              const uint8_t* entry, int64_t first, int64_t last, float* out) {
    // (minimum, step) of 2 or 3 groups: 8 or 12 bytes, loaded without reading past them
    __m128i halves = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(params));
    if (groups == 3) {
      int32_t third;
      std::memcpy(&third, params + 8, sizeof(third));
      halves = _mm_insert_epi32(halves, third, 2);
    }
    const __m256 widened = _mm256_cvtph_ps(halves);
    // each key's step and minimum times its sign (+-1: exact), so that one FMA gives (code * step + minimum) * sign
    const __m256 signed_minimum =
        _mm256_mul_ps(_mm256_permutevar8x32_ps(widened, side.key_minimum_lane), side.key_sign8);
    const __m256 signed_step = _mm256_mul_ps(_mm256_permutevar8x32_ps(widened, side.key_step_lane), side.key_sign8);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), head = _mm256_set1_epi32(head_offset);
    const __m256i spare = _mm256_set1_epi32(dim), none = _mm256_set1_epi32(-1);
    const __m256i low6 = _mm256_set1_epi32(63);
    const __m128i index_bits = _mm_set1_epi8(63), byte_bits = _mm_set1_epi8(31), nibble = _mm_set1_epi8(15);
    const __m128i one = _mm_set1_epi8(1);
    alignas(32) float values[8];
    alignas(32) int32_t places[8];
    for (int64_t b = first; b <= last; entry += counts[b], ++b) {
      const __m256i block_start = _mm256_set1_epi32(b * kBlockValues);
      // the block's 32 bytes of codes, in two halves that byte shuffles look up (faster than a gather)
      const uint8_t* block_codes = rec + b * kBlockValues / 2;
      const __m128i low_half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block_codes));
      const __m128i high_half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block_codes + 16));
      for (int64_t e = 0; e < counts[b]; e += 8) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(entry + e));
        const __m256i bytes = _mm256_cvtepu8_epi32(raw);
        const __m256i flat = _mm256_add_epi32(block_start, _mm256_and_si256(bytes, low6));
        const __m256i key = _mm256_srli_epi32(bytes, 6);
        const __m256i place = _mm256_sub_epi32(flat, head);
        __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(counts[b] - e), lanes);
        if (!WholeRecord) {  // a row of some heads: entries of the others' values are skipped
          live = _mm256_and_si256(
              live, _mm256_and_si256(_mm256_cmpgt_epi32(place, none), _mm256_cmpgt_epi32(spare, place)));
        }
        // the code of index i: byte i / 2 of the block, its high nibble where i is odd
        const __m128i index = _mm_and_si128(raw, index_bits);
        const __m128i byte_index = _mm_and_si128(_mm_srli_epi16(index, 1), byte_bits);
        const __m128i byte = _mm_blendv_epi8(_mm_shuffle_epi8(low_half, byte_index),
                                             _mm_shuffle_epi8(high_half, byte_index),
                                             _mm_cmpgt_epi8(byte_index, _mm_set1_epi8(15)));
        const __m128i odd = _mm_cmpeq_epi8(_mm_and_si128(index, one), one);
        const __m128i codes = _mm_and_si128(_mm_blendv_epi8(byte, _mm_srli_epi16(byte, 4), odd), nibble);
        const __m256i code = _mm256_cvtepu8_epi32(codes);
        const __m256 x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), _mm256_permutevar8x32_ps(signed_step, key),
                                         _mm256_permutevar8x32_ps(signed_minimum, key));
        _mm256_store_ps(values, _mm256_add_ps(x, _mm256_permutevar8x32_ps(side.key_threshold8, key)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(places), _mm256_blendv_epi8(spare, place, live));
        for (int i = 0; i < 8; ++i) out[places[i]] = values[i];
      }
    }
  }

  // RoPE at position t of each head's values in the row (halves layout: value d pairs with d + head_dim / 2), added
  // to `out` (the rotated mean key) or written to it (a key quantized before RoPE).
  template <bool Add>
  void rope(const float* __restrict x, int64_t t, float* __restrict out) const {
    const int64_t half = head_dim / 2;
    const float* __restrict c = cos + t * head_dim;
    const float* __restrict s = sin + t * head_dim;
    for (int64_t h = 0; h < dim; h += head_dim) {
#pragma omp simd
      for (int64_t d = h; d < h + half; ++d) {
        const float first = x[d] * c[d - h] - x[d + half] * s[d - h];
        const float second = x[d + half] * c[d - h + half] + x[d] * s[d - h + half];
        out[d] = Add ? out[d] + first : first;
        out[d + half] = Add ? out[d + half] + second : second;
      }
    }
  }

  void key(int64_t t, float* out) {
    float* key = rotate_key ? unrotated.data() : out;
    decode(k, t, key);
    const float* m = mean + head_offset;
    if (add_mean == 1) {
      for (int64_t d = 0; d < dim; ++d) key[d] += m[d];
    } else if (add_mean == 2) {
      rope<true>(m, t, key);
    }
    if (rotate_key) rope<false>(key, t, out);
  }
  void value(int64_t t, float* out) { decode(v, t, out); }
};

static OakenSide side_of(const std::vector<at::Tensor>& t, const std::vector<double>& shift, int64_t slots,
                         const char* what) {
  TORCH_CHECK(t.size() == 8 && shift.size() == 3,
              what, ": a side is 8 tensors and its shift (shifted, lo, hi)");
  TORCH_CHECK(t[0].scalar_type() == at::kByte && t[0].dim() == 2 && t[0].size(0) == slots && t[0].is_contiguous(),
              what, ": records must be contiguous uint8 [slots, record_bytes] alike for K and V");
  TORCH_CHECK(t[1].scalar_type() == at::kByte && t[1].is_contiguous(), what, ": sparse data");
  TORCH_CHECK(t[2].scalar_type() == at::kLong && t[2].dim() == 2 && t[2].is_contiguous(),
              what, ": block pages must be int64 [blocks, pages]");
  TORCH_CHECK(t[3].scalar_type() == at::kInt && t[4].scalar_type() == at::kShort && t[3].numel() == slots &&
                  t[4].numel() == slots && t[3].is_contiguous() && t[4].is_contiguous(),
              what, ": token offsets int32 and counts int16, one per slot");
  TORCH_CHECK(t[5].scalar_type() == at::kLong && t[6].scalar_type() == at::kFloat &&
                  t[7].scalar_type() == at::kFloat && t[5].numel() == t[6].numel() && t[5].numel() == t[7].numel(),
              what, ": key tables int64, float32, float32 of one size");
  OakenSide side{t[0].data_ptr<uint8_t>(), t[1].data_ptr<uint8_t>(), t[1].data_ptr<uint8_t>() + t[1].numel(),
                 t[2].data_ptr<int64_t>(), t[3].data_ptr<int32_t>(), t[4].data_ptr<int16_t>(),
                 t[5].data_ptr<int64_t>(), t[6].data_ptr<float>(), t[7].data_ptr<float>(), shift[0] != 0,
                 static_cast<float>(shift[1]), static_cast<float>(shift[2]), t[2].size(1)};
  if (t[5].numel() == 4) {  // one-byte entries
    alignas(32) int32_t minimum_lane[8], step_lane[8];
    alignas(32) float sign[8], threshold[8];
    for (int lane = 0; lane < 8; ++lane) {
      const int64_t key = lane % 4;
      minimum_lane[lane] = 2 * side.key_group[key];
      step_lane[lane] = 2 * side.key_group[key] + 1;
      sign[lane] = side.key_sign[key];
      threshold[lane] = side.key_threshold[key];
    }
    side.key_minimum_lane = _mm256_load_si256(reinterpret_cast<const __m256i*>(minimum_lane));
    side.key_step_lane = _mm256_load_si256(reinterpret_cast<const __m256i*>(step_lane));
    side.key_sign8 = _mm256_load_ps(sign);
    side.key_threshold8 = _mm256_load_ps(threshold);
  }
  return side;
}

// The readers of an item (make_rows for `run` and `read_rows`), once the sides, tables and layout are checked.
static auto oaken_rows(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const std::vector<double>& key_shift, const std::vector<double>& value_shift,
                       const std::vector<int64_t>& layout, const at::Tensor& key_mean, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& context_lens, int64_t block, int64_t kv_heads,
                       int64_t dim, const char* what) {
  TORCH_CHECK(layout.size() == 7, what, ": layout is 7 numbers");
  const int64_t groups = layout[0], dense_group = layout[1], entry_bytes = layout[2], page_bytes = layout[4];
  TORCH_CHECK(page_bytes >= 1, what, ": pages of ", page_bytes, " bytes");
  const bool fp16_outliers = layout[3] != 0, rotate_key = layout[6] != 0;
  const int64_t add_mean = layout[5];
  const int64_t width = kv_heads * dim, record_bytes = width / 2 + 4 * groups + width / kBlockValues;
  TORCH_CHECK(width % kBlockValues == 0 && dim % 2 == 0 && groups >= 2 && groups <= kMaxGroups && dense_group >= 0 && dense_group < groups,
              what, ": a width that is a multiple of 64, an even head_dim and 2 to 5 groups");
  TORCH_CHECK(block > 0 && keys.size() == 8 && keys[0].dim() == 2 && keys[0].size(0) % block == 0 &&
                  keys[0].size(1) == record_bytes,
              what, ": records of ", record_bytes, " bytes over whole blocks");
  const int64_t slots = keys[0].size(0);
  const OakenSide k = side_of(keys, key_shift, slots, what), v = side_of(values, value_shift, slots, what);
  TORCH_CHECK(values[0].size(1) == record_bytes, what, ": K and V records differ");
  const bool positional = add_mean == 2 || rotate_key;
  if (add_mean != 0) {
    TORCH_CHECK(key_mean.scalar_type() == at::kFloat && key_mean.numel() == width && key_mean.is_contiguous(),
                what, ": the mean key must be float32 [width]");
  }
  if (positional) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                    cos.dim() == 2 && cos.size(1) == dim && cos.is_contiguous() && sin.is_contiguous() &&
                    dim % 2 == 0,
                what, ": cos and sin must be float32 [positions, dim]");
    TORCH_CHECK(context_lens.numel() == 0 || context_lens.max().item<int64_t>() <= cos.size(0),
                what, ": cos and sin cover too few positions");
  }
  const float* mean = add_mean != 0 ? key_mean.data_ptr<float>() : nullptr;
  const float* c = positional ? cos.data_ptr<float>() : nullptr;
  const float* s = positional ? sin.data_ptr<float>() : nullptr;
  const bool wide_vectors = avx512_path();
  return [=](const int64_t* table, int64_t h, int64_t row_heads) {
    return OakenRows{k, v, table, BlockSlots{block}, BlockSlots{page_bytes}, row_heads * dim, dim, width, record_bytes,
                     groups, dense_group, entry_bytes, h * dim, fp16_outliers, wide_vectors, add_mean, rotate_key,
                     mean, c, s, std::vector<float>(rotate_key ? row_heads * dim + 1 : 0), std::vector<uint8_t>()};
  };
}

at::Tensor paged_decode_attention_oaken(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        std::vector<double> key_shift, std::vector<double> value_shift,
                                        std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                        at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t block, int64_t kv_heads, double scale, int64_t min_shared_tokens,
                                        int64_t window) {
  const auto rows = oaken_rows(keys, values, key_shift, value_shift, layout, key_mean, cos, sin, context_lens, block,
                               kv_heads, q.size(2), "paged_decode_attention_oaken");
  return run(q, block_tables, context_lens, kv_heads, block, keys[0].size(0) / block, scale, rows, true,
             min_shared_tokens, window);
}

std::vector<at::Tensor> paged_read_oaken(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                         std::vector<double> key_shift, std::vector<double> value_shift,
                                         std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                         at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                         int64_t block, int64_t kv_heads, int64_t dim) {
  const auto rows = oaken_rows(keys, values, key_shift, value_shift, layout, key_mean, cos, sin, context_lens, block,
                               kv_heads, dim, "paged_read_oaken");
  return read_rows(block_tables, context_lens, kv_heads, dim, block, keys[0].size(0) / block, rows);
}

}  // namespace kvstrata
