// Oaken's per-token encoder (kv/formats/oaken/codec.py, encode_tokens with scales per token), token after token,
// producing the same bytes: the engine calls it for every layer's K and V of every step, where the torch version's
// ~250 small operations cost about a millisecond per call. A token's values are grouped and quantized eight at a
// time (AVX2); its groups' parameters are worked out one group at a time. Every rounding is the torch version's:
// float32 for the values and codes, float64 for the groups' parameters, float16 minimums rounded down and steps up,
// round half to even; products are kept apart from the sums that follow them (no fused multiply-add, which rounds
// once).
//
// x float32 [N, W]; bounds float32 [G-1, 2] (validated); shift_lo / shift_hi float32 [G] (zero where a group is not
// shifted); slot_of_group uint8 [G]; layout [G, dense group, dense group shifted, float16 outliers].
// Returns (dense uint8 [N, record], sparse uint8 [S], sparse_bytes int64 [N]), or three empty tensors where a
// parameter or a float16 outlier leaves float16's finite range (the torch version then raises the clear error).
#include "oaken_encode.h"

#include "float16_params.h"

#include "attend.h"

#include <cstdint>
#include <limits>
#include <tuple>

namespace kvstrata {

constexpr int64_t kLevels = 15;  // the largest 4-bit code
constexpr int64_t kIndexValues = 64;  // values addressed by one 6-bit index

// _zero_between_codes: the finest grid over [lo, hi] (lo < 0 < hi) with zero halfway between two codes.
inline std::pair<uint16_t, double> zero_between_codes(double lo, double hi) {
  double step = std::numeric_limits<double>::infinity();
  int64_t best = 0;
  for (int64_t c = 0; c < kLevels; ++c) {
    const double s = std::max(-lo / (c + 0.5), hi / (kLevels - 0.5 - c));
    if (s < step) step = s, best = c;
  }
  const uint16_t mn = half_toward(-(best + 0.5) * step, false);
  return {mn, std::max(step, (hi - static_cast<double>(half_value(mn))) / kLevels)};
}

OakenEncoder::OakenEncoder(at::Tensor bounds, at::Tensor shift_lo, at::Tensor shift_hi, at::Tensor slot_of_group,
                           const std::vector<int64_t>& layout, int64_t width) {
  TORCH_CHECK(layout.size() >= 4, "oaken_encode: layout is [groups, dense group, dense shifted, float16 outliers]");
  groups = layout[0], dense_group = layout[1], dense_shifted = layout[2] != 0, fp16 = layout[3] != 0;
  TORCH_CHECK(width > 0 && width % kIndexValues == 0, "oaken_encode: tokens of a multiple of 64 values");
  TORCH_CHECK(groups >= 2 && groups <= kMaxGroups && dense_group >= 0 && dense_group < groups &&
                  bounds.scalar_type() == at::kFloat && bounds.is_contiguous() && bounds.numel() == 2 * (groups - 1) &&
                  shift_lo.scalar_type() == at::kFloat && shift_hi.scalar_type() == at::kFloat &&
                  slot_of_group.scalar_type() == at::kByte && shift_lo.is_contiguous() && shift_hi.is_contiguous() &&
                  slot_of_group.is_contiguous() && shift_lo.numel() == groups && shift_hi.numel() == groups &&
                  slot_of_group.numel() == groups,
              "oaken_encode: tables do not match the group count");
  this->width = width;
  record_bytes = width / 2 + 4 * groups + width / kIndexValues;
  entry_bytes = (groups <= 3 ? 1 : 2) + (fp16 ? 2 : 0);
  b = bounds.data_ptr<float>();
  std::copy_n(shift_lo.data_ptr<float>(), groups, lo_shift);
  std::copy_n(shift_hi.data_ptr<float>(), groups, hi_shift);
  slots = slot_of_group.data_ptr<uint8_t>();
}

namespace {

// a * b in each lane rounded on its own (see `product`).
inline __m256 products(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  asm volatile("" : "+x"(p));
  return p;
}

// Each lane's entry of a per-group table (at most 8 groups).
inline __m256 by_group(const float* table, __m256i group) {
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), group);
}

inline __m256 lanes_of(__m256i mask) { return _mm256_castsi256_ps(mask); }

}  // namespace

