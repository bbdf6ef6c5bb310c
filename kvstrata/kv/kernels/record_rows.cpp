// Per-token records [slots, record_bytes] (kv/formats/scaled_bytes.py, integer.py), one item's KV heads of a token
// decoded at a time:
//   int8, fp8, fp8_e5m2: kv_heads * dim one-byte codes, then the token's float16 scale: value = code's value * scale,
//         a code's value the int8 integer or the float8 (e4m3fn, e5m2) number its bits are;
//   int4: ceil(width / 2) bytes of nibbles (value i in byte i / 2, the low nibble for even i), then per group
//         of `group_size` values a float16 (minimum, step): value = minimum + code * step.
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

// What the codes of a scaled-byte record are.
enum class ByteCode { kInt8, kFloat8E4M3, kFloat8E5M2 };

static ByteCode byte_code(const std::string& code, const char* what) {
  if (code == "int8") return ByteCode::kInt8;
  if (code == "fp8") return ByteCode::kFloat8E4M3;
  TORCH_CHECK(code == "fp8_e5m2", what, ": codes '", code, "'; int8, fp8 or fp8_e5m2");
  return ByteCode::kFloat8E5M2;
}

// A float8 code as the bits of a float16: e5m2 is float16's upper byte; e4m3fn's sign, exponent and mantissa moved
// into float16's places give its value / 2^8 (float16's exponent bias is 8 more than e4m3fn's), subnormals
// included. (e4m3fn's NaN codes read as +-480 x scale; the encoder writes them only for a token holding a NaN,
// whose scale is then NaN too.)
constexpr float kE4M3Gap = 256.0f;

inline __m128i float8_as_halves(__m128i codes, bool e5m2) {  // 8 codes widened to 16 bits each
  if (e5m2) return _mm_slli_epi16(codes, 8);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x80)), 8);
  return _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x7f)), 7));
}

// n float8 codes times `factor` (the token's scale, times 2^8 for e4m3fn), eight at a time.
inline void widen_float8(const uint8_t* codes, int64_t n, bool e5m2, float factor, float* out) {
  const __m256 factors = _mm256_set1_ps(factor);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d)));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(float8_as_halves(wide, e5m2)), factors));
  }
  for (; d < n; ++d) {
    const uint16_t half = _mm_extract_epi16(float8_as_halves(_mm_cvtsi32_si128(codes[d]), e5m2), 0);
    out[d] = _cvtsh_ss(half) * factor;
  }
}

struct ScaledByteRows : RecordRows {
  int64_t width;  // codes per record; the scale follows them
  ByteCode code;
  void decode(const uint8_t* records, int64_t t, float* out) const {
    const uint8_t* rec = record(records, t);
    const float scale = half_at(rec + width);
    if (code == ByteCode::kInt8) {
      const int8_t* codes = reinterpret_cast<const int8_t*>(rec) + head_offset;
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(codes[d]) * scale;
    } else {
      const bool e5m2 = code == ByteCode::kFloat8E5M2;
      widen_float8(rec + head_offset, dim, e5m2, e5m2 ? scale : scale * kE4M3Gap, out);
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
  const ByteCode codes = byte_code(code, what);
  const int64_t width = kv_heads * dim, record_bytes = width + 2;
  check_records(k_records, v_records, block, record_bytes, what);
  const uint8_t* k = k_records.data_ptr<uint8_t>();
  const uint8_t* v = v_records.data_ptr<uint8_t>();
  return [=](const int64_t* table, int64_t h, int64_t row_heads) {
    return ScaledByteRows{{k, v, table, BlockSlots{block}, row_heads * dim, record_bytes, h * dim}, width, codes};
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
