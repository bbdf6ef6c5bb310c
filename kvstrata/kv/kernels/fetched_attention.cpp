// Decode attention over K/V rows fetched into a device buffer per KV head: the query heads of sequence s that share KV
// head g attend over rows starts[g][s] .. starts[g][s] + lengths[g][s] - 1 of that head (attend.h's loop). InfiniGen's
// speculated rows (kv/offload/fetch_plan.py: each head's rows of every sequence one after another) and `full`'s whole
// copied context (sequence s's tokens at s * width) are both read so, in place; a batched product would pad every
// sequence to the longest one's rows, or mask them.
//
// q [n, heads, dim] float32; k, v [kv_heads, rows, dim] float32; starts, lengths [kv_heads, n] int64.
#include "attend.h"

namespace kvstrata {
namespace {

// The rows of one (KV head, sequence): contiguous, read where they lie.
struct SegmentRows {
  static constexpr bool kStableRows = true;
  const float* k;
  const float* v;
  int64_t dim;
  const float* key(int64_t t) const { return k + t * dim; }
  const float* value(int64_t t) const { return v + t * dim; }
};

}  // namespace

at::Tensor fetched_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor starts, at::Tensor lengths,
                             double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == q.size(2),
              "fetched_attention: q must be float32 [n, heads, dim], k and v float32 [kv_heads, rows, dim]");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  starts = starts.to(at::kLong).contiguous();
  lengths = lengths.to(at::kLong).contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), rows = k.size(1);
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu() && starts.is_cpu() && lengths.is_cpu(),
              "fetched_attention: a CPU kernel");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0 && starts.dim() == 2 && starts.size(0) == kv_heads &&
                  starts.size(1) == n && lengths.sizes() == starts.sizes(),
              "fetched_attention: starts and lengths must be [kv_heads, n] and heads a multiple of kv_heads");
  const int64_t* first_row = starts.data_ptr<int64_t>();
  const int64_t* row_count = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < kv_heads * n; ++i) {  // bad input raises here, not inside the parallel region
    TORCH_CHECK(first_row[i] >= 0 && row_count[i] >= 1 && first_row[i] + row_count[i] <= rows,
                "fetched_attention: sequence ", i % n, " of KV head ", i / n, " has ", row_count[i], " rows from row ",
                first_row[i], " of ", rows, " (each needs at least one)");
  }
  const int64_t group = heads / kv_heads;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    SpanScratch scratch;
    std::vector<float> peaks(group), totals(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads;
      const int64_t first = first_row[g * n + s], len = row_count[g * n + s];
      SegmentRows segment_rows{kp + (g * rows + first) * dim, vp + (g * rows + first) * dim, dim};
      attend_head(segment_rows, qp + (s * heads + g * group) * dim, op + (s * heads + g * group) * dim, 0, len,
                  group, 1, dim, static_cast<float>(scale), scratch, peaks, totals);
    }
  });
  return out;
}

}  // namespace kvstrata