// Pass one over a token, eight values at a time: each value's group, side and the value quantized (shifted; the
// magnitude outside the dense group), and each group's range. A range's ends come out as the scalar order of the
// torch encoder gives them: where one is a zero, the sign of the first zero met (min and max keep the earlier of two
// equal values). False where a value is not finite (the torch encoder raises the clear error).
bool OakenEncoder::group_values(const float* x, TokenScratch& s, double* lo, double* hi) const {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256i dense = _mm256_set1_epi32(static_cast<int32_t>(dense_group));
  __m256 lo_lanes[kMaxGroups], hi_lanes[kMaxGroups];
  for (int64_t g = 0; g < groups; ++g) lo_lanes[g] = inf, hi_lanes[g] = _mm256_sub_ps(_mm256_setzero_ps(), inf);
  __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t i = 0; i < width; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_and_ps(xv, magnitude), largest, _CMP_LE_OQ));
    __m256i group = _mm256_setzero_si256();  // the number of boundaries the value lies strictly inside
    for (int64_t k = 0; k < groups - 1; ++k) {
      const __m256 inside = _mm256_and_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(b[2 * k]), _CMP_GT_OQ),
                                          _mm256_cmp_ps(xv, _mm256_set1_ps(b[2 * k + 1]), _CMP_LT_OQ));
      group = _mm256_sub_epi32(group, _mm256_castps_si256(inside));
    }
    const __m256 high_shift = by_group(hi_shift, group);
    const __m256 low = _mm256_cmp_ps(xv, high_shift, _CMP_LT_OQ);
    const __m256 shifted = _mm256_sub_ps(xv, _mm256_blendv_ps(high_shift, by_group(lo_shift, group), low));
    const __m256 v = _mm256_blendv_ps(_mm256_and_ps(shifted, magnitude), shifted,
                                      lanes_of(_mm256_cmpeq_epi32(group, dense)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.group.data() + i), group);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.low.data() + i), _mm256_castps_si256(low));
    _mm256_storeu_ps(s.value.data() + i, v);
    for (int64_t g = 0; g < groups; ++g) {
      if (fp16 && g != dense_group) continue;  // float16 outliers need no params
      const __m256 in = lanes_of(_mm256_cmpeq_epi32(group, _mm256_set1_epi32(static_cast<int32_t>(g))));
      lo_lanes[g] = _mm256_min_ps(_mm256_blendv_ps(inf, v, in), lo_lanes[g]);
      hi_lanes[g] = _mm256_max_ps(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), inf), v, in), hi_lanes[g]);
    }
  }
  if (_mm256_movemask_ps(finite) != 0xff) return false;
  for (int64_t g = 0; g < groups; ++g) {
    float l[8], h[8];
    _mm256_storeu_ps(l, lo_lanes[g]);
    _mm256_storeu_ps(h, hi_lanes[g]);
    float lo_g = l[0], hi_g = h[0];
    for (int j = 1; j < 8; ++j) lo_g = std::min(lo_g, l[j]), hi_g = std::max(hi_g, h[j]);
    if (lo_g == 0 || hi_g == 0) {  // a zero's sign: the first zero of the group's values
      for (int64_t i = 0; i < width; ++i) {
        if (s.group[i] != g || s.value[i] != 0) continue;
        if (lo_g == 0) lo_g = s.value[i];
        if (hi_g == 0) hi_g = s.value[i];
        break;
      }
    }
    lo[g] = lo_g, hi[g] = hi_g;
  }
  return true;
}

// _params: each group's (min, step) as float16 bits, from its range. False where one leaves float16's finite range.
bool OakenEncoder::group_params(double* lo, double* hi, uint16_t* mn, uint16_t* st) const {
  for (int64_t g = 0; g < groups; ++g) {
    if (lo[g] > hi[g]) lo[g] = hi[g] = 0.0;  // an empty group
    mn[g] = half_toward(lo[g], false);
    double step = (hi[g] - static_cast<double>(half_value(mn[g]))) / kLevels;
    if (dense_shifted && g == dense_group && lo[g] < 0 && hi[g] > 0) {
      std::tie(mn[g], step) = zero_between_codes(lo[g], hi[g]);
    }
    st[g] = half_toward(step, true);
    if (!half_finite(mn[g]) || !half_finite(st[g])) return false;
  }
  return true;
}

