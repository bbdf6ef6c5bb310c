// Float pools [kv_heads, num_blocks, block, dim] in float32, float16 or bfloat16, and the Python bindings of
// every storage's reader (attend.h says what they compute). The float pools' decode attention is also a torch
// operator that stores the step's new K/V first (kv/fused_decode.py): one call per layer, which a compiled
// model step (torch.compile) keeps in its graph.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <atomic>
#include <type_traits>

#include "attend.h"

namespace kvstrata {

// K and V rows of one KV head of one sequence in a pool of T.
template <typename T>
struct PoolRows {
  const T* k;
  const T* v;
  const int64_t* table;
  BlockSlots slots;
  int64_t dim, head_offset;  // head_offset: the head's first row in its pool
  const T* row(const T* pool, int64_t t) const { return pool + (head_offset + slots.of(table, t)) * dim; }
};

// float32 rows are read where they lie; 16-bit ones widened where asked.
template <typename T>
struct FloatRows : PoolRows<T> {
  void widen(const T* at, float* out) const {
    if constexpr (std::is_same_v<T, at::Half>) {
      widen_halves(at, this->dim, out);
    } else {
      for (int64_t d = 0; d < this->dim; ++d) out[d] = static_cast<float>(at[d]);
    }
  }
  void key(int64_t t, float* out) const { widen(this->row(this->k, t), out); }
  void value(int64_t t, float* out) const { widen(this->row(this->v, t), out); }
};

template <>
struct FloatRows<float> : PoolRows<float> {
  static constexpr bool kStableRows = true;
  const float* key(int64_t t) const { return row(k, t); }
  const float* value(int64_t t) const { return row(v, t); }
};

template <typename T>
at::Tensor attend_float(at::Tensor q, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t min_shared_tokens, int64_t window) {
  const int64_t kv_heads = k_pool.size(0), num_blocks = k_pool.size(1), block = k_pool.size(2);
  const int64_t dim = q.size(2);
  TORCH_CHECK(k_pool.size(3) == dim, "paged_decode_attention: head_dim of q and the pools differ");
  const T* k = k_pool.data_ptr<T>();
  const T* v = v_pool.data_ptr<T>();
  // a pool holds each KV head apart, so an item is always one head
  return run(q, block_tables, context_lens, kv_heads, block, num_blocks, scale,
             [&](const int64_t* table, int64_t h, int64_t /* row_heads: 1 */) {
    return FloatRows<T>{{k, v, table, BlockSlots{block}, dim, h * num_blocks * block}};
  }, false, min_shared_tokens, window);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale, int64_t min_shared_tokens, int64_t window) {
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.dim() == 4,
              "paged_decode_attention: K and V pools must be contiguous [kv_heads, blocks, block, dim] of one dtype");
  switch (k_pool.scalar_type()) {
    case at::kFloat:
      return attend_float<float>(q, k_pool, v_pool, block_tables, context_lens, scale, min_shared_tokens, window);
    case at::kHalf:
      return attend_float<at::Half>(q, k_pool, v_pool, block_tables, context_lens, scale, min_shared_tokens, window);
    case at::kBFloat16:
      return attend_float<at::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, scale, min_shared_tokens,
                                        window);
    default: TORCH_CHECK(false, "paged_decode_attention: pools must be float32, float16 or bfloat16");
  }
}

// rows [n, kv_heads, dim] written at slots[i] (block * block_size + offset) of each KV head of `pool` [kv_heads,
// blocks, block, dim]: a plain loop, as a decode step writes one token per sequence (index_copy_ costs microseconds
// of set-up per call)
template <typename T>
void store_rows(const at::Tensor& pool, const at::Tensor& rows, const int64_t* slots, int64_t n) {
  const int64_t kv_heads = pool.size(0), per_head = pool.size(1) * pool.size(2), dim = pool.size(3);
  TORCH_CHECK(rows.dim() == 3 && rows.size(0) == n && rows.size(1) == kv_heads && rows.size(2) == dim,
              "store_and_decode_attention: new rows must be [n, kv_heads, dim] as the pools hold them");
  const at::Tensor values = rows.to(at::kFloat).contiguous();
  const float* from = values.data_ptr<float>();
  T* base = pool.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      T* to = base + (h * per_head + slots[i]) * dim;
      const float* row = from + (i * kv_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) to[d] = static_cast<T>(row[d]);
    }
  }
}

