// The record formats' store of one layer's new K and V in one call (kv/formats/records.py, store_in_place): each
// token's K and V encoded, each in its side's form (record_form.h), as kv/formats/scaled_bytes.py and integer.py
// encode them, with the same bytes, and written at its slot. The torch path runs dozens of small torch operators per
// side on this in every layer.
//
// int8: scale = absmax / 127 rounded up to float16, code = round(value / scale) in [-127, 127].
// fp8, fp8_e5m2: scale = absmax / the float8 type's largest value (448, 57344) rounded up to float16, code = value /
// scale rounded to the float8 type (to nearest, ties to even), as torch converts float32 to it.
// int4, per group of `group_size` values: minimum rounded down to float16, step = (maximum - minimum) / 15 rounded
// up, code = round((value - minimum) / step) in [0, 15]; where the width is odd, the last byte's high nibble holds
// the last value's code again (the torch path pads the last group with copies of its last value).
// Every rounding is the torch path's: float32 arithmetic, no fused multiply-add, round half to even. A token whose
// parameters float16 cannot hold gets NaN parameters (it decodes to NaN, as from the torch path) and, for int8 and
// int4, zero codes.
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <functional>
#include <string>

#include "float16_params.h"

#include "attend.h"
#include "record_form.h"

namespace kvstrata {

namespace {

constexpr float kInt8Levels = 127.0f;
constexpr float kInt4Levels = 15.0f;

// One byte per value and the token's float16 scale (absmax / code_max, rounded up) after them; code_of(value / scale,
// scale finite) gives a value's byte.
template <typename CodeOf>
void encode_scaled_bytes(const float* x, int64_t width, float code_max, uint8_t* record, CodeOf code_of) {
  float absmax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < width; ++i) {
    nan |= std::isnan(x[i]);
    absmax = std::max(absmax, std::abs(x[i]));
  }
  const uint16_t scale = nan ? kHalfNaN : half_up(absmax / code_max);
  const float value = half_value(scale), safe = value > 0 ? value : 1.0f;
  for (int64_t i = 0; i < width; ++i) record[i] = code_of(x[i] / safe, half_finite(scale));
  std::memcpy(record + width, &scale, sizeof(scale));
}

void encode_int8(const float* x, int64_t width, uint8_t* record) {
  encode_scaled_bytes(x, width, kInt8Levels, record, [](float scaled, bool finite) {
    const float code = finite ? std::clamp(std::nearbyint(scaled), -kInt8Levels, kInt8Levels) : 0;
    return static_cast<uint8_t>(static_cast<int8_t>(code));
  });
}

// A float8 type's codes. Where the scale is NaN, value / 1 is converted as it is: beyond the type's largest value
// torch saturates and this conversion gives NaN (e4m3fn) or infinity (e5m2), and the token decodes to NaN either way.
template <typename Float8>
void encode_float8(const float* x, int64_t width, uint8_t* record) {
  const float code_max = static_cast<float>(std::numeric_limits<Float8>::max());
  encode_scaled_bytes(x, width, code_max, record, [](float scaled, bool) { return Float8(scaled).x; });
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

// The encoder of a token of `layout`'s form, given its values, their number and its record.
std::function<void(const float*, int64_t, uint8_t*)> encoder_of(const RecordLayout& layout) {
  switch (layout.form) {
    case RecordForm::kInt8: return encode_int8;
    case RecordForm::kFloat8E4M3: return encode_float8<c10::Float8_e4m3fn>;
    case RecordForm::kFloat8E5M2: return encode_float8<c10::Float8_e5m2>;
    case RecordForm::kInt4: break;
  }
  const int64_t group_size = layout.group_size;
  return [group_size](const float* x, int64_t width, uint8_t* record) { encode_int4(x, width, group_size, record); };
}

}  // namespace

void record_store(at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor k_records, at::Tensor v_records,
                  std::string k_form, int64_t k_group, std::string v_form, int64_t v_group) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 2 && k.sizes() == v.sizes() &&
                  v.scalar_type() == at::kFloat, "record_store: K and V must be float32 [n, width] alike");
  const int64_t n = k.size(0), width = k.size(1);
  const RecordLayout layouts[2] = {record_layout(k_form, width, k_group, "record_store"),
                                   record_layout(v_form, width, v_group, "record_store")};
  const at::Tensor* records[2] = {&k_records, &v_records};
  for (int side = 0; side < 2; ++side) {
    const at::Tensor& r = *records[side];
    TORCH_CHECK(r.scalar_type() == at::kByte && r.is_contiguous() && r.dim() == 2 &&
                    r.size(1) == layouts[side].record_bytes,
                "record_store: ", side ? "V" : "K", " records must be contiguous uint8 [slots, ",
                layouts[side].record_bytes, "]");
  }
  TORCH_CHECK(k_records.size(0) == v_records.size(0), "record_store: K and V records of different sizes");
  const at::Tensor slot_values = slots.to(at::kLong).contiguous();
  TORCH_CHECK(slot_values.numel() == n, "record_store: one slot per token, got ", slot_values.numel(), " for ", n);
  const int64_t* slot = slot_values.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {  // before anything is written
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_records.size(0), "record_store: slot ", slot[t], " is outside the ",
                k_records.size(0), " slots");
  }
  const at::Tensor k_values = k.contiguous(), v_values = v.contiguous();
  const float* xs[2] = {k_values.data_ptr<float>(), v_values.data_ptr<float>()};
  uint8_t* outs[2] = {k_records.data_ptr<uint8_t>(), v_records.data_ptr<uint8_t>()};
  const std::function<void(const float*, int64_t, uint8_t*)> encoders[2] = {encoder_of(layouts[0]),
                                                                           encoder_of(layouts[1])};
  at::parallel_for(0, 2 * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {  // item: token item / 2, K (even) or V (odd)
      const int64_t t = item / 2, side = item % 2;
      encoders[side](xs[side] + t * width, width, outs[side] + slot[t] * layouts[side].record_bytes);
    }
  });
}

}  // namespace kvstrata
