// Decode attention read in place from the paged KV cache, shared by every storage's reader: one query token per
// sequence attends over the first context_lens[s] tokens of sequence s (token t at position t), found block by
// block through its block table. Each storage supplies a `Rows` reader that hands back a token's K or V row of one
// KV head (or, for whole-token records, of several side by side) as float32, decoding it into a tile of a few
// tokens' rows where the storage keeps another form; nothing else is copied (the torch path gathers, and for
// quantized storage decodes, every block first).
//
// q [n, heads, dim] float32; block_tables [n, width] int64; context_lens [n] int64. Query head h reads KV head
// h / (heads / kv_heads).
#pragma once

// The tensor type and the few operators used, not <torch/extension.h>: its headers took most of the build's time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vector_math.h"

namespace kvstrata {

// The slot of a sequence's token t (block table entry t / block, offset t % block) for many tokens of one block size
// (>= 1): a shift and a mask where it is a power of two (it is by default), since a division per row read is a
// visible share of a loop that reads rows one by one.
struct BlockSlots {
  const int64_t block;
  const int shift = (block & (block - 1)) == 0 ? __builtin_ctzll(block) : -1;

  int64_t entry(int64_t t) const { return shift < 0 ? t / block : t >> shift; }  // token t's block table entry
  int64_t offset(int64_t t) const { return shift < 0 ? t % block : t & (block - 1); }  // and its place there
  int64_t of(const int64_t* table, int64_t t) const { return table[entry(t)] * block + offset(t); }
};

// Two kinds of reader. Stable rows (kStableRows true: a float32 pool read in place) hand back where a token's row
// lies, `key(t)` and `value(t)`, and it stays there until the reader is gone. Other readers decode a token's row
// into a place the caller gives, `key(t, out)` and `value(t, out)`, and may use out[row width], the float after
// it, as a scratch place; the loop below decodes kTileTokens of them at a time, in order, into a DecodedTile, which
// then reads as stable rows, so that both kinds share the arithmetic below.
template <typename Rows, typename = void>
struct stable_rows : std::false_type {};
template <typename Rows>
struct stable_rows<Rows, std::void_t<decltype(Rows::kStableRows)>> : std::bool_constant<Rows::kStableRows> {};

// Tokens decoded together: a block of the default size. Their K (or V) rows of 3 KV heads of 64 take 12 KiB, within
// the level-1 cache beside what the arithmetic reads.
constexpr int64_t kTileTokens = 16;

// Decoded rows of tokens [first, first + kTileTokens), `width` floats each, read as stable rows.
struct DecodedTile {
  static constexpr bool kStableRows = true;
  const float* rows;
  int64_t first, width;
  const float* key(int64_t t) const { return rows + (t - first) * width; }
  const float* value(int64_t t) const { return key(t); }
};

// The sums across lanes of eight vectors, as the lanes of one.
inline __m256 sum_lanes_of_8(const __m256* x) {
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
}

// Scores of one query head (query: dim values) against tokens [first, last) of stable rows, at `offset` in each key
// row: where dim is a multiple of 8, eight keys at a time, their dot products summed across lanes together.
template <typename Rows>
void score_stable_rows(const Rows& rows, const float* query, int64_t offset, int64_t first, int64_t last,
                       int64_t dim, float scale, float* scores) {
  int64_t t = first;
  for (; dim % 8 == 0 && t + 8 <= last; t += 8) {
    const float* keys[8];
    for (int i = 0; i < 8; ++i) keys[i] = rows.key(t + i) + offset;
    __m256 sums[8];
    for (auto& sum : sums) sum = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 q = _mm256_loadu_ps(query + d);
      for (int i = 0; i < 8; ++i) sums[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(keys[i] + d), sums[i]);
    }
    _mm256_storeu_ps(scores + t - first, _mm256_mul_ps(sum_lanes_of_8(sums), _mm256_set1_ps(scale)));
  }
  for (; t < last; ++t) scores[t - first] = dot(query, rows.key(t) + offset, dim) * scale;
}

// output[0 .. 8 * Lanes) += the sum over tokens [first, last) of weights[t - first] times the value row at `offset`,
// kept in registers over every token.
template <int Lanes, typename Rows>
void weigh_stable_rows(const Rows& rows, const float* weights, int64_t offset, int64_t first, int64_t last,
                       float* output) {
  __m256 sums[Lanes];
  for (int c = 0; c < Lanes; ++c) sums[c] = _mm256_loadu_ps(output + 8 * c);
  for (int64_t t = first; t < last; ++t) {
    const float* value = rows.value(t) + offset;
    const __m256 weight = _mm256_set1_ps(weights[t - first]);
    for (int c = 0; c < Lanes; ++c) sums[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * c), sums[c]);
  }
  for (int c = 0; c < Lanes; ++c) _mm256_storeu_ps(output + 8 * c, sums[c]);
}

