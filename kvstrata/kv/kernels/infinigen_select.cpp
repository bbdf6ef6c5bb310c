// InfiniGen's speculation for one layer's decodes in one call: the speculated logits of every query head against
// the partial keys of its sequence's cached tokens, read where they lie through the block tables, and the
// tokens each KV head fetches. The rule is kv/offload/speculation.py's (select_tokens, the torch path, which the
// tests hold this to): per query head the tokens within alpha of its top logit are counted; every head of a
// sequence takes the floored mean of those counts, capped at max_fraction of the sequence's cached tokens (at
// least one); each query head's top tokens by that count, the newest `recent` tokens, per KV head the union.
// Where logits tie exactly at a head's cut, the earliest tokens are taken (torch's topk leaves that order open); a
// NaN logit (a corrupt cache) counts as -inf, never preferred (torch ranks NaN first).
//
// q_partial [n, kv_heads, group, r] float32: the skewed partial queries, already scaled by head_dim^-0.5;
// partial_keys [kv_heads, blocks, r, block] float16: the layer's partial keys, channels outermost within a block
// (kv/offload/partial_keys.py); block_tables [n, width]; q_positions [n]: the step's token of sequence s sits at
// q_positions[s], and the tokens before it are the cached ones; dead [slots] bool (or empty): tokens a capped host
// pool gave up, never chosen.
// Returns each KV head's rows to fetch, sequence after sequence (kv/offload/fetch_plan.py): positions and slots
// [kv_heads, R] (a sequence's chosen tokens ascending, then its own token; after the head's last row, position -1
// and the first sequence's own slot), offsets
// [kv_heads, n + 1] (sequence s: rows offsets[g][s] .. offsets[g][s + 1] - 1) and per_query_head [n].
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "attend.h"

namespace kvstrata {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
constexpr int64_t kHeadsTogether = 4;  // query heads scored in one pass over a block's partial keys
constexpr int64_t kFewCandidates = 64;  // the top-k search narrows its bracket until about this many logits lie in it
constexpr int kMostCuts = 48;  // ... or it has cut this often (logits tied in masses cut slowly)

// Logits of `Heads` query heads (queries [Heads, r]) against the first `count` tokens of a block whose partial keys
// are float16 [r, block], into rows `stride` apart. Eight tokens at a time keep one accumulator per head in a
// register over all r channels; the reads of a channel stay within its `block` values.
template <int Heads>
void score_block(const float* queries, int64_t r, const at::Half* keys, int64_t block, int64_t count, float* out,
                 int64_t stride) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    __m256 acc[Heads];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < r; ++d) {
      const __m256 channel = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + d * block + j)));
      for (int h = 0; h < Heads; ++h) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(queries[h * r + d]), channel, acc[h]);
    }
    for (int h = 0; h < Heads; ++h) _mm256_storeu_ps(out + h * stride + j, acc[h]);
  }
  for (; j < count; ++j) {
    for (int h = 0; h < Heads; ++h) {
      float sum = 0.0f;
      for (int64_t d = 0; d < r; ++d) sum += queries[h * r + d] * static_cast<float>(keys[d * block + j]);
      out[h * stride + j] = sum;
    }
  }
}

// score_block for 1 to kHeadsTogether heads.
void score_block(int64_t heads, const float* queries, int64_t r, const at::Half* keys, int64_t block, int64_t count,
                 float* out, int64_t stride) {
  switch (heads) {
    case 1: return score_block<1>(queries, r, keys, block, count, out, stride);
    case 2: return score_block<2>(queries, r, keys, block, count, out, stride);
    case 3: return score_block<3>(queries, r, keys, block, count, out, stride);
    default: return score_block<kHeadsTogether>(queries, r, keys, block, count, out, stride);
  }
}

// What scoring (step 2 below) learns of one query head's row of logits.
struct RowSummary {
  float top = kNegativeInfinity;  // the largest logit
  float least = std::numeric_limits<float>::infinity();  // the least one above -inf (+inf where there is none)
  int64_t finite = 0;  // logits above -inf (the dead and NaN ones are -inf)
};

