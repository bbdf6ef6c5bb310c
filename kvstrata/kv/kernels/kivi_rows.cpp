// KIVI's blocks (kv/kivi_cache.py), one layer: keys quantized per channel over a block, values per token in
// groups of channels, `bits` (2 or 4) per code packed little end first (value i in byte i / (8 / bits), at bit
// bits * (i % (8 / bits))); blocks still in the full-precision window read their float16 rows instead.
//   keys:   [key_codes uint8 [slots, width * bits / 8], key_params float16 [blocks, width, 2] (minimum, step)]
//   values: [value_codes uint8 [slots, width * bits / 8], value_params float16 [slots, width / group, 2]]
//   window: [window_k, window_v] float16 [window_slots, block, width]; window_slot int64 [blocks], -1: quantized.
#include "attend.h"

namespace kvstrata {

template <int Bits>
struct KiviRows {
  static constexpr int64_t kPerByte = 8 / Bits, kMask = (1 << Bits) - 1;
  const uint8_t* key_codes;
  const at::Half* key_params;
  const uint8_t* value_codes;
  const at::Half* value_params;
  const at::Half* window_k;
  const at::Half* window_v;
  const int64_t* window_slot;
  const int64_t* table;
  BlockSlots slots;
  int64_t dim, width, value_group, head_offset;
  std::vector<float> codes, key_minimum, key_step;
  int64_t params_block = -1;  // the block whose key params key_minimum and key_step hold: 16 tokens share them

  // `n_bytes` bytes of codes as low + code * step (low and step: one for all, or one per value).
  template <typename Param>
  static void widen(const uint8_t* bytes, int64_t n_bytes, Param low, Param step, float* out) {
    if constexpr (Bits == 4) {
      widen_nibbles(bytes, n_bytes, low, step, out);
    } else {
      widen_crumbs(bytes, n_bytes, low, step, out);
    }
  }

  // The row's codes of one token, as floats (a row that does not start or end on a whole byte).
  void unpack(const uint8_t* token_codes) {
    for (int64_t d = 0; d < dim; ++d) {
      const int64_t c = head_offset + d;
      codes[d] = static_cast<float>((token_codes[c / kPerByte] >> (Bits * (c % kPerByte))) & kMask);
    }
  }
  // Token t's codes (and a value's parameters), or its row in the window.
  void prefetch(bool keys, int64_t t) const {
    const int64_t w = window_slot[table[slots.entry(t)]];
    if (w >= 0) {
      prefetch_bytes((keys ? window_k : window_v) + (w * slots.block + slots.offset(t)) * width + head_offset,
                     dim * sizeof(at::Half));
      return;
    }
    const int64_t slot = slots.of(table, t);
    prefetch_bytes((keys ? key_codes : value_codes) + slot * (width * Bits / 8), width * Bits / 8);
    if (keys) return;  // a block's key params are read once per block
    const int64_t params = (width / value_group) * 2;  // a token's value (minimum, step) pairs
    prefetch_bytes(value_params + slot * params, params * sizeof(at::Half));
  }

