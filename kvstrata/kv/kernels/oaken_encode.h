// Oaken's per-token encoder (oaken_encode.cpp), shared by the `oaken_encode` binding and the fused store
// (oaken_store.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvstrata {

// a * b rounded on its own, as torch's separate multiply does (the empty asm keeps the compiler from fusing it
// into the addition that follows).
inline float product(float a, float b) {
  float p = a * b;
  asm volatile("" : "+x"(p));
  return p;
}

constexpr int64_t kMaxGroups = 5;  // OakenConfig allows 2 to 5 groups

// One token's values after the encoder's first pass: each value's group, side (all ones on the low side) and the
// value quantized.
struct TokenScratch {
  std::vector<int32_t> group, low;
  std::vector<float> value;
};

struct OakenEncoder {
  // bounds float32 [G-1, 2]; shift_lo / shift_hi float32 [G]; slot_of_group uint8 [G]; layout starts with [G, dense
  // group, dense group shifted, float16 outliers]; `width` values per token. The tensors must outlive the encoder.
  OakenEncoder(at::Tensor bounds, at::Tensor shift_lo, at::Tensor shift_hi, at::Tensor slot_of_group,
               const std::vector<int64_t>& layout, int64_t width);

  // Encodes n tokens [n, width] into n dense records at `out` (overwritten) and appends their sparse entries to
  // `sparse`, each token's count of bytes in token_bytes[t]. False where a value is not finite, or a parameter or a
  // float16 outlier leaves float16's finite range (the torch encoder then raises the clear error).
  bool encode(const float* x, int64_t n, uint8_t* out, std::vector<uint8_t>& sparse, int64_t* token_bytes) const;

  int64_t groups, dense_group, width, record_bytes, entry_bytes;
  bool dense_shifted, fp16;
  const float* b;
  float lo_shift[8] = {}, hi_shift[8] = {};  // per group, padded to the eight lanes a table lookup reads
  const uint8_t* slots;

 private:
  bool group_values(const float* x, TokenScratch& s, double* lo, double* hi) const;
  bool group_params(double* lo, double* hi, uint16_t* mn, uint16_t* st) const;
  bool write_codes(const float* x, const TokenScratch& s, const uint16_t* mn, const uint16_t* st, uint8_t* rec,
                   std::vector<uint8_t>& sparse) const;
};

}  // namespace kvstrata