// weigh_stable_rows over a head's dim values: 64 at a time where dim is a multiple of 8, else value by value.
template <typename Rows>
void weigh_stable_rows(const Rows& rows, const float* weights, int64_t offset, int64_t first, int64_t last,
                       int64_t dim, float* output) {
  if (dim % 8 != 0) {
    for (int64_t t = first; t < last; ++t) {
      const float* __restrict value = rows.value(t) + offset;
      const float weight = weights[t - first];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) output[d] += weight * value[d];
    }
    return;
  }
  for (int64_t d = 0; d < dim; d += 64) {
    switch (std::min<int64_t>(dim - d, 64) / 8) {
      case 1: weigh_stable_rows<1>(rows, weights, offset + d, first, last, output + d); break;
      case 2: weigh_stable_rows<2>(rows, weights, offset + d, first, last, output + d); break;
      case 3: weigh_stable_rows<3>(rows, weights, offset + d, first, last, output + d); break;
      case 4: weigh_stable_rows<4>(rows, weights, offset + d, first, last, output + d); break;
      case 5: weigh_stable_rows<5>(rows, weights, offset + d, first, last, output + d); break;
      case 6: weigh_stable_rows<6>(rows, weights, offset + d, first, last, output + d); break;
      case 7: weigh_stable_rows<7>(rows, weights, offset + d, first, last, output + d); break;
      default: weigh_stable_rows<8>(rows, weights, offset + d, first, last, output + d); break;
    }
  }
}

// Whether a decoding reader can start fetching a token's K or V bytes into the cache, `prefetch(keys, t)`: the loop
// below asks it for the next tile's tokens before it decodes a tile, so that the records of a cache larger than the
// processor's caches arrive while it works (blocks lie anywhere in the pool, too far apart for the hardware to guess).
template <typename Rows, typename = void>
struct prefetches : std::false_type {};
template <typename Rows>
struct prefetches<Rows, std::void_t<decltype(std::declval<Rows&>().prefetch(true, int64_t{}))>> : std::true_type {};

// Every cache line of n bytes from p, asked for.
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* bytes = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(bytes + i, _MM_HINT_T0);
  _mm_prefetch(bytes + n - 1, _MM_HINT_T0);
}

// A worker's scratch: the scores of its item's heads and the decoded rows of a tile.
struct SpanScratch {
  std::vector<float> scores, tile;
};

// Stable rows are read this many tokens at a time (a multiple of 8, so scores are still summed eight keys at a time
// from `first`, to the same bits): the query heads of a KV head read a run in turn while it is in the level-1 cache
// (32 KiB of a head's rows of 64). Read head by head over a whole span, a span larger than the level-2 cache came
// from memory once per query head (docs/BENCHMARKS.md, "Decode attention reads a run of rows for all its heads").
constexpr int64_t kStableRunTokens = 128;

// read(stable, a, b) over tokens [first, last): over `rows` where they are stable, kStableRunTokens at a time, else
// tile by tile over the tile's K rows (keys) or V rows (values), decoded by `rows` into the scratch's tile.
template <typename Rows, typename Read>
void in_tiles(Rows& rows, bool keys, int64_t first, int64_t last, int64_t width, SpanScratch& scratch, Read read) {
  if constexpr (stable_rows<Rows>::value) {
    for (int64_t a = first; a < last; a += kStableRunTokens) read(rows, a, std::min(last, a + kStableRunTokens));
  } else {
    scratch.tile.resize(kTileTokens * width + 1);  // and the last row's scratch place
    for (int64_t a = first; a < last; a += kTileTokens) {
      const int64_t b = std::min(last, a + kTileTokens);
      if constexpr (prefetches<Rows>::value) {
        for (int64_t t = b; t < std::min(last, b + kTileTokens); ++t) rows.prefetch(keys, t);
      }
      for (int64_t t = a; t < b; ++t) {
        float* row = scratch.tile.data() + (t - a) * width;
        if (keys) {
          rows.key(t, row);
        } else {
          rows.value(t, row);
        }
      }
      read(DecodedTile{scratch.tile.data(), a, width}, a, b);
    }
  }
}

// Tokens [first, last) of one item of one sequence: `row_heads` KV heads, whose rows the reader hands back side by
// side, and their `group` query heads each (query head g reads KV head g / group of the row). Leaves per query head
// g its peak score peaks[g], the sum of its weights e^(score - peak) totals[g] and, in outputs, the weighted sum of
// the values, not yet divided by the total. Rows are read head by head, with a head's sums in registers.
template <typename Rows>
void attend_span(Rows& rows, const float* queries, float* outputs, int64_t first, int64_t last, int64_t group,
                 int64_t row_heads, int64_t dim, float scale, SpanScratch& scratch, float* peaks, float* totals) {
  const int64_t heads = group * row_heads, len = last - first, width = row_heads * dim;
  scratch.scores.resize(heads * len);
  float* scores = scratch.scores.data();
  in_tiles(rows, true, first, last, width, scratch, [&](const auto& readable, int64_t a, int64_t b) {
    for (int64_t g = 0; g < heads; ++g) {
      score_stable_rows(readable, queries + g * dim, g / group * dim, a, b, dim, scale, scores + g * len + a - first);
    }
  });
  for (int64_t g = 0; g < heads; ++g) {
    float* row = scores + g * len;
    peaks[g] = *std::max_element(row, row + len);
    totals[g] = exp_minus_peak(row, len, peaks[g]);
  }
  std::fill(outputs, outputs + heads * dim, 0.0f);
  in_tiles(rows, false, first, last, width, scratch, [&](const auto& readable, int64_t a, int64_t b) {
    for (int64_t g = 0; g < heads; ++g) {
      weigh_stable_rows(readable, scores + g * len + a - first, g / group * dim, a, b, dim, outputs + g * dim);
    }
  });
}