// NaN logits (a corrupt cache) become -inf, so that they are never preferred and every comparison stays ordered.
RowSummary clean_and_summarize(float* row, int64_t len) {
  const __m256 low = _mm256_set1_ps(kNegativeInfinity), high = _mm256_set1_ps(-kNegativeInfinity);
  __m256 top = low, least = high;
  int64_t finite = 0, t = 0;
  for (; t + 8 <= len; t += 8) {
    __m256 x = _mm256_loadu_ps(row + t);
    x = _mm256_blendv_ps(x, low, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    _mm256_storeu_ps(row + t, x);
    const __m256 is_finite = _mm256_cmp_ps(x, low, _CMP_GT_OQ);
    finite += __builtin_popcount(_mm256_movemask_ps(is_finite));
    top = _mm256_max_ps(top, x);
    least = _mm256_min_ps(least, _mm256_blendv_ps(high, x, is_finite));
  }
  float tops[8], leasts[8];
  _mm256_storeu_ps(tops, top);
  _mm256_storeu_ps(leasts, least);
  RowSummary summary{*std::max_element(tops, tops + 8), *std::min_element(leasts, leasts + 8), finite};
  for (; t < len; ++t) {
    if (std::isnan(row[t])) row[t] = kNegativeInfinity;
    summary.top = std::max(summary.top, row[t]);
    if (row[t] != kNegativeInfinity) summary.least = std::min(summary.least, row[t]), ++summary.finite;
  }
  return summary;
}

struct Counts {
  int64_t at_least = 0;  // logits >= x
  int64_t above = 0;     // logits > x
};

Counts count_at(const float* row, int64_t len, float x) {
  const __m256 limit = _mm256_set1_ps(x);
  Counts counts;
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 v = _mm256_loadu_ps(row + t);
    counts.at_least += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, limit, _CMP_GE_OQ)));
    counts.above += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, limit, _CMP_GT_OQ)));
  }
  for (; t < len; ++t) counts.at_least += row[t] >= x, counts.above += row[t] > x;
  return counts;
}

// The k-th largest logit of a row (k >= 1; -inf where fewer than k are finite). The answer lies in [low, high],
// with at least k logits >= low and fewer than k > high; the bracket is narrowed by value until few logits lie in
// it, and only those are searched (nth_element over every token costs several times more). Counting the row
// against a value is one vector pass; each cut goes where the counts, taken as linear in the value across the
// bracket, reach k (kept off the ends, so a cut removes a tenth of the bracket at least). `threshold` (the alpha
// cut) with `above_threshold` logits above it, known already, narrows the first bracket.
float kth_largest(const float* row, int64_t len, int64_t k, const RowSummary& summary, float threshold,
                  int64_t above_threshold, std::vector<float>& work) {
  if (summary.finite < k) return kNegativeInfinity;
  float low = summary.least, high = summary.top;
  int64_t at_least_low = summary.finite, above_high = 0;
  if (threshold > low && threshold < high) {
    if (above_threshold >= k) {
      low = threshold, at_least_low = above_threshold;  // a lower bound of those >= it: enough to stop on
    } else {
      high = threshold, above_high = above_threshold;
    }
  }
  for (int cut = 0; cut < kMostCuts && at_least_low - above_high > kFewCandidates; ++cut) {
    const float share = static_cast<float>(at_least_low - k) / static_cast<float>(at_least_low - above_high);
    const float middle = low + (high - low) * std::clamp(share, 0.1f, 0.9f);
    if (!(middle > low && middle < high)) break;  // the bracket is as narrow as floats go
    const Counts counts = count_at(row, len, middle);
    if (counts.at_least >= k) {
      low = middle, at_least_low = counts.at_least;
    } else {
      high = middle, above_high = counts.above;
    }
  }
  work.clear();
  const __m256 lows = _mm256_set1_ps(low), highs = _mm256_set1_ps(high);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 v = _mm256_loadu_ps(row + t);
    for (int inside = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, lows, _CMP_GE_OQ),
                                                     _mm256_cmp_ps(v, highs, _CMP_LE_OQ)));
         inside; inside &= inside - 1) {
      work.push_back(row[t + __builtin_ctz(inside)]);
    }
  }
  for (; t < len; ++t) {
    if (row[t] >= low && row[t] <= high) work.push_back(row[t]);
  }
  const int64_t rank = k - above_high - 1;  // within the bracket, counted from its largest
  std::nth_element(work.begin(), work.begin() + rank, work.end(), std::greater<float>());
  return work[rank];
}

// Sets the bits (token t: bit t % 8 of byte t / 8) of the `k` tokens of `row` with the highest logits, ties broken
// towards earlier tokens, gone ones (a capped pool's; `gone` may be null) never.
void mark_top(const float* row, int64_t len, int64_t k, const RowSummary& summary, float threshold,
              int64_t above_threshold, const uint8_t* gone, uint8_t* chosen, std::vector<float>& work) {
  const float kth = kth_largest(row, len, k, summary, threshold, above_threshold, work);
  const __m256 limit = _mm256_set1_ps(kth);
  int64_t taken = 0, t = 0;
  for (; t + 8 <= len; t += 8) {
    const int above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + t), limit, _CMP_GT_OQ));
    chosen[t / 8] |= above;
    taken += __builtin_popcount(above);
  }
  for (; t < len; ++t) {
    if (row[t] > kth) chosen[t / 8] |= 1 << t % 8, ++taken;
  }
  for (t = 0; t < len && taken < k; ++t) {
    if (row[t] == kth && !(gone && gone[t])) chosen[t / 8] |= 1 << t % 8, ++taken;
  }
}

}  // namespace

