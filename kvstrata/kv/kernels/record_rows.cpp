// Per-token records [slots, record_bytes] (kv/formats/scaled_bytes.py, integer.py), one item's KV heads of a token
// decoded at a time:
//   int8, fp8, fp8_e5m2: kv_heads * dim one-byte codes, then the token's float16 scale: value = code's value * scale,
//         a code's value the int8 integer or the float8 (e4m3fn, e5m2) number its bits are;
//   int4: ceil(width / 2) bytes of nibbles (value i in byte i / 2, the low nibble for even i), then per group
//         of `group_size` values a float16 (minimum, step): value = minimum + code * step.
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <array>
#include <string>

#include "attend.h"

namespace kvstrata {

// What both readers share: the K and V records of an item's KV heads (`dim` values from head_offset in a token).
struct RecordRows {
  const uint8_t* k;
  const uint8_t* v;
  const int64_t* table;
  BlockSlots slots;
  int64_t dim, record_bytes, head_offset;
  const uint8_t* record(const uint8_t* records, int64_t t) const {
    return records + slots.of(table, t) * record_bytes;
  }
  void prefetch(bool keys, int64_t t) const { prefetch_bytes(record(keys ? k : v, t), record_bytes); }
};

// The value of each of a float8 type's 256 codes, made once.
template <typename Float8>
const float* float8_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table;
    for (int code = 0; code < 256; ++code) {
      table[code] = static_cast<float>(Float8(static_cast<uint8_t>(code), Float8::from_bits()));
    }
    return table;
  }();
  return values.data();
}

// What the codes of a scaled-byte record are: int8 integers (no table), or float8 numbers looked up in a table.
static const float* code_values(const std::string& code, const char* what) {
  if (code == "int8") return nullptr;
  if (code == "fp8") return float8_values<c10::Float8_e4m3fn>();
  if (code == "fp8_e5m2") return float8_values<c10::Float8_e5m2>();
  TORCH_CHECK(false, what, ": codes '", code, "'; int8, fp8 or fp8_e5m2");
}

struct ScaledByteRows : RecordRows {
  int64_t width;  // codes per record; the scale follows them
  const float* values;  // a float8 code's value; nullptr: int8 codes
  void decode(const uint8_t* records, int64_t t, float* out) const {
    const uint8_t* rec = record(records, t);
    const float scale = half_at(rec + width);
    if (values == nullptr) {
      const int8_t* codes = reinterpret_cast<const int8_t*>(rec) + head_offset;
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(codes[d]) * scale;
    } else {
      const uint8_t* codes = rec + head_offset;
      for (int64_t d = 0; d < dim; ++d) out[d] = values[codes[d]] * scale;
    }
  }
  void key(int64_t t, float* out) const { decode(k, t, out); }
  void value(int64_t t, float* out) const { decode(v, t, out); }
};

struct Int4Rows : RecordRows {
  int64_t code_bytes, group_size;  // the groups' (minimum, step) pairs follow the codes
  void decode(const uint8_t* records, int64_t t, float* out) const {
    const uint8_t* rec = record(records, t);
    for (int64_t d = 0; d < dim;) {  // group after group of the row's values
      const int64_t group = (head_offset + d) / group_size;
      const int64_t end = std::min(dim, (group + 1) * group_size - head_offset);
      const float low = half_at(rec + code_bytes + 4 * group), step = half_at(rec + code_bytes + 4 * group + 2);
      if ((head_offset + d) % 2 == 0 && (end - d) % 2 == 0) {  // whole bytes
        widen_nibbles(rec + (head_offset + d) / 2, (end - d) / 2, low, step, out + d);
        d = end;
      }
      for (; d < end; ++d) {
        const int64_t i = head_offset + d;
        out[d] = low + nibble_at(rec, i) * step;
      }
    }
  }
  void key(int64_t t, float* out) const { decode(k, t, out); }
  void value(int64_t t, float* out) const { decode(v, t, out); }
};

