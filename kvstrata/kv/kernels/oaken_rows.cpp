// Oaken's records (kv/formats/oaken/codec.py) and sparse pages (kv/sparse_pages.py), one layer, decoded one KV
// head's row at a time exactly as decode_tokens does:
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

namespace kvstrata {

constexpr int64_t kBlockValues = 64;  // values addressed by one 6-bit index

struct OakenSide {
  const uint8_t* records;
  const uint8_t* sparse;
  const int64_t* block_pages;
  const int32_t* token_offset;
  const int16_t* token_count;
  const int64_t* key_group;
  const float* key_sign;
  const float* key_threshold;
  bool shifted;
  float shift_lo, shift_hi;
  int64_t pages_per_block;
};

struct OakenRows {
  OakenSide k, v;
  const int64_t* table;
  int64_t block, dim, width, record_bytes, groups, dense_group, entry_bytes, page_bytes, head_offset;
  bool fp16_outliers;
  int64_t add_mean;  // 0 none, 1 the mean key as it is, 2 rotated to the position
  bool rotate_key;
  const float* mean;  // the layer's mean key [width]
  const float* cos;   // [positions, dim]
  const float* sin;
  std::vector<float> buffer, rotated;
  std::vector<uint8_t> scratch;

  // The `n` bytes of a token's sparse entries from logical offset `begin` within its block's pages: a pointer into
  // the page where they lie in one, else a copy into `scratch` (entries may straddle a page boundary).
  const uint8_t* sparse_bytes(const OakenSide& side, int64_t block_id, int64_t begin, int64_t n) {
    if (n == 0) return nullptr;  // a block without outliers may own no page
    const int64_t* pages = side.block_pages + block_id * side.pages_per_block;
    if (begin / page_bytes == (begin + n - 1) / page_bytes) {
      return side.sparse + pages[begin / page_bytes] * page_bytes + begin % page_bytes;
    }
    scratch.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = begin + i;
      scratch[i] = side.sparse[pages[at / page_bytes] * page_bytes + at % page_bytes];
    }
    return scratch.data();
  }

  const float* decode(const OakenSide& side, int64_t t) {
    const int64_t slot = slot_of(table, block, t), block_id = table[t / block];
    const uint8_t* rec = side.records + slot * record_bytes;
    const uint8_t* params = rec + width / 2;
    const uint8_t* counts = params + 4 * groups;
    widen_nibbles(rec + head_offset / 2, dim / 2, half_at(params + 4 * dense_group),
                  half_at(params + 4 * dense_group + 2), buffer.data());
    if (side.shifted) {
      for (int64_t d = 0; d < dim; ++d) buffer[d] += buffer[d] >= 0 ? side.shift_hi : side.shift_lo;
    }
    // the outliers of the 64-value blocks the head covers; entries run in (block, index) order
    const int64_t first = head_offset / kBlockValues, last = (head_offset + dim - 1) / kBlockValues;
    int64_t skipped = 0, count = 0;
    for (int64_t b = 0; b < first; ++b) skipped += counts[b];
    for (int64_t b = first; b <= last; ++b) count += counts[b];
    const uint8_t* entry =
        sparse_bytes(side, block_id, side.token_offset[slot] + skipped * entry_bytes, count * entry_bytes);
    for (int64_t b = first; b <= last; ++b) {
      for (int64_t e = 0; e < counts[b]; ++e, entry += entry_bytes) {
        const int64_t flat = b * kBlockValues + (entry[0] & 63);
        if (flat < head_offset || flat >= head_offset + dim) continue;
        float x;
        if (fp16_outliers) {
          x = half_at(entry + entry_bytes - 2);
        } else {
          const int64_t key = groups <= 3 ? entry[0] >> 6 : entry[1];
          const int64_t g = side.key_group[key];
          const float code = static_cast<float>((rec[flat / 2] >> (4 * (flat % 2))) & 15);
          x = (code * half_at(params + 4 * g + 2) + half_at(params + 4 * g)) * side.key_sign[key] +
              side.key_threshold[key];
        }
        buffer[flat - head_offset] = x;
      }
    }
    return buffer.data();
  }

  // RoPE at position t of [dim] values (halves layout: value d pairs with d + dim / 2), added to `out` (the rotated
  // mean key) or written to it (a key quantized before RoPE).
  template <bool Add>
  void rope(const float* __restrict x, int64_t t, float* __restrict out) const {
    const int64_t half = dim / 2;
    const float* __restrict c = cos + t * dim;
    const float* __restrict s = sin + t * dim;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float first = x[d] * c[d] - x[d + half] * s[d], second = x[d + half] * c[d + half] + x[d] * s[d + half];
      out[d] = Add ? out[d] + first : first;
      out[d + half] = Add ? out[d + half] + second : second;
    }
  }

  const float* key(int64_t t) {
    decode(k, t);
    const float* m = mean + head_offset;
    if (add_mean == 1) {
      for (int64_t d = 0; d < dim; ++d) buffer[d] += m[d];
    } else if (add_mean == 2) {
      rope<true>(m, t, buffer.data());
    }
    if (!rotate_key) return buffer.data();
    rope<false>(buffer.data(), t, rotated.data());
    return rotated.data();
  }
  const float* value(int64_t t) { return decode(v, t); }
};