// The whole item: its tokens [first, len), outputs divided by their totals (peaks and totals: a place per head).
template <typename Rows>
void attend_head(Rows& rows, const float* queries, float* outputs, int64_t first, int64_t len, int64_t group,
                 int64_t row_heads, int64_t dim, float scale, SpanScratch& scratch, std::vector<float>& peaks,
                 std::vector<float>& totals) {
  attend_span(rows, queries, outputs, first, len, group, row_heads, dim, scale, scratch, peaks.data(), totals.data());
  for (int64_t g = 0; g < group * row_heads; ++g) {
    const float inverse = 1.0f / totals[g];
    for (int64_t d = 0; d < dim; ++d) outputs[g * dim + d] *= inverse;
  }
}

// Checks shared by every storage; bad input must raise here, not inside the parallel region.
inline void check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block,
                         int64_t num_blocks) {
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && context_lens.size(0) == block_tables.size(0),
              "paged_decode_attention: one block table and one context length per sequence");
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < block_tables.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block, "paged_decode_attention: context length out of range");
    for (int64_t b = 0; b < (lens[s] + block - 1) / block; ++b) {
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks,
                  "paged_decode_attention: block id out of range");
    }
  }
}

inline void check_inputs(const at::Tensor& q, const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t kv_heads, int64_t block, int64_t num_blocks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "paged_decode_attention: q must be float32 [n, heads, dim]");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == q.size(0), "paged_decode_attention: one block table per query");
  check_tables(block_tables, context_lens, block, num_blocks);
}

// Where an item's tokens are split (below), its parts hold at least this many
constexpr int64_t kMinPartTokens = 64;
// Rows of fewer tokens are attended whole: a batch of them would pay for writing and merging their parts' outputs,
// and alone they are a small part of a step
constexpr int64_t kSplitFromTokens = 512;

// The sequences of a step of decodes: runs of rows with the same block table are one sequence's (speculative
// decoding's rows for its last token and drafts), counted once.
inline int64_t count_sequences(const int64_t* tables, int64_t n, int64_t width) {
  int64_t sequences = n > 0;
  for (int64_t s = 1; s < n; ++s) {
    sequences += !std::equal(tables + s * width, tables + (s + 1) * width, tables + (s - 1) * width);
  }
  return sequences;
}

// Softmax parts of one query head merged into o: part p has peak peaks[p], total totals[p] (the sum of its weights
// e^(score - peak)) and outputs[p], its dim values weighted by them, not yet divided. A part of peak -inf (no tokens,
// or scores all -inf that its attention left at total 0) weighs nothing; NaN where a part's scores were: o is then
// NaN, as unsplit.
inline void merge_parts(int64_t count, const float* peaks, const float* totals, const float* const* outputs,
                        int64_t dim, float* o) {
  float peak = -INFINITY;
  for (int64_t p = 0; p < count; ++p) peak = std::max(peak, peaks[p]);
  std::fill(o, o + dim, 0.0f);
  float total = 0.0f;
  for (int64_t p = 0; p < count; ++p) {
    const float weight = peaks[p] == -INFINITY ? 0.0f : std::exp(peaks[p] - peak);
    total += weight * totals[p];
    for (int64_t d = 0; d < dim; ++d) o[d] += weight * outputs[p][d];
  }
  for (int64_t d = 0; d < dim; ++d) o[d] /= total;
}

// The tokens every row reads from the same blocks: the whole blocks at the head of every row's block table that lie
// within every row's context.
inline int64_t shared_prefix_tokens(const int64_t* tables, const int64_t* lens, int64_t n, int64_t width,
                                    int64_t block) {
  const int64_t blocks = std::min(width, *std::min_element(lens, lens + n) / block);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t s = 1; s < n; ++s) {
      if (tables[s * width + b] != tables[b]) return b * block;
    }
  }
  return blocks * block;
}

// Prefixes read once for all the rows sharing them (below; one per group and call), counted: paged_decode.cpp.
std::atomic<int64_t>& shared_prefix_reads();

// Sequences that a prefix must be shared by to be read once for all (below): with fewer, the matrix products have
// too few rows to pay for their set-up. 8 is vLLM's threshold for its cascade attention too (untuned there, and here
// only measured from 8 up: docs/BENCHMARKS.md, "Cascade attention").
constexpr int64_t kCascadeMinSequences = 8;

