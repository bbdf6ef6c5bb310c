// SparsePages.write (kv/sparse_pages.py) for one layer, without the dozens of small torch operations a decode step
// would otherwise pay per layer: each token's bytes are appended to its block's pages, its (offset, count) entry
// set and each block's fill advanced. Pages are handed out in Python (the free lists live there): where a block
// needs more pages than it owns, nothing is written and the (block, pages needed) pairs come back, for the caller
// to allocate and call again.
#include "attend.h"

#include <unordered_map>

namespace kvstrata {

at::Tensor sparse_write(at::Tensor data, at::Tensor block_pages, at::Tensor block_fill, at::Tensor token_offset,
                        at::Tensor token_count, at::Tensor slots, at::Tensor bytes, at::Tensor counts,
                        int64_t block_size, int64_t page_bytes) {
  for (const at::Tensor& t : {data, block_pages, block_fill, token_offset, token_count, slots, bytes, counts}) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "sparse_write: tensors must be contiguous, on the CPU");
  }
  TORCH_CHECK(data.scalar_type() == at::kByte && bytes.scalar_type() == at::kByte &&
                  block_pages.scalar_type() == at::kLong && block_pages.dim() == 2 &&
                  block_fill.scalar_type() == at::kLong && token_offset.scalar_type() == at::kInt &&
                  token_count.scalar_type() == at::kShort && slots.scalar_type() == at::kLong &&
                  counts.scalar_type() == at::kLong && slots.numel() == counts.numel() && page_bytes > 0,
              "sparse_write: unexpected dtypes or shapes");
  const int64_t n = slots.numel(), num_blocks = block_pages.size(0), max_pages = block_pages.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t* pages = block_pages.data_ptr<int64_t>();
  int64_t* fill = block_fill.data_ptr<int64_t>();
  int64_t total = 0;
  std::unordered_map<int64_t, int64_t> end;  // each written block's fill after the call
  std::vector<int64_t> offsets(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = slot[i] / block_size;
    TORCH_CHECK(slot[i] >= 0 && b < num_blocks && count[i] >= 0, "sparse_write: slot or count out of range");
    auto it = end.try_emplace(b, fill[b]).first;
    offsets[i] = it->second;
    it->second += count[i];
    total += count[i];
  }
  TORCH_CHECK(total == bytes.numel(), "sparse_write: the counts add up to ", total, " bytes, not ", bytes.numel());
  std::vector<int64_t> short_blocks;
  for (const auto& [b, filled] : end) {
    const int64_t needed = (filled + page_bytes - 1) / page_bytes;
    TORCH_CHECK(needed <= max_pages, "sparse_write: block ", b, " would need ", needed, " pages, more than ", max_pages);
    int64_t owned = 0;
    while (owned < max_pages && pages[b * max_pages + owned] >= 0) ++owned;
    if (needed > owned) short_blocks.insert(short_blocks.end(), {b, needed});
  }
  if (!short_blocks.empty()) {
    return at::tensor(short_blocks, at::kLong).view({-1, 2});
  }
  const uint8_t* in = bytes.data_ptr<uint8_t>();
  uint8_t* out = data.data_ptr<uint8_t>();
  int32_t* offset_of = token_offset.data_ptr<int32_t>();
  int16_t* count_of = token_count.data_ptr<int16_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* owned = pages + (slot[i] / block_size) * max_pages;
    for (int64_t j = 0; j < count[i]; ++j, ++in) {
      const int64_t at = offsets[i] + j;
      out[owned[at / page_bytes] * page_bytes + at % page_bytes] = *in;
    }
    offset_of[slot[i]] = static_cast<int32_t>(offsets[i]);
    count_of[slot[i]] = static_cast<int16_t>(count[i]);
  }
  for (const auto& [b, filled] : end) fill[b] = filled;
  return at::empty({0, 2}, at::kLong);
}

}  // namespace kvstrata
