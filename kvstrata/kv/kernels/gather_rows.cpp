// Rows of float KV pools gathered per KV head in one call (InfiniGen's fetch from the host pool): for every pool
// [kv_heads, slots, dim] (K and V, any element type) and its out [kv_heads, rows, dim] (the caller's: a buffer kept
// from call to call is not mapped afresh), out[g][i] = pool[g][slots[g][i]]. The rows a decode step
// fetches are scattered over the pool, so each is a few cache lines read from memory; the next rows' lines are
// requested ahead while one is copied, and the heads' rows are spread over torch's threads.
#include <cstring>

#include "attend.h"

namespace kvstrata {

void gather_rows(std::vector<at::Tensor> pools, at::Tensor slots, std::vector<at::Tensor> outs) {
  TORCH_CHECK(!pools.empty() && slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_cpu(),
              "gather_rows: slots must be int64 [kv_heads, rows] on the CPU");
  slots = slots.contiguous();
  const int64_t kv_heads = slots.size(0), rows = slots.size(1);
  const int64_t num_slots = pools[0].size(1);
  for (const auto& pool : pools) {
    TORCH_CHECK(pool.is_cpu() && pool.dim() == 3 && pool.is_contiguous() && pool.size(0) == kv_heads &&
                    pool.sizes() == pools[0].sizes() && pool.scalar_type() == pools[0].scalar_type(),
                "gather_rows: pools must be contiguous CPU [kv_heads, slots, dim] of one shape and dtype");
  }
  TORCH_CHECK(outs.size() == pools.size(), "gather_rows: one out per pool");
  for (size_t p = 0; p < pools.size(); ++p) {
    TORCH_CHECK(outs[p].is_cpu() && outs[p].is_contiguous() && outs[p].scalar_type() == pools[p].scalar_type() &&
                    outs[p].sizes() == at::IntArrayRef({kv_heads, rows, pools[p].size(2)}),
                "gather_rows: each out must be a contiguous CPU [kv_heads, rows, dim] of its pool's dtype");
  }
  const int64_t* index = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < kv_heads * rows; ++i) {  // bad input raises here, not inside the parallel region
    TORCH_CHECK(index[i] >= 0 && index[i] < num_slots, "gather_rows: slot ", index[i], " out of range");
  }
  const int64_t row_bytes = pools[0].size(2) * pools[0].element_size();
  // rows whose lines are requested before they are copied, into L2 (its queue holds more requests than L1's)
  constexpr int64_t kAhead = 24;
  for (size_t p = 0; p < pools.size(); ++p) {
    const char* from = static_cast<const char*>(pools[p].data_ptr());
    char* to = static_cast<char*>(outs[p].data_ptr());
    at::parallel_for(0, kv_heads * rows, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t g = i / rows;
        if (i + kAhead < end) {
          const char* ahead = from + ((i + kAhead) / rows * num_slots + index[i + kAhead]) * row_bytes;
          for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
        }
        std::memcpy(to + i * row_bytes, from + (g * num_slots + index[i]) * row_bytes, row_bytes);
      }
    });
  }
}

}  // namespace kvstrata
