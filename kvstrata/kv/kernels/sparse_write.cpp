// SparsePages.write (kv/sparse_pages.py) for one layer, without the dozens of small torch operations a decode step
// would otherwise pay per layer: each token's bytes are appended to its block's pages, its (offset, count) entry
// set and each block's fill advanced. Blocks take the pages they need from the layer's free-page stack; where the
// stack holds too few, nothing is written and the shortfall comes back, for the caller to grow the pool and call
// again.
#include "sparse_write.h"

#include <algorithm>

#include "attend.h"

namespace kvstrata {

SparseLayer::SparseLayer(const std::vector<at::Tensor>& t, int64_t block_size, int64_t page_bytes)
    : block_size(block_size), page_bytes(page_bytes) {
  TORCH_CHECK(t.size() == 7, "sparse_write: a layer is 7 tensors");
  for (const at::Tensor& x : t) {
    TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "sparse_write: tensors must be contiguous, on the CPU");
  }
  TORCH_CHECK(t[0].scalar_type() == at::kByte && t[1].scalar_type() == at::kLong && t[1].dim() == 2 &&
                  t[2].scalar_type() == at::kLong && t[3].scalar_type() == at::kInt && t[4].scalar_type() == at::kShort &&
                  t[5].scalar_type() == at::kLong && t[6].scalar_type() == at::kLong && t[6].numel() == 1 &&
                  block_size > 0 && page_bytes > 0,
              "sparse_write: unexpected dtypes or shapes");
  data = t[0].data_ptr<uint8_t>();
  block_pages = t[1].data_ptr<int64_t>();
  block_fill = t[2].data_ptr<int64_t>();
  token_offset = t[3].data_ptr<int32_t>();
  token_count = t[4].data_ptr<int16_t>();
  free_stack = t[5].data_ptr<int64_t>();
  free_count = t[6].data_ptr<int64_t>();
  num_blocks = t[1].size(0);
  max_pages = t[1].size(1);
}

SparseWrite::SparseWrite(SparseLayer& layer, const int64_t* slots, const int64_t* counts, int64_t n)
    : layer_(layer), slots_(slots), counts_(counts), n_(n), offsets_(n) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = slots[i] / layer.block_size;
    TORCH_CHECK(slots[i] >= 0 && b < layer.num_blocks && counts[i] >= 0, "sparse_write: slot or count out of range");
    auto it = std::find_if(blocks_.rbegin(), blocks_.rend(), [&](const BlockFill& f) { return f.block == b; });
    BlockFill& fill = it != blocks_.rend() ? *it : blocks_.emplace_back(BlockFill{b, layer.block_fill[b], 0});
    offsets_[i] = fill.filled;
    fill.filled += counts[i];
    total_ += counts[i];
  }
  for (BlockFill& fill : blocks_) {
    const int64_t needed = (fill.filled + layer.page_bytes - 1) / layer.page_bytes;
    TORCH_CHECK(needed <= layer.max_pages, "sparse_write: block ", fill.block, " would need ", needed,
                " pages, more than ", layer.max_pages);
    const int64_t* pages = layer.block_pages + fill.block * layer.max_pages;
    while (fill.owned < layer.max_pages && pages[fill.owned] >= 0) ++fill.owned;
    new_pages_ += std::max<int64_t>(needed - fill.owned, 0);
  }
}

int64_t SparseWrite::pages_short() const { return std::max<int64_t>(new_pages_ - *layer_.free_count, 0); }

void SparseWrite::apply(const uint8_t* bytes) {
  TORCH_CHECK(pages_short() == 0, "sparse_write: too few free pages");
  SparseLayer& l = layer_;
  for (const BlockFill& fill : blocks_) {
    int64_t* pages = l.block_pages + fill.block * l.max_pages;
    for (int64_t j = fill.owned; j < (fill.filled + l.page_bytes - 1) / l.page_bytes; ++j) {
      pages[j] = l.free_stack[--*l.free_count];
    }
  }
  for (int64_t i = 0; i < n_; ++i) {
    const int64_t* owned = l.block_pages + (slots_[i] / l.block_size) * l.max_pages;
    for (int64_t j = 0; j < counts_[i]; ++j, ++bytes) {
      const int64_t at = offsets_[i] + j;
      l.data[owned[at / l.page_bytes] * l.page_bytes + at % l.page_bytes] = *bytes;
    }
    l.token_offset[slots_[i]] = static_cast<int32_t>(offsets_[i]);
    l.token_count[slots_[i]] = static_cast<int16_t>(counts_[i]);
  }
  for (const BlockFill& fill : blocks_) l.block_fill[fill.block] = fill.filled;
}

int64_t sparse_write(std::vector<at::Tensor> layer_tensors, at::Tensor slots, at::Tensor bytes, at::Tensor counts,
                     int64_t block_size, int64_t page_bytes) {
  SparseLayer layer(layer_tensors, block_size, page_bytes);
  TORCH_CHECK(slots.is_contiguous() && bytes.is_contiguous() && counts.is_contiguous() &&
                  slots.scalar_type() == at::kLong && counts.scalar_type() == at::kLong &&
                  bytes.scalar_type() == at::kByte && slots.numel() == counts.numel(),
              "sparse_write: slots and counts must be int64 of one length, bytes uint8, all contiguous");
  SparseWrite write(layer, slots.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), slots.numel());
  TORCH_CHECK(write.total_bytes() == bytes.numel(), "sparse_write: the counts add up to ", write.total_bytes(),
              " bytes, not ", bytes.numel());
  const int64_t short_by = write.pages_short();
  if (short_by == 0) write.apply(bytes.data_ptr<uint8_t>());
  return short_by;
}

}  // namespace kvstrata
