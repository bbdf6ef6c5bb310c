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
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attend.h"

namespace kvstrata {
namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();
constexpr float kNegativeInfinity = -kInfinity;
constexpr int64_t kHeadsTogether = 4;  // query heads scored in one pass over a block's partial keys
constexpr int64_t kFewCandidates = 64;  // the top-k search narrows its bracket until about this many logits lie in it
constexpr int kMostCuts = 48;  // ... or it has cut this often (logits tied in masses cut slowly)

// What scoring (step 2 below) learns of one query head's row of logits.
struct RowSummary {
  float top = kNegativeInfinity;  // the largest logit
  float least = kInfinity;  // the least one above -inf (+inf where there is none)
  int64_t finite = 0;  // logits above -inf (the gone and NaN ones are -inf)
};

// A RowSummary gathered eight lanes at a time while a row is scored.
struct RowScan {
  __m256 top = _mm256_set1_ps(kNegativeInfinity);
  __m256 least = _mm256_set1_ps(kInfinity);
  int64_t finite = 0;

  // Eight logits as they are stored: NaN (a corrupt cache) and gone tokens (bits of `gone_lanes`) become -inf, so
  // that they are never preferred and every comparison stays ordered.
  __m256 clean_and_add(__m256 x, int gone_lanes) {
    const __m256 low = _mm256_set1_ps(kNegativeInfinity);
    x = _mm256_blendv_ps(x, low, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    if (gone_lanes) x = _mm256_blendv_ps(x, low, lanes_of(gone_lanes));
    const __m256 is_finite = _mm256_cmp_ps(x, low, _CMP_GT_OQ);
    finite += __builtin_popcount(_mm256_movemask_ps(is_finite));
    top = _mm256_max_ps(top, x);
    least = _mm256_min_ps(least, _mm256_blendv_ps(_mm256_set1_ps(kInfinity), x, is_finite));
    return x;
  }

  float clean_and_add(float x, bool gone) {
    if (std::isnan(x) || gone) x = kNegativeInfinity;
    scalar.top = std::max(scalar.top, x);
    if (x != kNegativeInfinity) scalar.least = std::min(scalar.least, x), ++scalar.finite;
    return x;
  }

  RowSummary summary() const {
    float tops[8], leasts[8];
    _mm256_storeu_ps(tops, top);
    _mm256_storeu_ps(leasts, least);
    return {std::max(*std::max_element(tops, tops + 8), scalar.top),
            std::min(*std::min_element(leasts, leasts + 8), scalar.least), finite + scalar.finite};
  }

 private:
  RowSummary scalar;  // the logits scored one at a time (a block's last tokens short of eight)

  // All ones in the lanes whose bit is set in `bits`.
  static __m256 lanes_of(int bits) {
    const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_and_si256(_mm256_set1_epi32(bits), lane_bits);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bits));
  }
};

// The bits of the tokens a capped pool gave up among the eight from `gone` (one byte per token; null: none).
inline int gone_bits(const uint8_t* gone) {
  if (!gone) return 0;
  uint64_t bytes;
  std::memcpy(&bytes, gone, 8);
  return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
      _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))), _mm256_setzero_si256())));
}

// Logits of `Heads` query heads (queries [Heads, r]) against the first `count` tokens of a block whose partial keys
// are float16 [r, block], into rows `stride` apart, each head's values added to its scan as they are stored.
// Eight tokens at a time keep one accumulator per head in a register over all r channels; the reads of a channel
// stay within its `block` values. `gone` (or null): a byte per token of the block, set for tokens a capped pool
// gave up.
template <int Heads>
void score_block(const float* queries, int64_t r, const at::Half* keys, int64_t block, int64_t count,
                 const uint8_t* gone, float* out, int64_t stride, RowScan* scans) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    __m256 acc[Heads];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < r; ++d) {
      const __m256 channel = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + d * block + j)));
      for (int h = 0; h < Heads; ++h) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(queries[h * r + d]), channel, acc[h]);
    }
    const int gone_lanes = gone_bits(gone ? gone + j : nullptr);
    for (int h = 0; h < Heads; ++h) _mm256_storeu_ps(out + h * stride + j, scans[h].clean_and_add(acc[h], gone_lanes));
  }
  for (; j < count; ++j) {
    for (int h = 0; h < Heads; ++h) {
      float sum = 0.0f;
      for (int64_t d = 0; d < r; ++d) sum += queries[h * r + d] * static_cast<float>(keys[d * block + j]);
      out[h * stride + j] = scans[h].clean_and_add(sum, gone && gone[j]);
    }
  }
}