// Pass two, eight values at a time: codes (nearest, within 0..15; a shifted dense value kept on its side) and the
// sparse entries of the values outside the dense group. False where a float16 outlier leaves float16's range.
bool OakenEncoder::write_codes(const float* x, const TokenScratch& s, const uint16_t* mn, const uint16_t* st,
                               uint8_t* rec, std::vector<uint8_t>& sparse) const {
  float mn_f[8] = {}, st_f[8] = {}, divisor[8] = {};
  for (int64_t g = 0; g < groups; ++g) {
    mn_f[g] = half_value(mn[g]), st_f[g] = half_value(st[g]);
    divisor[g] = st_f[g] > 0 ? st_f[g] : 1.0f;
  }
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 top = _mm256_set1_ps(static_cast<float>(kLevels));
  const __m256i dense = _mm256_set1_epi32(static_cast<int32_t>(dense_group));
  uint8_t* counts = rec + width / 2 + 4 * groups;
  for (int64_t i = 0; i < width; i += 8) {
    const __m256i group = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.group.data() + i));
    const __m256 v = _mm256_loadu_ps(s.value.data() + i);
    const __m256 low = lanes_of(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.low.data() + i)));
    const __m256 mns = by_group(mn_f, group), steps = by_group(st_f, group);
    const __m256 is_dense = lanes_of(_mm256_cmpeq_epi32(group, dense));
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v, mns), by_group(divisor, group)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, zero), top);
    if (dense_shifted) {  // _keep_dense_side
      const __m256 below = _mm256_cmp_ps(_mm256_add_ps(products(q, steps), mns), zero, _CMP_LT_OQ);
      const __m256 up = _mm256_and_ps(is_dense, _mm256_andnot_ps(low, below));
      const __m256 down = _mm256_and_ps(_mm256_and_ps(is_dense, low),
                                        _mm256_andnot_ps(below, _mm256_cmp_ps(q, zero, _CMP_GT_OQ)));
      q = _mm256_sub_ps(_mm256_add_ps(q, _mm256_and_ps(up, one)), _mm256_and_ps(down, one));
    }
    if (fp16) q = _mm256_and_ps(q, is_dense);  // float16 outliers keep code 0
    const __m256i codes = _mm256_cvttps_epi32(q);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    const uint64_t bytes = _mm_cvtsi128_si64(_mm_packus_epi16(words, words));  // code j in byte j
    const uint64_t pairs = (bytes | (bytes >> 4)) & 0x00ff00ff00ff00ffull;  // two codes in every other byte
    for (int j = 0; j < 4; ++j) rec[i / 2 + j] = static_cast<uint8_t>(pairs >> (16 * j));
    for (unsigned outliers = ~_mm256_movemask_ps(is_dense) & 0xffu; outliers; outliers &= outliers - 1) {
      const int64_t at = i + __builtin_ctz(outliers);
      const int32_t g = s.group[at];
      counts[at / kIndexValues] += 1;
      const uint8_t index = at % kIndexValues, high_bit = fp16 ? 0 : s.low[at] != 0;
      if (groups <= 3) {
        sparse.push_back(index | (slots[g] << 6) | (high_bit << 7));
      } else {
        sparse.push_back(index);
        sparse.push_back(slots[g] | (high_bit << 7));
      }
      if (fp16) {
        const uint16_t half = c10::Half(x[at]).x;
        if (!half_finite(half)) return false;
        sparse.push_back(half & 0xff);
        sparse.push_back(half >> 8);
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {  // (min, step) float16 little-endian, group 0 first
    std::memcpy(rec + width / 2 + 4 * g, &mn[g], 2);
    std::memcpy(rec + width / 2 + 4 * g + 2, &st[g], 2);
  }
  return true;
}

bool OakenEncoder::encode(const float* xs, int64_t n, uint8_t* out, std::vector<uint8_t>& sparse,
                          int64_t* token_bytes) const {
  TokenScratch scratch{std::vector<int32_t>(width), std::vector<int32_t>(width), std::vector<float>(width)};
  double lo[kMaxGroups], hi[kMaxGroups];
  uint16_t mn[kMaxGroups], st[kMaxGroups];
  std::memset(out, 0, n * record_bytes);
  for (int64_t t = 0; t < n; ++t) {
    const float* x = xs + t * width;
    const size_t first_entry = sparse.size();
    if (!group_values(x, scratch, lo, hi) || !group_params(lo, hi, mn, st) ||
        !write_codes(x, scratch, mn, st, out + t * record_bytes, sparse)) {
      return false;
    }
    token_bytes[t] = static_cast<int64_t>(sparse.size() - first_entry);
  }
  return true;
}

std::vector<at::Tensor> oaken_encode(at::Tensor x, at::Tensor bounds, at::Tensor shift_lo, at::Tensor shift_hi,
                                     at::Tensor slot_of_group, std::vector<int64_t> layout) {
  TORCH_CHECK(layout.size() == 4, "oaken_encode: layout is [groups, dense group, dense shifted, float16 outliers]");
  x = x.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "oaken_encode: x must be float32 [tokens, width]");
  const OakenEncoder encoder(bounds, shift_lo, shift_hi, slot_of_group, layout, x.size(1));
  const int64_t n = x.size(0);
  auto dense = at::empty({n, encoder.record_bytes}, at::kByte);
  auto sparse_bytes = at::empty({n}, at::kLong);
  std::vector<uint8_t> sparse;
  sparse.reserve(n * encoder.width / 8 * encoder.entry_bytes);
  if (!encoder.encode(x.data_ptr<float>(), n, dense.data_ptr<uint8_t>(), sparse, sparse_bytes.data_ptr<int64_t>())) {
    return {at::empty({0}), at::empty({0}), at::empty({0})};
  }
  auto sparse_out = at::empty({static_cast<int64_t>(sparse.size())}, at::kByte);
  std::memcpy(sparse_out.data_ptr<uint8_t>(), sparse.data(), sparse.size());
  return {dense, sparse_out, sparse_bytes};
}

}  // namespace kvstrata
