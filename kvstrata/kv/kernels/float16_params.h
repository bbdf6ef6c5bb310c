// Quantization parameters kept as float16 bits inside records, rounded as kv/formats/float16_params.py rounds them:
// minimums down and steps up, so that no value falls outside its code range.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace kvstrata {

constexpr uint16_t kHalfNaN = 0x7e00;  // torch's float16 NaN
constexpr double kHalfMax = 65504.0;

// The float16 (as bits) nearest `v` on the side of `up` (at or above) or not (at or below); round_float16 in
// float16_params.py.
inline uint16_t half_toward(double v, bool up) {
  uint16_t bits = c10::Half(static_cast<float>(v)).x;
  const double h = static_cast<double>(static_cast<float>(c10::Half(bits, c10::Half::from_bits())));
  if (up ? h < v : h > v) {  // one step toward the side: magnitude grows away from zero, shrinks toward it
    if ((bits & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    const bool negative = bits & 0x8000;
    bits = negative == up ? bits - 1 : bits + 1;
  }
  return bits;
}

// float16_down / float16_up: half_toward, and NaN where float16 cannot hold `v` (NaN, infinite, beyond ±65504).
inline uint16_t half_down(double v) { return std::abs(v) <= kHalfMax ? half_toward(v, false) : kHalfNaN; }
inline uint16_t half_up(double v) { return std::abs(v) <= kHalfMax ? half_toward(v, true) : kHalfNaN; }

inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }
inline bool half_finite(uint16_t bits) { return (bits & 0x7c00) != 0x7c00; }

}  // namespace kvstrata