// score_block for 1 to kHeadsTogether heads.
void score_block(int64_t heads, const float* queries, int64_t r, const at::Half* keys, int64_t block, int64_t count,
                 const uint8_t* gone, float* out, int64_t stride, RowScan* scans) {
  switch (heads) {
    case 1: return score_block<1>(queries, r, keys, block, count, gone, out, stride, scans);
    case 2: return score_block<2>(queries, r, keys, block, count, gone, out, stride, scans);
    case 3: return score_block<3>(queries, r, keys, block, count, gone, out, stride, scans);
    default: return score_block<kHeadsTogether>(queries, r, keys, block, count, gone, out, stride, scans);
  }
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

// Values between which a row's k-th largest logit lies: at least k logits are >= low, and above_high < k are > high.
struct Bracket {
  float low, high;
  int64_t above_high;
};

// The bracket of a row's k-th largest logit (k >= 1, no more than the row's finite logits), narrowed by value until
// few logits lie in it (nth_element over every token costs several times more). Counting the row against a value is
// one vector pass; each cut goes where the counts, taken as linear in the value across the bracket, reach k (kept
// off the ends, so a cut removes a tenth of the bracket at least). `threshold` (the alpha cut) with
// `above_threshold` logits above it, known already, narrows the first bracket.
Bracket bracket_kth_largest(const float* row, int64_t len, int64_t k, const RowSummary& summary, float threshold,
                            int64_t above_threshold) {
  Bracket bracket{summary.least, summary.top, 0};
  int64_t at_least_low = summary.finite;
  if (threshold > bracket.low && threshold < bracket.high) {
    if (above_threshold >= k) {
      bracket.low = threshold, at_least_low = above_threshold;  // a lower bound of those >= it: enough to stop on
    } else {
      bracket.high = threshold, bracket.above_high = above_threshold;
    }
  }
  for (int cut = 0; cut < kMostCuts && at_least_low - bracket.above_high > kFewCandidates; ++cut) {
    const float share = static_cast<float>(at_least_low - k) / static_cast<float>(at_least_low - bracket.above_high);
    const float middle = bracket.low + (bracket.high - bracket.low) * std::clamp(share, 0.1f, 0.9f);
    if (!(middle > bracket.low && middle < bracket.high)) break;  // the bracket is as narrow as floats go
    const Counts counts = count_at(row, len, middle);
    if (counts.at_least >= k) {
      bracket.low = middle, at_least_low = counts.at_least;
    } else {
      bracket.high = middle, bracket.above_high = counts.above;
    }
  }
  return bracket;
}

// mark_top's room, kept from row to row: the logits inside the k-th's bracket in token order, their tokens, and
// the same logits partly sorted.
struct Bracketed {
  std::vector<float> values;
  std::vector<int64_t> tokens;
  std::vector<float> ranked;
};

// Sets the bits (token t: bit t % 8 of byte t / 8) of the `k` tokens of `row` with the highest logits, ties broken
// towards earlier tokens, gone ones (a capped pool's; `gone` may be null; their logits are -inf) never. One pass
// marks the logits above the k-th's bracket and keeps those inside it, for the k-th to be found among them.
void mark_top(const float* row, int64_t len, int64_t k, const RowSummary& summary, float threshold,
              int64_t above_threshold, const uint8_t* gone, uint8_t* chosen, Bracketed& inside_bracket) {
  if (summary.finite < k) {  // every finite logit, then the earliest -inf ones that are still there
    int64_t taken = 0;
    for (int64_t t = 0; t < len; ++t) {
      if (row[t] != kNegativeInfinity) chosen[t / 8] |= 1 << t % 8, ++taken;
    }
    for (int64_t t = 0; t < len && taken < k; ++t) {
      if (row[t] == kNegativeInfinity && !(gone && gone[t])) chosen[t / 8] |= 1 << t % 8, ++taken;
    }
    return;
  }
  const Bracket bracket = bracket_kth_largest(row, len, k, summary, threshold, above_threshold);
  auto& [values, tokens, ranked] = inside_bracket;
  values.clear(), tokens.clear();
  const __m256 lows = _mm256_set1_ps(bracket.low), highs = _mm256_set1_ps(bracket.high);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 v = _mm256_loadu_ps(row + t);
    chosen[t / 8] |= _mm256_movemask_ps(_mm256_cmp_ps(v, highs, _CMP_GT_OQ));
    for (int inside = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, lows, _CMP_GE_OQ),
                                                     _mm256_cmp_ps(v, highs, _CMP_LE_OQ)));
         inside; inside &= inside - 1) {
      values.push_back(row[t + __builtin_ctz(inside)]), tokens.push_back(t + __builtin_ctz(inside));
    }
  }
  for (; t < len; ++t) {
    if (row[t] > bracket.high) chosen[t / 8] |= 1 << t % 8;
    if (row[t] >= bracket.low && row[t] <= bracket.high) values.push_back(row[t]), tokens.push_back(t);
  }
  ranked.assign(values.begin(), values.end());
  const int64_t rank = k - bracket.above_high - 1;  // within the bracket, counted from its largest
  std::nth_element(ranked.begin(), ranked.begin() + rank, ranked.end(), std::greater<float>());
  const float kth = ranked[rank];  // finite: at least k logits are
  int64_t taken = bracket.above_high;
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] > kth) chosen[tokens[i] / 8] |= 1 << tokens[i] % 8, ++taken;
  }
  for (size_t i = 0; i < values.size() && taken < k; ++i) {
    if (values[i] == kth) chosen[tokens[i] / 8] |= 1 << tokens[i] % 8, ++taken;
  }
}

}  // namespace