// Rows of a step that share a prefix of `tokens` tokens, to be read once for all of them.
struct SharedPrefixGroup {
  std::vector<int64_t> rows;
  int64_t tokens;
};

// The step's rows grouped by their first min_shared_tokens tokens' blocks (rows with fewer whole blocks in their
// context are left out), and each group's shared prefix (shared_prefix_tokens, at least those blocks): the groups of
// kCascadeMinSequences sequences or more (count_sequences). Grouping by a prefix that long, not by the first block,
// keeps requests over different documents apart though they all begin alike (a chat template's system prompt).
inline std::vector<SharedPrefixGroup> shared_prefix_groups(const int64_t* tables, const int64_t* lens, int64_t n,
                                                           int64_t width, int64_t block, int64_t min_shared_tokens) {
  const int64_t key_blocks = std::min(width, (min_shared_tokens + block - 1) / block);
  std::vector<int64_t> order;
  for (int64_t s = 0; s < n; ++s) {
    if (lens[s] / block >= key_blocks) order.push_back(s);
  }
  auto key = [&](int64_t s) { return tables + s * width; };
  auto before = [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(key(a), key(a) + key_blocks, key(b), key(b) + key_blocks);
  };
  // stable: a sequence's rows for its drafts stay side by side, so that they count as one sequence
  std::stable_sort(order.begin(), order.end(), before);
  std::vector<SharedPrefixGroup> groups;
  for (size_t first = 0, last = 0; first < order.size(); first = last) {
    while (last < order.size() && !before(order[first], order[last])) ++last;
    const int64_t rows = static_cast<int64_t>(last - first);
    std::vector<int64_t> group_tables(rows * width), group_lens(rows);
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(key(order[first + i]), width, group_tables.begin() + i * width);
      group_lens[i] = lens[order[first + i]];
    }
    if (count_sequences(group_tables.data(), rows, width) < kCascadeMinSequences) continue;
    const int64_t tokens = shared_prefix_tokens(group_tables.data(), group_lens.data(), rows, width, block);
    if (tokens >= min_shared_tokens) groups.push_back({{order.begin() + first, order.begin() + last}, tokens});
  }
  return groups;
}

// Tokens of a shared prefix (below) one work item reads: at most this many, and fewer only to give every thread two.
constexpr int64_t kSharedChunkTokens = 256;

// The most floats a thread keeps in one buffer between calls (kept_tensor): 4 MiB.
constexpr int64_t kKeptFloats = int64_t{1} << 20;

// A float32 tensor of `sizes` over memory the calling thread keeps from call to call (`kept`, grown where too small):
// memory freshly allocated at these sizes would be faulted in page by page in every layer of every step. Larger
// tensors are allocated for the call, so that one very large step leaves no large buffer behind.
inline at::Tensor kept_tensor(std::vector<float>& kept, at::IntArrayRef sizes) {
  int64_t count = 1;
  for (const int64_t size : sizes) count *= size;
  if (count > kKeptFloats) return at::empty(sizes, at::kFloat);
  if (static_cast<int64_t>(kept.size()) < count) kept.resize(count);
  return at::from_blob(kept.data(), sizes, at::kFloat);
}

// Tokens [first, last) of a reader's K (keys) or V rows, `width` floats each, into out: copied, or decoded into `row`
// first (a reader may write one value past a row).
template <typename Rows>
void copy_rows(Rows& rows, bool keys, int64_t first, int64_t last, int64_t width, float* out,
               std::vector<float>& row) {
  row.resize(width + 1);
  for (int64_t t = first; t < last; ++t) {
    const float* from = row.data();
    if constexpr (stable_rows<Rows>::value) {
      from = keys ? rows.key(t) : rows.value(t);
    } else if (keys) {
      rows.key(t, row.data());
    } else {
      rows.value(t, row.data());
    }
    std::memcpy(out + (t - first) * width, from, width * sizeof(float));
  }
}

// Scores x [tokens, columns] turned in place into their weights e^(score - peak) per column, with each column's peak
// and total (the sum of its weights), 8 columns a vector.
inline void softmax_columns(float* x, int64_t tokens, int64_t columns, float* peaks, float* totals) {
  std::fill(peaks, peaks + columns, -INFINITY);
  std::fill(totals, totals + columns, 0.0f);
  const int64_t vectors = columns / 8 * 8;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = x + t * columns;
    int64_t c = 0;
    for (; c < vectors; c += 8) {
      _mm256_storeu_ps(peaks + c, _mm256_max_ps(_mm256_loadu_ps(peaks + c), _mm256_loadu_ps(row + c)));
    }
    for (; c < columns; ++c) peaks[c] = std::max(peaks[c], row[c]);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = x + t * columns;
    int64_t c = 0;
    for (; c < vectors; c += 8) {
      const __m256 weights = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(peaks + c)));
      _mm256_storeu_ps(row + c, weights);
      _mm256_storeu_ps(totals + c, _mm256_add_ps(_mm256_loadu_ps(totals + c), weights));
    }
    for (; c < columns; ++c) totals[c] += (row[c] = std::exp(row[c] - peaks[c]));
  }
}

