// Decode attention over rows fetched per KV head (InfiniGen's speculated tokens, kv/offload/fetch_plan.py): each KV
// head holds its rows of every sequence one after another, sequence s's being offsets[g][s] .. offsets[g][s + 1] - 1,
// and the query heads of sequence s that share KV head g attend over exactly those rows (attend.h's loop). Padding
// for a batched product (every sequence given the longest's width) is what this avoids.
//
// q [n, heads, dim] float32; k, v [kv_heads, rows, dim] float32; offsets [kv_heads, n + 1] int64.
#include <torch/extension.h>

#include "attend.h"

namespace kvstrata {
namespace {

// The rows of one (KV head, sequence): contiguous, read where they lie.
struct SegmentRows {
  const float* k;
  const float* v;
  int64_t dim;
  const float* key(int64_t t) const { return k + t * dim; }
  const float* value(int64_t t) const { return v + t * dim; }
};

}  // namespace

at::Tensor fetched_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor offsets, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == q.size(2),
              "fetched_attention: q must be float32 [n, heads, dim], k and v float32 [kv_heads, rows, dim]");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  offsets = offsets.to(at::kLong).contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), rows = k.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && offsets.dim() == 2 && offsets.size(0) == kv_heads && offsets.size(1) == n + 1,
              "fetched_attention: offsets must be [kv_heads, n + 1] and heads a multiple of kv_heads");
  const int64_t* segment = offsets.data_ptr<int64_t>();
  for (int64_t g = 0; g < kv_heads; ++g) {  // bad input raises here, not inside the parallel region
    for (int64_t s = 0; s < n; ++s) {
      const int64_t first = segment[g * (n + 1) + s], end = segment[g * (n + 1) + s + 1];
      TORCH_CHECK(first >= 0 && first < end && end <= rows, "fetched_attention: sequence ", s, " of KV head ", g,
                  " has rows ", first, " to ", end, " of ", rows, " (each needs at least one)");
    }
  }
  const int64_t group = heads / kv_heads;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, totals(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads;
      const int64_t first = segment[g * (n + 1) + s], len = segment[g * (n + 1) + s + 1] - first;
      SegmentRows segment_rows{kp + (g * rows + first) * dim, vp + (g * rows + first) * dim, dim};
      attend_head(segment_rows, qp + (s * heads + g * group) * dim, op + (s * heads + g * group) * dim, len, group,
                  1, dim, static_cast<float>(scale), scores, totals);
    }
  });
  return out;
}

}  // namespace kvstrata
