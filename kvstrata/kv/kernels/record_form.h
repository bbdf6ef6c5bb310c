// The forms of per-token records that record_store.cpp writes and record_rows.cpp reads (kv/formats/records.py), named
// as the formats are. A cache's K and V may each have their own (a split format, kv/formats/split.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace kvstrata {

enum class RecordForm { kInt8, kFloat8E4M3, kFloat8E5M2, kInt4 };

// One side's (K's or V's) records of `width` values a token:
//   int8, fp8, fp8_e5m2: width one-byte codes, then the token's float16 scale;
//   int4: code_bytes = ceil(width / 2) bytes of nibbles, then per group of group_size values a float16 (minimum, step).
struct RecordLayout {
  RecordForm form;
  int64_t width, group_size, code_bytes, record_bytes;
};

// The layout of `form` ("int8", "fp8", "fp8_e5m2" or "int4", whose group_size must be positive; the others' is
// ignored); `what` names the caller in the error.
inline RecordLayout record_layout(const std::string& form, int64_t width, int64_t group_size, const char* what) {
  if (form == "int4") {
    TORCH_CHECK(group_size > 0, what, ": int4 records need a positive group size, got ", group_size);
    const int64_t code_bytes = (width + 1) / 2;
    return {RecordForm::kInt4, width, group_size, code_bytes, code_bytes + 4 * ((width + group_size - 1) / group_size)};
  }
  RecordForm byte_form = RecordForm::kInt8;
  if (form == "fp8") {
    byte_form = RecordForm::kFloat8E4M3;
  } else if (form == "fp8_e5m2") {
    byte_form = RecordForm::kFloat8E5M2;
  } else {
    TORCH_CHECK(form == "int8", what, ": record form '", form, "'; int8, fp8, fp8_e5m2 or int4");
  }
  return {byte_form, width, 0, width, width + 2};
}

}  // namespace kvstrata