static void check_records(const at::Tensor& k, const at::Tensor& v, int64_t block, int64_t record_bytes,
                          const char* what) {
  TORCH_CHECK(k.scalar_type() == at::kByte && v.scalar_type() == at::kByte && k.is_contiguous() &&
                  v.is_contiguous() && k.sizes() == v.sizes() && k.dim() == 2,
              what, ": K and V records must be contiguous uint8 [slots, record_bytes]");
  TORCH_CHECK(k.size(1) == record_bytes, what, ": records of ", k.size(1), " bytes, the format's are ", record_bytes);
  TORCH_CHECK(block > 0 && k.size(0) % block == 0, what, ": slots must fill whole blocks");
}

// The readers of an item (make_rows for `run` and `read_rows`), once the records are checked.
static auto scaled_byte_rows(const at::Tensor& k_records, const at::Tensor& v_records, int64_t block,
                             int64_t kv_heads, int64_t dim, const std::string& code, const char* what) {
  const float* values = code_values(code, what);
  const int64_t width = kv_heads * dim, record_bytes = width + 2;
  check_records(k_records, v_records, block, record_bytes, what);
  const uint8_t* k = k_records.data_ptr<uint8_t>();
  const uint8_t* v = v_records.data_ptr<uint8_t>();
  return [=](const int64_t* table, int64_t h, int64_t row_heads) {
    return ScaledByteRows{{k, v, table, BlockSlots{block}, row_heads * dim, record_bytes, h * dim}, width, values};
  };
}

static auto int4_rows(const at::Tensor& k_records, const at::Tensor& v_records, int64_t block, int64_t kv_heads,
                      int64_t dim, int64_t group_size, const char* what) {
  TORCH_CHECK(group_size > 0, what, ": group size must be positive");
  const int64_t width = kv_heads * dim, code_bytes = (width + 1) / 2;
  const int64_t record_bytes = code_bytes + 4 * ((width + group_size - 1) / group_size);
  check_records(k_records, v_records, block, record_bytes, what);
  const uint8_t* k = k_records.data_ptr<uint8_t>();
  const uint8_t* v = v_records.data_ptr<uint8_t>();
  return [=](const int64_t* table, int64_t h, int64_t row_heads) {
    return Int4Rows{{k, v, table, BlockSlots{block}, row_heads * dim, record_bytes, h * dim}, code_bytes, group_size};
  };
}

at::Tensor paged_decode_attention_scaled_bytes(at::Tensor q, at::Tensor k_records, at::Tensor v_records,
                                               at::Tensor block_tables, at::Tensor context_lens, int64_t block,
                                               int64_t kv_heads, std::string code, double scale,
                                               int64_t min_shared_tokens) {
  const auto rows = scaled_byte_rows(k_records, v_records, block, kv_heads, q.size(2), code,
                                     "paged_decode_attention_scaled_bytes");
  return run(q, block_tables, context_lens, kv_heads, block, k_records.size(0) / block, scale, rows, true,
             min_shared_tokens);
}

at::Tensor paged_decode_attention_int4(at::Tensor q, at::Tensor k_records, at::Tensor v_records,
                                       at::Tensor block_tables, at::Tensor context_lens, int64_t block,
                                       int64_t kv_heads, int64_t group_size, double scale,
                                       int64_t min_shared_tokens) {
  const auto rows =
      int4_rows(k_records, v_records, block, kv_heads, q.size(2), group_size, "paged_decode_attention_int4");
  return run(q, block_tables, context_lens, kv_heads, block, k_records.size(0) / block, scale, rows, true,
             min_shared_tokens);
}

std::vector<at::Tensor> paged_read_scaled_bytes(at::Tensor k_records, at::Tensor v_records, at::Tensor block_tables,
                                                at::Tensor context_lens, int64_t block, int64_t kv_heads, int64_t dim,
                                                std::string code) {
  const auto rows = scaled_byte_rows(k_records, v_records, block, kv_heads, dim, code, "paged_read_scaled_bytes");
  return read_rows(block_tables, context_lens, kv_heads, dim, block, k_records.size(0) / block, rows);
}

std::vector<at::Tensor> paged_read_int4(at::Tensor k_records, at::Tensor v_records, at::Tensor block_tables,
                                        at::Tensor context_lens, int64_t block, int64_t kv_heads, int64_t dim,
                                        int64_t group_size) {
  const auto rows = int4_rows(k_records, v_records, block, kv_heads, dim, group_size, "paged_read_int4");
  return read_rows(block_tables, context_lens, kv_heads, dim, block, k_records.size(0) / block, rows);
}

}  // namespace kvstrata