// Writes k_new and v_new [n, kv_heads, dim] at `slots` [n] of layer `layer` of the pools [layers, kv_heads,
// blocks, block, dim], then attends each of the n decoding sequences over its first context_lens tokens (a prefix
// of min_shared_tokens or more that they share read once for all; 0: never), or over its last `window` of them
// (a sliding window; 0: none).
at::Tensor store_and_decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                      at::Tensor& k_pools, at::Tensor& v_pools, int64_t layer, const at::Tensor& slots,
                                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                      int64_t min_shared_tokens, int64_t window) {
  TORCH_CHECK(k_pools.dim() == 5 && layer >= 0 && layer < k_pools.size(0) && k_pools.is_contiguous() &&
                  v_pools.is_contiguous() && k_pools.sizes() == v_pools.sizes() &&
                  k_pools.scalar_type() == v_pools.scalar_type(),
              "store_and_decode_attention: pools must be contiguous [layers, kv_heads, blocks, block, dim] of one "
              "dtype and hold layer ", layer);
  const at::Tensor slot_values = slots.to(at::kLong).contiguous();
  const int64_t* slot = slot_values.data_ptr<int64_t>();
  const int64_t slots_per_head = k_pools.size(2) * k_pools.size(3);
  TORCH_CHECK(slot_values.numel() == q.size(0), "store_and_decode_attention: one slot per query, got ",
              slot_values.numel(), " for ", q.size(0));
  for (int64_t i = 0; i < slot_values.numel(); ++i) {  // before anything is written
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots_per_head, "store_and_decode_attention: slot ", slot[i],
                " is outside the pools' ", slots_per_head, " slots");
  }
  at::Tensor k_pool = k_pools.select(0, layer), v_pool = v_pools.select(0, layer);
  for (auto [pool, rows] : {std::pair{k_pool, k_new}, std::pair{v_pool, v_new}}) {
    switch (pool.scalar_type()) {
      case at::kFloat: store_rows<float>(pool, rows, slot, slot_values.numel()); break;
      case at::kHalf: store_rows<at::Half>(pool, rows, slot, slot_values.numel()); break;
      case at::kBFloat16: store_rows<at::BFloat16>(pool, rows, slot, slot_values.numel()); break;
      default: TORCH_CHECK(false, "store_and_decode_attention: pools must be float32, float16 or bfloat16");
    }
  }
  return paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, min_shared_tokens, window);
}

std::atomic<bool> avx512_allowed{true};

bool avx512_path() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return cpu && avx512_allowed;
}

// Sets whether readers may take their AVX-512 code; returns what it was.
bool allow_avx512(bool allowed) { return avx512_allowed.exchange(allowed); }

std::atomic<int64_t>& shared_prefix_reads() {
  static std::atomic<int64_t> reads{0};
  return reads;
}

}  // namespace kvstrata