  // Whether the block is still in the window; if so, its row is widened into out.
  bool from_window(const at::Half* window, int64_t t, float* out) const {
    const int64_t w = window_slot[table[slots.entry(t)]];
    if (w < 0) return false;
    widen_halves(window + (w * slots.block + slots.offset(t)) * width + head_offset, dim, out);
    return true;
  }
  void key(int64_t t, float* out) {
    if (from_window(window_k, t, out)) return;
    const int64_t block_id = table[slots.entry(t)];
    if (block_id != params_block) {  // (minimum, step) per channel of the row, each in an array of its own
      widen_pairs(key_params + (block_id * width + head_offset) * 2, dim, key_minimum.data(), key_step.data());
      params_block = block_id;
    }
    const uint8_t* token_codes = key_codes + slots.of(table, t) * (width * Bits / 8);
    if (head_offset % kPerByte == 0 && dim % kPerByte == 0) {  // straight from the codes' bytes
      widen(token_codes + head_offset / kPerByte, dim / kPerByte, key_minimum.data(), key_step.data(), out);
      return;
    }
    unpack(token_codes);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = key_minimum[d] + codes[d] * key_step[d];
  }
  void value(int64_t t, float* out) {
    if (from_window(window_v, t, out)) return;
    const int64_t slot = slots.of(table, t);
    const uint8_t* token_codes = value_codes + slot * (width * Bits / 8);
    const at::Half* token_params = value_params + slot * (width / value_group) * 2;
    const bool whole_bytes = head_offset % kPerByte == 0 && value_group % kPerByte == 0 && dim % kPerByte == 0;
    if (!whole_bytes) unpack(token_codes);
    for (int64_t d = 0; d < dim;) {  // group after group of the row's channels
      const int64_t g = (head_offset + d) / value_group, end = std::min(dim, (g + 1) * value_group - head_offset);
      const float low = static_cast<float>(token_params[2 * g]), step = static_cast<float>(token_params[2 * g + 1]);
      if (whole_bytes) {  // straight from the codes' bytes
        widen(token_codes + (head_offset + d) / kPerByte, (end - d) / kPerByte, low, step, out + d);
        d = end;
      }
      for (; d < end; ++d) out[d] = low + codes[d] * step;
    }
  }
};

// The readers of an item (make_rows for `run` and `read_rows`).
template <int Bits>
auto kivi_rows(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
               const at::Tensor& window_slot, int64_t block, int64_t dim, int64_t width, int64_t value_group) {
  const uint8_t* key_codes = keys[0].data_ptr<uint8_t>();
  const uint8_t* value_codes = values[0].data_ptr<uint8_t>();
  const at::Half* key_params = keys[1].data_ptr<at::Half>();
  const at::Half* value_params = values[1].data_ptr<at::Half>();
  const at::Half* window_k = keys[2].data_ptr<at::Half>();
  const at::Half* window_v = values[2].data_ptr<at::Half>();
  const int64_t* slots = window_slot.data_ptr<int64_t>();
  return [=](const int64_t* table, int64_t h, int64_t row_heads) {
    const int64_t row = row_heads * dim;
    return KiviRows<Bits>{key_codes, key_params, value_codes, value_params, window_k, window_v, slots, table,
                          BlockSlots{block}, row, width, value_group, h * dim, std::vector<float>(row),
                          std::vector<float>(row), std::vector<float>(row)};
  };
}

// Checks a layer's codes, params and window; its value group (channels sharing a value's parameters).
static int64_t check_kivi(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                          const at::Tensor& window_slot, int64_t bits, int64_t width, const char* what) {
  TORCH_CHECK(keys.size() == 3 && values.size() == 3, what, ": keys and values are [codes, params, window] each");
  TORCH_CHECK(bits == 2 || bits == 4, what, ": bits must be 2 or 4, got ", bits);
  const at::Tensor &key_codes = keys[0], &key_params = keys[1], &window_k = keys[2];
  const at::Tensor &value_codes = values[0], &value_params = values[1], &window_v = values[2];
  for (const at::Tensor& t : {key_codes, key_params, window_k, value_codes, value_params, window_v, window_slot}) {
    TORCH_CHECK(t.is_contiguous(), what, ": every tensor must be contiguous");
  }
  TORCH_CHECK(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte &&
                  key_codes.sizes() == value_codes.sizes() && key_codes.dim() == 2 &&
                  key_codes.size(1) == width * bits / 8,
              what, ": codes must be uint8 [slots, width * bits / 8]");
  const int64_t num_blocks = key_params.size(0), block = num_blocks > 0 ? key_codes.size(0) / num_blocks : 0;
  TORCH_CHECK(key_params.scalar_type() == at::kHalf && key_params.dim() == 3 && key_params.size(1) == width &&
                  key_params.size(2) == 2 && block > 0 && block * num_blocks == key_codes.size(0),
              what, ": key params must be float16 [blocks, width, 2] over whole blocks of codes");
  TORCH_CHECK(value_params.scalar_type() == at::kHalf && value_params.dim() == 3 &&
                  value_params.size(0) == key_codes.size(0) && value_params.size(2) == 2 &&
                  value_params.size(1) > 0 && width % value_params.size(1) == 0,
              what, ": value params must be float16 [slots, groups, 2]");
  TORCH_CHECK(window_k.scalar_type() == at::kHalf && window_k.sizes() == window_v.sizes() && window_k.dim() == 3 &&
                  window_k.size(1) == block && window_k.size(2) == width,
              what, ": the window must be float16 [window_slots, block, width]");
  TORCH_CHECK(window_slot.scalar_type() == at::kLong && window_slot.numel() == num_blocks,
              what, ": one int64 window slot per block");
  const int64_t* slots = window_slot.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_blocks; ++b) {
    TORCH_CHECK(slots[b] < window_k.size(0), what, ": window slot out of range");
  }
  return width / value_params.size(1);
}

at::Tensor paged_decode_attention_kivi(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                       at::Tensor window_slot, at::Tensor block_tables, at::Tensor context_lens,
                                       int64_t bits, int64_t kv_heads, double scale, int64_t window) {
  const int64_t dim = q.size(2), width = kv_heads * dim;
  const int64_t value_group = check_kivi(keys, values, window_slot, bits, width, "paged_decode_attention_kivi");
  const int64_t num_blocks = keys[1].size(0), block = keys[0].size(0) / num_blocks;
  if (bits == 2) {
    return run(q, block_tables, context_lens, kv_heads, block, num_blocks, scale,
               kivi_rows<2>(keys, values, window_slot, block, dim, width, value_group), true, 0, window);
  }
  return run(q, block_tables, context_lens, kv_heads, block, num_blocks, scale,
             kivi_rows<4>(keys, values, window_slot, block, dim, width, value_group), true, 0, window);
}

std::vector<at::Tensor> paged_read_kivi(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        at::Tensor window_slot, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t bits, int64_t kv_heads, int64_t dim) {
  const int64_t width = kv_heads * dim;
  const int64_t value_group = check_kivi(keys, values, window_slot, bits, width, "paged_read_kivi");
  const int64_t num_blocks = keys[1].size(0), block = keys[0].size(0) / num_blocks;
  if (bits == 2) {
    return read_rows(block_tables, context_lens, kv_heads, dim, block, num_blocks,
                     kivi_rows<2>(keys, values, window_slot, block, dim, width, value_group));
  }
  return read_rows(block_tables, context_lens, kv_heads, dim, block, num_blocks,
                   kivi_rows<4>(keys, values, window_slot, block, dim, width, value_group));
}

}  // namespace kvstrata