static OakenSide side_of(const std::vector<at::Tensor>& t, const std::vector<double>& shift, int64_t slots) {
  TORCH_CHECK(t.size() == 8 && shift.size() == 3,
              "paged_decode_attention_oaken: a side is 8 tensors and its shift (shifted, lo, hi)");
  TORCH_CHECK(t[0].scalar_type() == at::kByte && t[0].dim() == 2 && t[0].size(0) == slots && t[0].is_contiguous(),
              "paged_decode_attention_oaken: records must be contiguous uint8 [slots, record_bytes] alike for K and V");
  TORCH_CHECK(t[1].scalar_type() == at::kByte && t[1].is_contiguous(), "paged_decode_attention_oaken: sparse data");
  TORCH_CHECK(t[2].scalar_type() == at::kLong && t[2].dim() == 2 && t[2].is_contiguous(),
              "paged_decode_attention_oaken: block pages must be int64 [blocks, pages]");
  TORCH_CHECK(t[3].scalar_type() == at::kInt && t[4].scalar_type() == at::kShort && t[3].numel() == slots &&
                  t[4].numel() == slots && t[3].is_contiguous() && t[4].is_contiguous(),
              "paged_decode_attention_oaken: token offsets int32 and counts int16, one per slot");
  TORCH_CHECK(t[5].scalar_type() == at::kLong && t[6].scalar_type() == at::kFloat &&
                  t[7].scalar_type() == at::kFloat && t[5].numel() == t[6].numel() && t[5].numel() == t[7].numel(),
              "paged_decode_attention_oaken: key tables int64, float32, float32 of one size");
  return OakenSide{t[0].data_ptr<uint8_t>(), t[1].data_ptr<uint8_t>(), t[2].data_ptr<int64_t>(),
                   t[3].data_ptr<int32_t>(), t[4].data_ptr<int16_t>(), t[5].data_ptr<int64_t>(),
                   t[6].data_ptr<float>(), t[7].data_ptr<float>(), shift[0] != 0, static_cast<float>(shift[1]),
                   static_cast<float>(shift[2]), t[2].size(1)};
}

at::Tensor paged_decode_attention_oaken(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        std::vector<double> key_shift, std::vector<double> value_shift,
                                        std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                        at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t block, int64_t kv_heads, double scale) {
  TORCH_CHECK(layout.size() == 7, "paged_decode_attention_oaken: layout is 7 numbers");
  const int64_t groups = layout[0], dense_group = layout[1], entry_bytes = layout[2], page_bytes = layout[4];
  const bool fp16_outliers = layout[3] != 0, rotate_key = layout[6] != 0;
  const int64_t add_mean = layout[5];
  const int64_t dim = q.size(2), width = kv_heads * dim, record_bytes = width / 2 + 4 * groups + width / kBlockValues;
  TORCH_CHECK(width % kBlockValues == 0 && dim % 2 == 0 && groups >= 2 && groups <= 5 && dense_group >= 0 && dense_group < groups,
              "paged_decode_attention_oaken: a width that is a multiple of 64, an even head_dim and 2 to 5 groups");
  TORCH_CHECK(block > 0 && keys.size() == 8 && keys[0].dim() == 2 && keys[0].size(0) % block == 0 &&
                  keys[0].size(1) == record_bytes,
              "paged_decode_attention_oaken: records of ", record_bytes, " bytes over whole blocks");
  const int64_t slots = keys[0].size(0), num_blocks = slots / block;
  const OakenSide k = side_of(keys, key_shift, slots), v = side_of(values, value_shift, slots);
  TORCH_CHECK(values[0].size(1) == record_bytes, "paged_decode_attention_oaken: K and V records differ");
  const bool positional = add_mean == 2 || rotate_key;
  if (add_mean != 0) {
    TORCH_CHECK(key_mean.scalar_type() == at::kFloat && key_mean.numel() == width && key_mean.is_contiguous(),
                "paged_decode_attention_oaken: the mean key must be float32 [width]");
  }
  if (positional) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                    cos.dim() == 2 && cos.size(1) == dim && cos.is_contiguous() && sin.is_contiguous() &&
                    dim % 2 == 0,
                "paged_decode_attention_oaken: cos and sin must be float32 [positions, dim]");
    TORCH_CHECK(context_lens.numel() == 0 || context_lens.max().item<int64_t>() <= cos.size(0),
                "paged_decode_attention_oaken: cos and sin cover too few positions");
  }
  const float* mean = add_mean != 0 ? key_mean.data_ptr<float>() : nullptr;
  const float* c = positional ? cos.data_ptr<float>() : nullptr;
  const float* s = positional ? sin.data_ptr<float>() : nullptr;
  return run(q, block_tables, context_lens, kv_heads, block, num_blocks, scale, [&](const int64_t* table, int64_t h) {
    return OakenRows{k, v, table, block, dim, width, record_bytes, groups, dense_group, entry_bytes, page_bytes,
                     h * dim, fp16_outliers, add_mean, rotate_key, mean, c, s, std::vector<float>(dim),
                     std::vector<float>(dim), std::vector<uint8_t>()};
  });
}

}  // namespace kvstrata
