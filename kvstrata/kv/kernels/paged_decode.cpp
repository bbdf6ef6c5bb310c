// Decode attention read in place from the paged KV pools: one query token per sequence attends over the
// first context_lens[s] tokens of sequence s, found block by block through its block table. No copy of
// the context is made (the torch path gathers every block of every sequence first).
//
// q [n, heads, dim]; k_pool, v_pool [kv_heads, num_blocks, block_size, dim] (contiguous, float32);
// block_tables [n, width] int64; context_lens [n] int64. Query head h reads KV head h / (heads / kv_heads).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_pool.scalar_type() == torch::kFloat32 &&
                  v_pool.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "paged_decode_attention: K and V pools must be contiguous and of one shape");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(0), num_blocks = k_pool.size(1), block = k_pool.size(2);
  const int64_t width = block_tables.size(1), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && k_pool.size(3) == dim, "paged_decode_attention: head shapes do not match");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s) {  // bad input must raise here, not inside the parallel region
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block, "paged_decode_attention: context length out of range");
    for (int64_t b = 0; b < (lens[s] + block - 1) / block; ++b) {
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks,
                  "paged_decode_attention: block id out of range");
    }
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> totals(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads, len = lens[s];
      const float* queries = qp + (s * heads + h * group) * dim;
      scores.assign(group * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* __restrict key = kp + ((h * num_blocks + tables[s * width + t / block]) * block + t % block) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* __restrict query = queries + g * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[d];
          scores[g * len + t] = dot * fscale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        const float peak = *std::max_element(row, row + len);
        float total = 0.0f;
        for (int64_t t = 0; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));
        totals[g] = total;
      }
      float* outputs = op + (s * heads + h * group) * dim;
      std::fill(outputs, outputs + group * dim, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* __restrict value = vp + ((h * num_blocks + tables[s * width + t / block]) * block + t % block) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float weight = scores[g * len + t] / totals[g];
          float* __restrict o = outputs + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] += weight * value[d];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention read in place from paged KV pools");
}