// Decode attention where every row's first `shared` tokens lie in the same blocks (cascade attention). The prefix is
// read, and decoded where the storage keeps another form, once for all rows instead of once per row, in chunks over
// torch's threads; a chunk is attended by every row's queries of a KV head together, as two matrix products (the
// chunk's keys [tokens, dim] by the queries [n * group, dim], the weights by the values). Each row then reads its own
// tokens, and its parts are merged by their peaks and totals. The products sum in the matrix library's order, which
// may depend on how many rows there are. Arguments as `run` has them below; the prefix is read in items of
// prefix_row_heads KV heads, the rows' own tokens in items of row_heads.
template <typename MakeRows>
void attend_shared_prefix(const at::Tensor& q, at::Tensor& out, const int64_t* tables, const int64_t* lens,
                          int64_t width, int64_t kv_heads, int64_t row_heads, int64_t prefix_row_heads,
                          int64_t shared, double scale, MakeRows& make_rows) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), group = heads / kv_heads, columns = n * group;
  const int64_t prefix_items = kv_heads / prefix_row_heads, threads = at::get_num_threads();
  // chunks of whole tiles, as many as give every thread two work items where the prefix is long enough
  const int64_t chunk_tokens = std::clamp<int64_t>(
      (shared * prefix_items / (2 * threads) + kTileTokens - 1) / kTileTokens * kTileTokens, kTileTokens,
      kSharedChunkTokens);
  const int64_t chunks = (shared + chunk_tokens - 1) / chunk_tokens;
  // each KV head's queries of every row [n * group, dim], scaled
  const at::Tensor queries =
      q.view({n, kv_heads, group, dim}).transpose(0, 1).reshape({kv_heads, columns, dim}).mul(scale);
  // chunk c's sums for KV head h: outputs [columns, dim], peaks and totals [columns], at (c * kv_heads + h)
  thread_local std::vector<float> kept_outputs, kept_peaks, kept_totals;
  const at::Tensor outputs_held = kept_tensor(kept_outputs, {chunks * kv_heads * columns * dim});
  const at::Tensor peaks_held = kept_tensor(kept_peaks, {chunks * kv_heads * columns});
  const at::Tensor totals_held = kept_tensor(kept_totals, {chunks * kv_heads * columns});
  float* chunk_outputs = outputs_held.data_ptr<float>();
  float* chunk_peaks = peaks_held.data_ptr<float>();
  float* chunk_totals = totals_held.data_ptr<float>();
  at::parallel_for(0, chunks * prefix_items, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> kept_keys, kept_values, kept_weights, row;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t c = unit / prefix_items, first_head = unit % prefix_items * prefix_row_heads;
      const int64_t first = c * chunk_tokens, last = std::min(shared, first + chunk_tokens);
      const int64_t len = last - first, item_width = prefix_row_heads * dim;
      auto rows = make_rows(tables, first_head, prefix_row_heads);  // the first row's table: the prefix is every row's
      at::Tensor keys = kept_tensor(kept_keys, {len, item_width}), values = kept_tensor(kept_values, {len, item_width});
      copy_rows(rows, true, first, last, item_width, keys.data_ptr<float>(), row);
      copy_rows(rows, false, first, last, item_width, values.data_ptr<float>(), row);
      at::Tensor weights = kept_tensor(kept_weights, {len, columns});
      for (int64_t h = first_head; h < first_head + prefix_row_heads; ++h) {
        const int64_t at = c * kv_heads + h;
        at::mm_out(weights, keys.narrow(1, (h - first_head) * dim, dim), queries[h].t());
        softmax_columns(weights.data_ptr<float>(), len, columns, chunk_peaks + at * columns,
                        chunk_totals + at * columns);
        at::Tensor outputs = at::from_blob(chunk_outputs + at * columns * dim, {columns, dim}, at::kFloat);
        at::mm_out(outputs, weights.t(), values.narrow(1, (h - first_head) * dim, dim));
      }
    }
  });
  const int64_t items = kv_heads / row_heads, item_heads = group * row_heads;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * items, 1, [&](int64_t begin, int64_t end) {
    SpanScratch scratch;
    std::vector<float> own_outputs(item_heads * dim), own_peaks(item_heads), own_totals(item_heads);
    std::vector<float> peaks(chunks + 1), totals(chunks + 1);
    std::vector<const float*> outputs(chunks + 1);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / items, first_head = unit % items * row_heads;
      std::fill(own_outputs.begin(), own_outputs.end(), 0.0f);
      std::fill(own_peaks.begin(), own_peaks.end(), -INFINITY);  // nothing of its own weighs nothing below
      std::fill(own_totals.begin(), own_totals.end(), 0.0f);
      if (lens[s] > shared) {
        auto rows = make_rows(tables + s * width, first_head, row_heads);
        attend_span(rows, qp + (s * heads + first_head * group) * dim, own_outputs.data(), shared, lens[s], group,
                    row_heads, dim, static_cast<float>(scale), scratch, own_peaks.data(), own_totals.data());
      }
      for (int64_t g = 0; g < item_heads; ++g) {
        const int64_t h = first_head + g / group, column = s * group + g % group;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t at = (c * kv_heads + h) * columns + column;
          peaks[c] = chunk_peaks[at];
          totals[c] = chunk_totals[at];
          outputs[c] = chunk_outputs + at * dim;
        }
        peaks[chunks] = own_peaks[g];
        totals[chunks] = own_totals[g];
        outputs[chunks] = own_outputs.data() + g * dim;
        merge_parts(chunks + 1, peaks.data(), totals.data(), outputs.data(), dim,
                    op + (s * heads + first_head * group + g) * dim);
      }
    }
  });
}

