// Decode attention read in place from the paged KV cache: one query token per sequence attends over the
// first context_lens[s] tokens of sequence s, found block by block through its block table. No copy of
// the context is made (the torch path gathers, and for quantized storage decodes, every block first).
//
// q [n, heads, dim] float32; block_tables [n, width] int64; context_lens [n] int64. Query head h reads KV
// head h / (heads / kv_heads). Two storages: float32 pools [kv_heads, num_blocks, block_size, dim], and
// int8 records [slots, kv_heads * dim + 2] (codes, then the token's float16 scale: value = code * scale,
// exactly as kv/formats/integer.py decodes them).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <vector>

// K and V rows of one KV head of one sequence, as float32 pointers.
struct FloatRows {
  const float* k;
  const float* v;
  const int64_t* table;
  int64_t block, dim, head_offset;  // head_offset: the head's first row in its pool
  const float* key(int64_t t) { return k + (head_offset + table[t / block] * block + t % block) * dim; }
  const float* value(int64_t t) { return v + (head_offset + table[t / block] * block + t % block) * dim; }
};

// The same rows decoded from int8 records into a small buffer (one row at a time: nothing else is copied).
struct Int8Rows {
  const uint8_t* k;
  const uint8_t* v;
  const int64_t* table;
  int64_t block, dim, record_bytes, width, head_offset;  // head_offset: the head's first code in a record
  std::vector<float> buffer;
  const float* decode(const uint8_t* records, int64_t t) {
    const uint8_t* record = records + (table[t / block] * block + t % block) * record_bytes;
    uint16_t bits;
    std::memcpy(&bits, record + width, sizeof(bits));
    const float scale = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    const int8_t* codes = reinterpret_cast<const int8_t*>(record) + head_offset;
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(codes[d]) * scale;
    return buffer.data();
  }
  const float* key(int64_t t) { return decode(k, t); }
  const float* value(int64_t t) { return decode(v, t); }
};

// One KV head of one sequence: its `group` query heads attend over its first `len` tokens.
template <typename Rows>
void attend_head(Rows& rows, const float* queries, float* outputs, int64_t len, int64_t group, int64_t dim,
                 float scale, std::vector<float>& scores, std::vector<float>& totals) {
  scores.assign(group * len, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float* __restrict key = rows.key(t);
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict query = queries + g * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[d];
      scores[g * len + t] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * len;
    const float peak = *std::max_element(row, row + len);
    float total = 0.0f;
    for (int64_t t = 0; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));
    totals[g] = total;
  }
  std::fill(outputs, outputs + group * dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float* __restrict value = rows.value(t);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * len + t] / totals[g];
      float* __restrict o = outputs + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += weight * value[d];
    }
  }
}

// Checks shared by both storages; bad input must raise here, not inside the parallel region.
void check_inputs(const torch::Tensor& q, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                  int64_t kv_heads, int64_t block, int64_t num_blocks) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3, "paged_decode_attention: q must be float32 [n, heads, dim]");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode_attention: one block table and one context length per query");
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block, "paged_decode_attention: context length out of range");
    for (int64_t b = 0; b < (lens[s] + block - 1) / block; ++b) {
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks,
                  "paged_decode_attention: block id out of range");
    }
  }
}

// Shared by both storages: checks the inputs, then one work item per (sequence, KV head) over torch's threads.
template <typename MakeRows>
torch::Tensor run(torch::Tensor q, torch::Tensor block_tables, torch::Tensor context_lens, int64_t kv_heads,
                  int64_t block, int64_t num_blocks, double scale, MakeRows make_rows) {
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  check_inputs(q, block_tables, context_lens, kv_heads, block, num_blocks);
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), group = heads / kv_heads;
  const int64_t width = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, totals(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      auto rows = make_rows(tables + s * width, h);
      attend_head(rows, qp + (s * heads + h * group) * dim, op + (s * heads + h * group) * dim, lens[s], group,
                  dim, static_cast<float>(scale), scores, totals);
    }
  });
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(k_pool.scalar_type() == torch::kFloat32 && v_pool.scalar_type() == torch::kFloat32 &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.dim() == 4,
              "paged_decode_attention: K and V pools must be contiguous float32 [kv_heads, blocks, block, dim]");
  const int64_t kv_heads = k_pool.size(0), num_blocks = k_pool.size(1), block = k_pool.size(2);
  const int64_t dim = q.size(2);
  TORCH_CHECK(k_pool.size(3) == dim, "paged_decode_attention: head_dim of q and the pools differ");
  const float* k = k_pool.data_ptr<float>();
  const float* v = v_pool.data_ptr<float>();
  return run(q, block_tables, context_lens, kv_heads, block, num_blocks, scale, [&](const int64_t* table, int64_t h) {
    return FloatRows{k, v, table, block, dim, h * num_blocks * block};
  });
}

torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_records, torch::Tensor v_records,
                                          torch::Tensor block_tables, torch::Tensor context_lens, int64_t block,
                                          int64_t kv_heads, double scale) {
  TORCH_CHECK(k_records.scalar_type() == torch::kUInt8 && v_records.scalar_type() == torch::kUInt8 &&
                  k_records.is_contiguous() && v_records.is_contiguous() && k_records.sizes() == v_records.sizes() &&
                  k_records.dim() == 2,
              "paged_decode_attention_int8: K and V records must be contiguous uint8 [slots, record_bytes]");
  const int64_t dim = q.size(2), width = kv_heads * dim, record_bytes = k_records.size(1);
  TORCH_CHECK(record_bytes == width + 2, "paged_decode_attention_int8: records must hold kv_heads * dim codes and a scale");
  TORCH_CHECK(block > 0 && k_records.size(0) % block == 0, "paged_decode_attention_int8: slots must fill whole blocks");
  const uint8_t* k = k_records.data_ptr<uint8_t>();
  const uint8_t* v = v_records.data_ptr<uint8_t>();
  return run(q, block_tables, context_lens, kv_heads, block, k_records.size(0) / block, scale,
             [&](const int64_t* table, int64_t h) {
    return Int8Rows{k, v, table, block, dim, record_bytes, width, h * dim, std::vector<float>(dim)};
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention read in place from float32 KV pools");
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8,
        "decode attention read in place from int8 KV records, dequantized one row at a time");
}
