// One layer of SparsePages (kv/sparse_pages.py) as the compiled writers see it, and a write planned before anything
// changes, so that a writer can find out first whether the free pages suffice (sparse_write.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvstrata {

struct SparseLayer {
  // [data, block -> pages, block fill, token offsets, token counts, free-page stack, free-page count]: one layer's
  // views, as SparsePages.writer_tensors gives them.
  SparseLayer(const std::vector<at::Tensor>& tensors, int64_t block_size, int64_t page_bytes);

  uint8_t* data;
  int64_t* block_pages;
  int64_t* block_fill;
  int32_t* token_offset;
  int16_t* token_count;
  int64_t* free_stack;
  int64_t* free_count;
  int64_t num_blocks, max_pages, block_size, page_bytes;
};

// Appending n tokens' bytes (counts[i] for the token at slots[i]) to their blocks' pages: each token's offset within
// its block and the pages its blocks still need, worked out before anything is written.
class SparseWrite {
 public:
  SparseWrite(SparseLayer& layer, const int64_t* slots, const int64_t* counts, int64_t n);
  int64_t total_bytes() const { return total_; }
  // How many pages more than the free stack holds the write needs; 0: `apply` may go.
  int64_t pages_short() const;
  // Takes the pages blocks need from the free stack, writes each token's bytes (taken in order from `bytes`) and
  // its (offset, count), and advances the blocks' fill.
  void apply(const uint8_t* bytes);

 private:
  struct BlockFill {
    int64_t block, filled, owned;
  };
  SparseLayer& layer_;
  const int64_t* slots_;
  const int64_t* counts_;
  int64_t n_, total_ = 0, new_pages_ = 0;
  std::vector<int64_t> offsets_;
  std::vector<BlockFill> blocks_;  // in order of first appearance, as the torch writer hands pages out
};

}  // namespace kvstrata