// Checks the inputs, then one work item per sequence and `row_heads` KV heads over torch's threads;
// make_rows(table, first KV head, row_heads) builds the reader of one item, whose rows hold its KV heads side by
// side. A reader of whole-token records (whole_tokens) gets all of a token's KV heads in one item where there are
// enough sequences to keep every thread busy: the heads then share the record's bookkeeping (its slot, scales,
// outlier entries), which otherwise each head pays again. Else, and for float pools, each KV head is an item.
// A row of kSplitFromTokens tokens or more has each item's tokens split into parts attended apart and merged by
// their peaks and totals (the split-softmax of flash-decoding), as many as a decode of that sequence alone needs for
// every thread to have work (one item per KV head: 3 for the default model, on 2 threads). How a row is split
// depends only on its own length and the number of threads, not on the other sequences in the step: a decode gives
// the same numbers as requests come and go, and a sequence's rows for its drafts are attended as it is alone, in the
// same order of sums, so drafts do not change the numbers a decode gives. Where kCascadeMinSequences or more
// sequences share their first min_shared_tokens tokens or more in the same blocks (0: never looked for), those are
// read once for all of them (attend_shared_prefix), and the other rows as above; the prefix's matrix products may sum
// in an order that depends on how many rows share it, drafts included. A `window` (0: none) limits each row to its
// last `window` tokens (a sliding window): row s attends tokens [max(0, context_lens[s] - window), context_lens[s]),
// and no prefix is shared then.
template <typename MakeRows>
at::Tensor run(at::Tensor q, at::Tensor block_tables, at::Tensor context_lens, int64_t kv_heads, int64_t block,
               int64_t num_blocks, double scale, MakeRows make_rows, bool whole_tokens = false,
               int64_t min_shared_tokens = 0, int64_t window = 0) {
  q = q.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  context_lens = context_lens.to(at::kLong).contiguous();
  check_inputs(q, block_tables, context_lens, kv_heads, block, num_blocks);
  TORCH_CHECK(window >= 0, "paged_decode_attention: window ", window, " must be 0 (none) or positive");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), group = heads / kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t sequences = count_sequences(block_tables.data_ptr<int64_t>(), n, block_tables.size(1));
  const int64_t row_heads = whole_tokens && sequences >= 2 * threads ? kv_heads : 1;
  const int64_t items = kv_heads / row_heads, width = block_tables.size(1), item_heads = group * row_heads;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  if (n == 0) return out;
  // row s's first token
  auto first_of = [&](int64_t s) { return window > 0 ? std::max<int64_t>(0, lens[s] - window) : int64_t{0}; };
  if (window == 0 && min_shared_tokens > 0 && sequences >= kCascadeMinSequences) {
    const auto groups = shared_prefix_groups(tables, lens, n, width, block, min_shared_tokens);
    if (!groups.empty()) {
      std::vector<bool> grouped(n, false);
      for (const auto& group : groups) {
        const at::Tensor rows = at::tensor(group.rows, at::kLong);
        const at::Tensor group_tables = block_tables.index_select(0, rows);
        const at::Tensor group_lens = context_lens.index_select(0, rows);
        at::Tensor group_out = at::empty({rows.size(0), heads, dim}, q.options());
        attend_shared_prefix(q.index_select(0, rows), group_out, group_tables.data_ptr<int64_t>(),
                             group_lens.data_ptr<int64_t>(), width, kv_heads, row_heads, whole_tokens ? kv_heads : 1,
                             group.tokens, scale, make_rows);
        out.index_copy_(0, rows, group_out);
        ++shared_prefix_reads();
        for (const int64_t row : group.rows) grouped[row] = true;
      }
      std::vector<int64_t> rest;
      for (int64_t s = 0; s < n; ++s) {
        if (!grouped[s]) rest.push_back(s);
      }
      if (!rest.empty()) {  // each reading its own tokens, as a step of its own
        const at::Tensor rows = at::tensor(rest, at::kLong);
        out.index_copy_(0, rows, run(q.index_select(0, rows), block_tables.index_select(0, rows),
                                     context_lens.index_select(0, rows), kv_heads, block, num_blocks, scale, make_rows,
                                     whole_tokens));
      }
      return out;
    }
  }
  int64_t longest = 0;
  for (int64_t s = 0; s < n; ++s) longest = std::max(longest, lens[s] - first_of(s));
  // a row of kSplitFromTokens or more is split as a sequence decoded alone is (enough parts of its KV heads for four
  // per thread), whatever else the step holds, so that its sums do not change with the other sequences in the step
  const int64_t parts = longest < kSplitFromTokens ? 1 : std::clamp<int64_t>(
      (4 * threads + kv_heads - 1) / kv_heads, 1, longest / kMinPartTokens);
  // a row's own parts: as many as its length allows, each of at least kMinPartTokens tokens
  auto parts_of = [&](int64_t s) {
    const int64_t tokens = lens[s] - first_of(s);
    return tokens < kSplitFromTokens ? 1 : std::min(parts, tokens / kMinPartTokens);
  };
  if (parts == 1) {
    at::parallel_for(0, n * items, 1, [&](int64_t begin, int64_t end) {
      SpanScratch scratch;
      std::vector<float> peaks(item_heads), totals(item_heads);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / items, h = item % items * row_heads;
        auto rows = make_rows(tables + s * width, h, row_heads);
        attend_head(rows, qp + (s * heads + h * group) * dim, op + (s * heads + h * group) * dim, first_of(s),
                    lens[s], group, row_heads, dim, static_cast<float>(scale), scratch, peaks, totals);
      }
    });
    return out;
  }
  // part p of an item of sequence s holds its tokens [first + p * span, first + (p + 1) * span); parts past its own
  // stay empty, and a row of one part is attended whole, as unsplit
  auto span_of = [&](int64_t s) { return (lens[s] - first_of(s) + parts_of(s) - 1) / parts_of(s); };
  const int64_t units = n * items * parts;
  std::vector<float> partial(units * item_heads * dim), peaks(units * item_heads), totals(units * item_heads);
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    SpanScratch scratch;
    std::vector<float> item_peaks(item_heads), item_totals(item_heads);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / parts, part = unit % parts, s = item / items, h = item % items * row_heads;
      if (parts_of(s) == 1) {  // attended whole, as unsplit
        if (part == 0) {
          auto rows = make_rows(tables + s * width, h, row_heads);
          attend_head(rows, qp + (s * heads + h * group) * dim, op + (s * heads + h * group) * dim, first_of(s),
                      lens[s], group, row_heads, dim, static_cast<float>(scale), scratch, item_peaks, item_totals);
        }
        continue;
      }
      const int64_t first = first_of(s) + part * span_of(s), last = std::min(lens[s], first + span_of(s));
      if (first >= last) continue;
      auto rows = make_rows(tables + s * width, h, row_heads);
      attend_span(rows, qp + (s * heads + h * group) * dim, partial.data() + unit * item_heads * dim, first, last,
                  group, row_heads, dim, static_cast<float>(scale), scratch, peaks.data() + unit * item_heads,
                  totals.data() + unit * item_heads);
    }
  });
  std::vector<float> part_peaks(parts), part_totals(parts);
  std::vector<const float*> part_outputs(parts);
  for (int64_t item = 0; item < n * items; ++item) {
    const int64_t s = item / items, h = item % items * row_heads;
    if (parts_of(s) == 1) continue;  // attended whole above
    const int64_t used = (lens[s] - first_of(s) + span_of(s) - 1) / span_of(s);  // the parts that hold tokens
    for (int64_t g = 0; g < item_heads; ++g) {
      for (int64_t p = 0; p < used; ++p) {
        const int64_t at = (item * parts + p) * item_heads + g;
        part_peaks[p] = peaks[at];
        part_totals[p] = totals[at];
        part_outputs[p] = partial.data() + at * dim;
      }
      merge_parts(used, part_peaks.data(), part_totals.data(), part_outputs.data(), dim,
                  op + (s * heads + h * group + g) * dim);
    }
  }
  return out;
}