std::vector<at::Tensor> infinigen_select(at::Tensor q_partial, at::Tensor partial_keys, at::Tensor block_tables,
                                         at::Tensor q_positions, at::Tensor dead, int64_t block, double alpha,
                                         double max_fraction, int64_t recent) {
  TORCH_CHECK(q_partial.scalar_type() == at::kFloat && q_partial.dim() == 4 &&
                  partial_keys.scalar_type() == at::kHalf && partial_keys.dim() == 4 &&
                  partial_keys.size(0) == q_partial.size(1) && partial_keys.size(2) == q_partial.size(3) &&
                  partial_keys.size(3) == block && block >= 1,
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
  const BlockSlots slots{block};

  // 1. How many of each sequence's cached tokens are there to fetch, and (under a cap) which are gone.
  std::vector<int64_t> cached(lens, lens + n);
  std::vector<uint8_t> gone_tokens(dead_at ? n * longest : 0);
  if (dead_at) {
    for (int64_t s = 0; s < n; ++s) {
      uint8_t* gone = gone_tokens.data() + s * longest;
      for (int64_t t = 0; t < lens[s]; ++t) gone[t] = dead_at[slots.of(tables + s * width, t)];
      cached[s] -= std::count(gone, gone + lens[s], 1);
    }
  }

  // 2. Every query head's logits, its top one and its count within alpha of the top.
  // every value is written before it is read: no zero fill (tens of MB per step at batch 8 x 4,096 tokens)
  std::unique_ptr<float[]> logits(new float[n * heads * longest]);
  std::vector<RowSummary> summaries(n * heads);
  std::vector<int64_t> counts(n * heads);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<RowScan> scans;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads, len = lens[s];
      const uint8_t* gone = dead_at ? gone_tokens.data() + s * longest : nullptr;
      float* rows = logits.get() + (s * heads + g * group) * longest;
      scans.assign(group, RowScan());
      for (int64_t h0 = 0; h0 < group; h0 += kHeadsTogether) {
        const int64_t together = std::min(kHeadsTogether, group - h0);
        const float* queries = qp + ((s * kv_heads + g) * group + h0) * r;
        for (int64_t first = 0; first < len; first += block) {
          const at::Half* block_keys = keys + (g * num_blocks + tables[s * width + first / block]) * r * block;
          score_block(together, queries, r, block_keys, block, std::min(block, len - first),
                      gone ? gone + first : nullptr, rows + h0 * longest + first, longest, scans.data() + h0);
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        const RowSummary summary = scans[h].summary();
        summaries[s * heads + g * group + h] = summary;
        counts[s * heads + g * group + h] = count_at(rows + h * longest, len, summary.top - within).above;
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
    Bracketed inside_bracket;
    std::vector<uint8_t> marks;  // a bit per token
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads, len = lens[s];
      const uint8_t* gone = dead_at ? gone_tokens.data() + s * longest : nullptr;
      marks.assign((len + 7) / 8, 0);
      if (per_head[s] > 0) {
        for (int64_t h = s * heads + g * group; h < s * heads + (g + 1) * group; ++h) {
          const float threshold = summaries[h].top - within;
          mark_top(logits.get() + h * longest, len, per_head[s], summaries[h], threshold, counts[h], gone,
                   marks.data(), inside_bracket);
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
  auto positions = at::empty({kv_heads, rows}, at::kLong);
  auto chosen_slots = at::empty({kv_heads, rows}, at::kLong);
  int64_t* position_at = positions.data_ptr<int64_t>();
  int64_t* slot_at = chosen_slots.data_ptr<int64_t>();
  const int64_t padding_slot = slots.of(tables, lens[0]);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t s = 0; s < n; ++s) {
        const int64_t* table = tables + s * width;
        const std::vector<int64_t>& tokens = chosen[s * kv_heads + g];
        int64_t* position_row = position_at + g * rows + offset_at[g * (n + 1) + s];
        int64_t* slot_row = slot_at + g * rows + offset_at[g * (n + 1) + s];
        for (size_t j = 0; j < tokens.size(); ++j) {
          position_row[j] = tokens[j];
          slot_row[j] = slots.of(table, tokens[j]);
        }
        position_row[tokens.size()] = lens[s];
        slot_row[tokens.size()] = slots.of(table, lens[s]);
      }
      std::fill(position_at + g * rows + offset_at[g * (n + 1) + n], position_at + (g + 1) * rows, -1);
      std::fill(slot_at + g * rows + offset_at[g * (n + 1) + n], slot_at + (g + 1) * rows, padding_slot);
    }
  });
  return {positions, chosen_slots, offsets, per_query_head};
}

}  // namespace kvstrata
