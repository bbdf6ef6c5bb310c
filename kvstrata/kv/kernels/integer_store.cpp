// The int8 and int4 formats' store of one layer's new K and V in one call (Int8Format / Int4Format.store_in_place):
// each token encoded as kv/formats/integer.py encodes it, with the same bytes, and its record written at its slot.
// The torch path runs dozens of small torch operators per side on this in every layer.
//
// int8: scale = absmax / 127 rounded up to float16, code = round(value / scale) in [-127, 127].
// int4, per group of `group_size` values: minimum rounded down to float16, step = (maximum - minimum) / 15 rounded
// up, code = round((value - minimum) / step) in [0, 15]; where the width is odd, the last byte's high nibble holds
// the last value's code again (the torch path pads the last group with copies of its last value).
// Every rounding is the torch path's: float32 arithmetic, no fused multiply-add, round half to even. A token whose
// parameters float16 cannot hold gets NaN parameters and zero codes (it decodes to NaN, as from the torch path).
#include "float16_params.h"

#include "attend.h"

namespace kvstrata {

namespace {

constexpr float kInt8Levels = 127.0f;
constexpr float kInt4Levels = 15.0f;

void encode_int8(const float* x, int64_t width, uint8_t* record) {
  float absmax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < width; ++i) {
    nan |= std::isnan(x[i]);
    absmax = std::max(absmax, std::abs(x[i]));
  }
  const uint16_t scale = nan ? kHalfNaN : half_up(absmax / kInt8Levels);
  const float value = half_value(scale), safe = value > 0 ? value : 1.0f;
  for (int64_t i = 0; i < width; ++i) {
    const float code = half_finite(scale) ? std::clamp(std::nearbyint(x[i] / safe), -kInt8Levels, kInt8Levels) : 0;
    record[i] = static_cast<uint8_t>(static_cast<int8_t>(code));
  }
  std::memcpy(record + width, &scale, sizeof(scale));
}

void encode_int4(const float* x, int64_t width, int64_t group_size, uint8_t* record) {
  const int64_t code_bytes = (width + 1) / 2;
  std::fill(record, record + code_bytes, 0);
  uint8_t last_code = 0;
  for (int64_t first = 0, group = 0; first < width; first += group_size, ++group) {
    const int64_t end = std::min(width, first + group_size);
    float low = INFINITY, high = -INFINITY;
    bool nan = false;
    for (int64_t i = first; i < end; ++i) {
      nan |= std::isnan(x[i]);
      low = std::min(low, x[i]);
      high = std::max(high, x[i]);
    }
    const uint16_t minimum = nan ? kHalfNaN : half_down(low);
    const uint16_t step = half_up((high - half_value(minimum)) / kInt4Levels);
    const float minimum_value = half_value(minimum), step_value = half_value(step);
    const bool finite = half_finite(minimum) && half_finite(step);
    const float safe = step_value > 0 ? step_value : 1.0f;
    for (int64_t i = first; i < end; ++i) {
      const float code = finite ? std::clamp(std::nearbyint((x[i] - minimum_value) / safe), 0.0f, kInt4Levels) : 0;
      last_code = static_cast<uint8_t>(code);
      record[i / 2] |= last_code << (4 * (i % 2));
    }
    uint8_t* params = record + code_bytes + 4 * group;
    std::memcpy(params, &minimum, sizeof(minimum));
    std::memcpy(params + 2, &step, sizeof(step));
  }
  if (width % 2) record[code_bytes - 1] |= last_code << 4;
}

}  // namespace

void integer_store(at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor k_records, at::Tensor v_records,
                   int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 8 || (bits == 4 && group_size > 0), "integer_store: bits ", bits, " and group size ",
              group_size, "; 8, or 4 with a positive group size");
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 2 && k.sizes() == v.sizes() &&
                  v.scalar_type() == at::kFloat, "integer_store: K and V must be float32 [n, width] alike");
  const int64_t n = k.size(0), width = k.size(1);
  const int64_t record_bytes = bits == 8 ? width + 2 : (width + 1) / 2 + 4 * ((width + group_size - 1) / group_size);
  for (const at::Tensor& records : {k_records, v_records}) {
    TORCH_CHECK(records.scalar_type() == at::kByte && records.is_contiguous() && records.dim() == 2 &&
                    records.size(1) == record_bytes,
                "integer_store: records must be contiguous uint8 [slots, ", record_bytes, "]");
  }
  TORCH_CHECK(k_records.size(0) == v_records.size(0), "integer_store: K and V records of different sizes");
  const at::Tensor slot_values = slots.to(at::kLong).contiguous();
  TORCH_CHECK(slot_values.numel() == n, "integer_store: one slot per token, got ", slot_values.numel(), " for ", n);
  const int64_t* slot = slot_values.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {  // before anything is written
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_records.size(0), "integer_store: slot ", slot[t], " is outside the ",
                k_records.size(0), " slots");
  }
  const at::Tensor k_values = k.contiguous(), v_values = v.contiguous();
  const float* xs[2] = {k_values.data_ptr<float>(), v_values.data_ptr<float>()};
  uint8_t* outs[2] = {k_records.data_ptr<uint8_t>(), v_records.data_ptr<uint8_t>()};
  at::parallel_for(0, 2 * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {  // item: token item / 2, K (even) or V (odd)
      const int64_t t = item / 2, side = item % 2;
      uint8_t* record = outs[side] + slot[t] * record_bytes;
      if (bits == 8) {
        encode_int8(xs[side] + t * width, width, record);
      } else {
        encode_int4(xs[side] + t * width, width, group_size, record);
      }
    }
  });
}

}  // namespace kvstrata