// Tokens of one sequence a work item of `read_rows` reads.
constexpr int64_t kReadPartTokens = 256;

// Every cached row of n sequences read out by make_rows' readers (whole-token ones: an item reads all kv_heads KV
// heads of a token), for attention over more than one new token (a prefill chunk): K and V float32 [n, T, kv_heads *
// dim], T = block_tables' width in tokens, row t of sequence s its token t, zeros from context_lens[s] on
// (copy_rows: each row decoded into a place of its own first).
template <typename MakeRows>
std::vector<at::Tensor> read_rows(at::Tensor block_tables, at::Tensor context_lens, int64_t kv_heads, int64_t dim,
                                  int64_t block, int64_t num_blocks, MakeRows make_rows) {
  block_tables = block_tables.to(at::kLong).contiguous();
  context_lens = context_lens.to(at::kLong).contiguous();
  check_tables(block_tables, context_lens, block, num_blocks);
  const int64_t n = block_tables.size(0), tokens = block_tables.size(1) * block, width = kv_heads * dim;
  const int64_t parts = (tokens + kReadPartTokens - 1) / kReadPartTokens;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  std::vector<at::Tensor> out = {at::empty({n, tokens, width}, at::kFloat), at::empty({n, tokens, width}, at::kFloat)};
  float* k = out[0].data_ptr<float>();
  float* v = out[1].data_ptr<float>();
  at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / parts, first = unit % parts * kReadPartTokens;
      const int64_t last = std::min(tokens, first + kReadPartTokens), filled = std::clamp(lens[s], first, last);
      auto rows = make_rows(tables + s * block_tables.size(1), 0, kv_heads);
      copy_rows(rows, true, first, filled, width, k + (s * tokens + first) * width, row);
      copy_rows(rows, false, first, filled, width, v + (s * tokens + first) * width, row);
      const int64_t tail = (s * tokens + filled) * width, tail_values = (last - filled) * width;
      std::fill(k + tail, k + tail + tail_values, 0.0f);
      std::fill(v + tail, v + tail + tail_values, 0.0f);
    }
  });
  return out;
}