std::vector<at::Tensor> infinigen_select(at::Tensor q_partial, at::Tensor partial_keys, at::Tensor block_tables,
                                         at::Tensor q_positions, at::Tensor dead, int64_t block, double alpha,
                                         double max_fraction, int64_t recent) {
  TORCH_CHECK(q_partial.scalar_type() == at::kFloat && q_partial.dim() == 4 &&
                  partial_keys.scalar_type() == at::kHalf && partial_keys.dim() == 4 &&
                  partial_keys.size(0) == q_partial.size(1) && partial_keys.size(2) == q_partial.size(3) &&
                  partial_keys.size(3) == block,
              "infinigen_select: q_partial must be float32 [n, kv_heads, group, r], partial_keys float16 [kv_heads, "
              "blocks, r, block]");
  q_partial = q_partial.contiguous();
  partial_keys = partial_keys.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  q_positions = q_positions.to(at::kLong).contiguous();
  const int64_t n = q_partial.size(0), kv_heads = q_partial.size(1), group = q_partial.size(2), r = q_partial.size(3);
  const int64_t num_blocks = partial_keys.size(1), num_slots = num_blocks * block, width = block_tables.size(1);
  TORCH_CHECK(n >= 1 && kv_heads >= 1 && group >= 1 && block_tables.dim() == 2 && block_tables.size(0) == n &&
                  q_positions.size(0) == n,
              "infinigen_select: one block table and one query position per sequence, at least one query head");
  TORCH_CHECK(q_partial.is_cpu() && partial_keys.is_cpu() && block_tables.is_cpu() && q_positions.is_cpu(),
              "infinigen_select: a CPU kernel");
  const bool* dead_at = nullptr;
  if (dead.defined() && dead.numel() > 0) {
    TORCH_CHECK(dead.scalar_type() == at::kBool && dead.numel() == num_slots,
                "infinigen_select: dead must be bool [slots]");
    dead = dead.contiguous();
    dead_at = dead.data_ptr<bool>();
  }
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = q_positions.data_ptr<int64_t>();  // cached tokens of sequence s: those before its own
  int64_t longest = 0;
  for (int64_t s = 0; s < n; ++s) {  // bad input raises here, not inside the parallel regions
    TORCH_CHECK(lens[s] >= 0 && lens[s] < width * block, "infinigen_select: query position ", lens[s],
                " out of range");
    for (int64_t b = 0; b <= lens[s] / block; ++b) {
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks,
                  "infinigen_select: block id out of range");
    }
    longest = std::max(longest, lens[s]);
  }
  const float* qp = q_partial.data_ptr<float>();
  const at::Half* keys = partial_keys.data_ptr<at::Half>();
  const int64_t heads = kv_heads * group;
  const float within = static_cast<float>(alpha);  // float32 arithmetic, as the torch path's

  // 1. How many of each sequence's cached tokens are there to fetch, and (under a cap) which are gone.
  std::vector<int64_t> cached(lens, lens + n);
  std::vector<uint8_t> gone_tokens(dead_at ? n * longest : 0);
  if (dead_at) {
    for (int64_t s = 0; s < n; ++s) {
      uint8_t* gone = gone_tokens.data() + s * longest;
      for (int64_t t = 0; t < lens[s]; ++t) gone[t] = dead_at[slot_of(tables + s * width, block, t)];
      cached[s] -= std::count(gone, gone + lens[s], 1);
    }
  }

  // 2. Every query head's logits, its top one and its count within alpha of the top.
  // every value is written before it is read: no zero fill (tens of MB per step at batch 8 x 4,096 tokens)
  std::unique_ptr<float[]> logits(new float[n * heads * longest]);
  std::vector<RowSummary> summaries(n * heads);
  std::vector<int64_t> counts(n * heads);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads, len = lens[s];
      const uint8_t* gone = dead_at ? gone_tokens.data() + s * longest : nullptr;
      float* rows = logits.get() + (s * heads + g * group) * longest;
      for (int64_t h0 = 0; h0 < group; h0 += kHeadsTogether) {
        const int64_t together = std::min(kHeadsTogether, group - h0);
        const float* queries = qp + ((s * kv_heads + g) * group + h0) * r;
        for (int64_t first = 0; first < len; first += block) {
          const at::Half* block_keys = keys + (g * num_blocks + tables[s * width + first / block]) * r * block;
          score_block(together, queries, r, block_keys, block, std::min(block, len - first),
                      rows + h0 * longest + first, longest);
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* row = rows + h * longest;
        if (gone) {
          for (int64_t t = 0; t < len; ++t) {
            if (gone[t]) row[t] = kNegativeInfinity;
          }
        }
        const RowSummary summary = clean_and_summarize(row, len);
        summaries[s * heads + g * group + h] = summary;
        counts[s * heads + g * group + h] = count_at(row, len, summary.top - within).above;
      }
    }
  });

  // 3. One count per sequence, computed in float32 as the torch path does.
  auto per_query_head = at::empty({n}, at::kLong);
  int64_t* per_head = per_query_head.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s) {
    float total = 0.0f;
    for (int64_t h = 0; h < heads; ++h) total += static_cast<float>(counts[s * heads + h]);
    const float allowed = static_cast<float>(max_fraction) * static_cast<float>(cached[s]);
    const int64_t cap = std::max<int64_t>(std::floor(allowed), 1);
    const int64_t mean = std::floor(total / static_cast<float>(heads));
    per_head[s] = std::min(std::max<int64_t>(std::min(mean, cap), 1), cached[s]);
  }

  // 4. Each KV head's union of its query heads' top tokens and the recent window, ascending.
  std::vector<std::vector<int64_t>> chosen(n * kv_heads);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    std::vector<uint8_t> marks;  // a bit per token
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads, len = lens[s];
      const uint8_t* gone = dead_at ? gone_tokens.data() + s * longest : nullptr;
      marks.assign((len + 7) / 8, 0);
      if (per_head[s] > 0) {
        for (int64_t h = s * heads + g * group; h < s * heads + (g + 1) * group; ++h) {
          const float threshold = summaries[h].top - within;
          mark_top(logits.get() + h * longest, len, per_head[s], summaries[h], threshold, counts[h], gone,
                   marks.data(), work);
        }
      }
      for (int64_t t = std::max<int64_t>(len - recent, 0); t < len; ++t) {
        if (!(gone && gone[t])) marks[t / 8] |= 1 << t % 8;
      }
      std::vector<int64_t>& out = chosen[s * kv_heads + g];  // items are sequence-major, heads are not
      for (int64_t byte = 0; byte < static_cast<int64_t>(marks.size()); ++byte) {
        for (unsigned bits = marks[byte]; bits; bits &= bits - 1) out.push_back(byte * 8 + __builtin_ctz(bits));
      }
    }
  });

  // 5. Each KV head's rows, sequence after sequence: its chosen tokens, then the step's own token. Heads with fewer
  // rows than the most are padded at the end (position -1, reading the first sequence's own slot: a real row).
  auto offsets = at::empty({kv_heads, n + 1}, at::kLong);
  int64_t* offset_at = offsets.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t g = 0; g < kv_heads; ++g) {
    offset_at[g * (n + 1)] = 0;
    for (int64_t s = 0; s < n; ++s) {
      offset_at[g * (n + 1) + s + 1] = offset_at[g * (n + 1) + s] + chosen[s * kv_heads + g].size() + 1;
    }
    rows = std::max(rows, offset_at[g * (n + 1) + n]);
  }
  auto positions = at::full({kv_heads, rows}, -1, at::kLong);
  auto chosen_slots = at::full({kv_heads, rows}, slot_of(tables, block, lens[0]), at::kLong);
  int64_t* position_at = positions.data_ptr<int64_t>();
  int64_t* slot_at = chosen_slots.data_ptr<int64_t>();
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t s = 0; s < n; ++s) {
        const int64_t* table = tables + s * width;
        const std::vector<int64_t>& tokens = chosen[s * kv_heads + g];
        int64_t* position_row = position_at + g * rows + offset_at[g * (n + 1) + s];
        int64_t* slot_row = slot_at + g * rows + offset_at[g * (n + 1) + s];
        for (size_t j = 0; j < tokens.size(); ++j) {
          position_row[j] = tokens[j];
          slot_row[j] = slot_of(table, block, tokens[j]);
        }
        position_row[tokens.size()] = lens[s];
        slot_row[tokens.size()] = slot_of(table, block, lens[s]);
      }
    }
  });
  return {positions, chosen_slots, offsets, per_query_head};
}

}  // namespace kvstrata
