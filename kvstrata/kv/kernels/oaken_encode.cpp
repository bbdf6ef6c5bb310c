// Oaken's per-token encoder (kv/formats/oaken/codec.py, encode_tokens with scales per token), token after token,
// producing the same bytes: the engine calls it for every layer's K and V of every step, where the torch version's
// ~250 small operations cost about a millisecond per call. Every rounding is the torch version's: float32 for the
// values and codes, float64 for the groups' parameters, float16 minimums rounded down and steps up, round half to
// even; products are kept apart from the sums that follow them (no fused multiply-add, which rounds once).
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
  TORCH_CHECK(groups >= 2 && groups <= 5 && dense_group >= 0 && dense_group < groups &&
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
  lo_shift = shift_lo.data_ptr<float>();
  hi_shift = shift_hi.data_ptr<float>();
  slots = slot_of_group.data_ptr<uint8_t>();
}

bool OakenEncoder::encode(const float* xs_in, int64_t n, uint8_t* out, std::vector<uint8_t>& sparse,
                          int64_t* token_bytes) const {
  std::vector<int64_t> group(width);
  std::vector<uint8_t> low(width), codes(width);
  std::vector<float> v(width);
  std::vector<uint16_t> mn(groups), st(groups);
  std::vector<float> mn_f(groups), st_f(groups);
  std::vector<double> lo(groups), hi(groups);
  std::memset(out, 0, n * record_bytes);
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = xs_in + t * width;
    std::fill(lo.begin(), lo.end(), std::numeric_limits<double>::infinity());
    std::fill(hi.begin(), hi.end(), -std::numeric_limits<double>::infinity());
    for (int64_t i = 0; i < width; ++i) {  // group, side, shifted value, and each group's range
      int64_t g = 0;
      for (int64_t k = 0; k < groups - 1; ++k) g += xt[i] > b[2 * k] && xt[i] < b[2 * k + 1];
      group[i] = g;
      low[i] = xt[i] < hi_shift[g];
      const float shifted = xt[i] - (low[i] ? lo_shift[g] : hi_shift[g]);
      v[i] = g == dense_group ? shifted : std::fabs(shifted);
      if (fp16 && g != dense_group) continue;  // float16 outliers need no params
      lo[g] = std::min(lo[g], static_cast<double>(v[i]));
      hi[g] = std::max(hi[g], static_cast<double>(v[i]));
    }
    for (int64_t g = 0; g < groups; ++g) {  // _params
      if (lo[g] > hi[g]) lo[g] = hi[g] = 0.0;  // an empty group
      mn[g] = half_toward(lo[g], false);
      double step = (hi[g] - static_cast<double>(half_value(mn[g]))) / kLevels;
      if (dense_shifted && g == dense_group && lo[g] < 0 && hi[g] > 0) {
        std::tie(mn[g], step) = zero_between_codes(lo[g], hi[g]);
      }
      st[g] = half_toward(step, true);
      if (!half_finite(mn[g]) || !half_finite(st[g])) return false;
      mn_f[g] = half_value(mn[g]);
      st_f[g] = half_value(st[g]);
    }
    uint8_t* rec = out + t * record_bytes;
    uint8_t* counts = rec + width / 2 + 4 * groups;
    const size_t first_entry = sparse.size();
    for (int64_t i = 0; i < width; ++i) {
      const int64_t g = group[i];
      const bool is_dense = g == dense_group;
      float q = std::nearbyint((v[i] - mn_f[g]) / (st_f[g] > 0 ? st_f[g] : 1.0f));
      q = std::min(std::max(q, 0.0f), static_cast<float>(kLevels));
      if (dense_shifted && is_dense) {  // _keep_dense_side
        const float decoded = product(q, st_f[g]) + mn_f[g];
        if (!low[i] && decoded < 0) q += 1;
        else if (low[i] && decoded >= 0 && q > 0) q -= 1;
      }
      codes[i] = is_dense || !fp16 ? static_cast<uint8_t>(q) : 0;
      rec[i / 2] |= codes[i] << (4 * (i % 2));
      if (is_dense) continue;
      counts[i / kIndexValues] += 1;
      const uint8_t index = i % kIndexValues, high_bit = fp16 ? 0 : low[i];
      if (groups <= 3) {
        sparse.push_back(index | (slots[g] << 6) | (high_bit << 7));
      } else {
        sparse.push_back(index);
        sparse.push_back(slots[g] | (high_bit << 7));
      }
      if (fp16) {
        const uint16_t half = c10::Half(xt[i]).x;
        if (!half_finite(half)) return false;
        sparse.push_back(half & 0xff);
        sparse.push_back(half >> 8);
      }
    }
    for (int64_t g = 0; g < groups; ++g) {  // (min, step) float16 little-endian, group 0 first
      std::memcpy(rec + width / 2 + 4 * g, &mn[g], 2);
      std::memcpy(rec + width / 2 + 4 * g + 2, &st[g], 2);
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