// Whether readers with AVX-512 code (Oaken's dense values) take it: where the CPU has AVX-512 (F, BW, VL) and tests
// have not turned it off to check the AVX2 code on such a CPU (allow_avx512, in paged_decode.cpp).
bool avx512_path();

// The storages' entry points (one file each), bound in paged_decode.cpp.
// `window`: each row's last tokens it attends (0: all of them; run's sliding window).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale, int64_t min_shared_tokens, int64_t window);
at::Tensor paged_decode_attention_records(at::Tensor q, at::Tensor k_records, at::Tensor v_records,
                                          at::Tensor block_tables, at::Tensor context_lens, int64_t block,
                                          int64_t kv_heads, std::string k_form, int64_t k_group, std::string v_form,
                                          int64_t v_group, double scale, int64_t min_shared_tokens, int64_t window);
at::Tensor paged_decode_attention_kivi(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                       at::Tensor window_slot, at::Tensor block_tables, at::Tensor context_lens,
                                       int64_t bits, int64_t kv_heads, double scale, int64_t window);
at::Tensor paged_decode_attention_oaken(at::Tensor q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        std::vector<double> key_shift, std::vector<double> value_shift,
                                        std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                        at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t block, int64_t kv_heads, double scale, int64_t min_shared_tokens,
                                        int64_t window);
// The same readers' rows read out (read_rows): K and V of whole-block keys, for a prefill chunk's attention.
std::vector<at::Tensor> paged_read_records(at::Tensor k_records, at::Tensor v_records, at::Tensor block_tables,
                                           at::Tensor context_lens, int64_t block, int64_t kv_heads, int64_t dim,
                                           std::string k_form, int64_t k_group, std::string v_form, int64_t v_group);
std::vector<at::Tensor> paged_read_kivi(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                        at::Tensor window_slot, at::Tensor block_tables, at::Tensor context_lens,
                                        int64_t bits, int64_t kv_heads, int64_t dim);
std::vector<at::Tensor> paged_read_oaken(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                         std::vector<double> key_shift, std::vector<double> value_shift,
                                         std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos,
                                         at::Tensor sin, at::Tensor block_tables, at::Tensor context_lens,
                                         int64_t block, int64_t kv_heads, int64_t dim);

void record_store(at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor k_records, at::Tensor v_records,
                  std::string k_form, int64_t k_group, std::string v_form, int64_t v_group);
int64_t sparse_write(std::vector<at::Tensor> layer_tensors, at::Tensor slots, at::Tensor bytes, at::Tensor counts,
                     int64_t block_size, int64_t page_bytes);
void kivi_window_store(at::Tensor k, at::Tensor v, at::Tensor rows, at::Tensor places, at::Tensor window_k,
                       at::Tensor window_v, int64_t layer);
std::vector<int64_t> oaken_store(at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor slots,
                                 std::vector<at::Tensor> k_side, std::vector<at::Tensor> v_side,
                                 std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos, at::Tensor sin);
// InfiniGen's speculation of the tokens a layer's decodes fetch (infinigen_select.cpp), their gather from float
// pools (gather_rows.cpp) and attention over them (fetched_attention.cpp).
void gather_rows(std::vector<at::Tensor> pools, at::Tensor slots, std::vector<at::Tensor> outs);
at::Tensor fetched_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor starts, at::Tensor lengths,
                             double scale);
std::vector<at::Tensor> infinigen_select(at::Tensor q_partial, at::Tensor partial_keys, at::Tensor block_tables,
                                         at::Tensor q_positions, at::Tensor dead, int64_t block, double alpha,
                                         double max_fraction, int64_t recent);
std::vector<at::Tensor> oaken_encode(at::Tensor x, at::Tensor bounds, at::Tensor shift_lo, at::Tensor shift_hi,
                                     at::Tensor slot_of_group, std::vector<int64_t> layout);

}  // namespace kvstrata