TORCH_LIBRARY(kvstrata, m) {
  m.def("store_and_decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_pools, Tensor(b!) v_pools, "
        "int layer, Tensor slots, Tensor block_tables, Tensor context_lens, float scale, int min_shared_tokens=0, "
        "int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstrata, CPU, m) { m.impl("store_and_decode_attention", &kvstrata::store_and_decode_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // min_shared_tokens (0: never) is where a prefix the sequences share is read once for all; window (0: none) the
  // last tokens each row attends (attend.h's run)
  using pybind11::arg;
  m.def("paged_decode_attention", &kvstrata::paged_decode_attention,
        "decode attention read in place from float32, float16 or bfloat16 KV pools", arg("q"), arg("k_pool"),
        arg("v_pool"), arg("block_tables"), arg("context_lens"), arg("scale"), arg("min_shared_tokens") = 0,
        arg("window") = 0);
  // a record format's K and V each in its form (int8, fp8, fp8_e5m2, int4; a group size, int4's only)
  m.def("paged_decode_attention_records", &kvstrata::paged_decode_attention_records,
        "decode attention read in place from per-token KV records (int8, fp8, fp8_e5m2, int4; K and V each in its "
        "own), dequantized one row at a time", arg("q"), arg("k_records"), arg("v_records"), arg("block_tables"),
        arg("context_lens"), arg("block"), arg("kv_heads"), arg("k_form"), arg("k_group"), arg("v_form"),
        arg("v_group"), arg("scale"), arg("min_shared_tokens") = 0, arg("window") = 0);
  m.def("paged_decode_attention_kivi", &kvstrata::paged_decode_attention_kivi,
        "decode attention read in place from KIVI's quantized blocks and its float16 window", arg("q"), arg("keys"),
        arg("values"), arg("window_slot"), arg("block_tables"), arg("context_lens"), arg("bits"), arg("kv_heads"),
        arg("scale"), arg("window") = 0);
  m.def("paged_decode_attention_oaken", &kvstrata::paged_decode_attention_oaken,
        "decode attention read in place from Oaken's dense records and sparse pages", arg("q"), arg("keys"),
        arg("values"), arg("key_shift"), arg("value_shift"), arg("layout"), arg("key_mean"), arg("cos"), arg("sin"),
        arg("block_tables"), arg("context_lens"), arg("block"), arg("kv_heads"), arg("scale"),
        arg("min_shared_tokens") = 0, arg("window") = 0);
  m.def("shared_prefix_reads", [] { return kvstrata::shared_prefix_reads().load(); },
        "prefixes read once for all the decodes sharing them so far (one per group of sequences and call)");
  m.def("allow_avx512", &kvstrata::allow_avx512,
        "whether the readers may take their AVX-512 code where the CPU has it (tests turn it off); returns the last");
  m.def("paged_read_records", &kvstrata::paged_read_records,
        "whole-block K and V decoded from per-token KV records (int8, fp8, fp8_e5m2, int4; K and V each in its own)");
  m.def("paged_read_kivi", &kvstrata::paged_read_kivi, "whole-block K and V decoded from KIVI's blocks and window");
  m.def("paged_read_oaken", &kvstrata::paged_read_oaken,
        "whole-block K and V decoded from Oaken's dense records and sparse pages");
  m.def("record_store", &kvstrata::record_store,
        "a record format's store of one layer's new K and V, each in its form (int8, fp8, fp8_e5m2, int4): encode, "
        "write", arg("k"), arg("v"), arg("slots"), arg("k_records"), arg("v_records"), arg("k_form"), arg("k_group"),
        arg("v_form"), arg("v_group"));
  m.def("sparse_write", &kvstrata::sparse_write, "SparsePages.write for one layer (pages from its free stack)");
  m.def("oaken_store", &kvstrata::oaken_store, "Oaken's store of one layer's new K and V: encode and write both");
  m.def("kivi_window_store", &kvstrata::kivi_window_store, "KIVI's store of one layer's new K and V into its window");
  m.def("infinigen_select", &kvstrata::infinigen_select,
        "InfiniGen's speculated logits against the partial keys in place, and the tokens each KV head fetches");
  m.def("gather_rows", &kvstrata::gather_rows,
        "rows of float KV pools gathered per KV head into the outs given, all pools in one call");
  m.def("fetched_attention", &kvstrata::fetched_attention,
        "decode attention over K/V rows fetched per KV head, a run of rows per sequence");
  m.def("oaken_encode", &kvstrata::oaken_encode, "Oaken's per-token encoder, the bytes of codec.encode_tokens");
}
