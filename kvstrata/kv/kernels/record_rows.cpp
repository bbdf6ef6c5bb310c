// Per-token records [slots, record_bytes] (kv/formats/records.py; their forms: record_form.h), one item's KV heads of
// a token decoded at a time. K and V are read each in its own form:
//   int8, fp8, fp8_e5m2: value = the code's value * the token's scale, a code's value the int8 integer or the float8
//         (e4m3fn, e5m2) number its bits are;
//   int4: value i in byte i / 2 (the low nibble for even i); value = its group's minimum + code * step.
#include <string>

#include "attend.h"
#include "record_form.h"

namespace kvstrata {

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

// `dim` values of an int4 record from value head_offset on, group after group.
inline void decode_int4(const uint8_t* rec, const RecordLayout& layout, int64_t head_offset, int64_t dim, float* out) {
  const int64_t group_size = layout.group_size;
  for (int64_t d = 0; d < dim;) {
    const int64_t group = (head_offset + d) / group_size;
    const int64_t end = std::min(dim, (group + 1) * group_size - head_offset);
    const uint8_t* params = rec + layout.code_bytes + 4 * group;
    const float low = half_at(params), step = half_at(params + 2);
    if ((head_offset + d) % 2 == 0 && (end - d) % 2 == 0) {  // whole bytes
      widen_nibbles(rec + (head_offset + d) / 2, (end - d) / 2, low, step, out + d);
      d = end;
    }
    for (; d < end; ++d) out[d] = low + nibble_at(rec, head_offset + d) * step;
  }
}

// `dim` values of a scaled-byte record (int8, fp8, fp8_e5m2) from value head_offset on.
inline void decode_scaled_bytes(const uint8_t* rec, const RecordLayout& layout, int64_t head_offset, int64_t dim,
                                float* out) {
  const float scale = half_at(rec + layout.width);
  if (layout.form == RecordForm::kInt8) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(rec) + head_offset;
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(codes[d]) * scale;
  } else {
    const bool e5m2 = layout.form == RecordForm::kFloat8E5M2;
    widen_float8(rec + head_offset, dim, e5m2, e5m2 ? scale : scale * kE4M3Gap, out);
  }
}

// One side's records (K's or V's) in its form.
struct RecordSide {
  const uint8_t* records;
  RecordLayout layout;
  const uint8_t* record(int64_t slot) const { return records + slot * layout.record_bytes; }
  void decode(int64_t slot, int64_t head_offset, int64_t dim, float* out) const {
    if (layout.form == RecordForm::kInt4) {
      decode_int4(record(slot), layout, head_offset, dim, out);
    } else {
      decode_scaled_bytes(record(slot), layout, head_offset, dim, out);
    }
  }
};

// The reader of an item: its KV heads' `dim` values from head_offset in a token, K and V each from its own side.
struct RecordRows {
  RecordSide k, v;
  const int64_t* table;
  BlockSlots slots;
  int64_t dim, head_offset;
  void key(int64_t t, float* out) const { k.decode(slots.of(table, t), head_offset, dim, out); }
  void value(int64_t t, float* out) const { v.decode(slots.of(table, t), head_offset, dim, out); }
  void prefetch(bool keys, int64_t t) const {
    const RecordSide& side = keys ? k : v;
    prefetch_bytes(side.record(slots.of(table, t)), side.layout.record_bytes);
  }
};

// The readers of an item (make_rows for `run` and `read_rows`), once both sides' records are checked.
static auto record_rows(const at::Tensor& k_records, const at::Tensor& v_records, int64_t block, int64_t kv_heads,
                        int64_t dim, const std::string& k_form, int64_t k_group, const std::string& v_form,
                        int64_t v_group, const char* what) {
  const int64_t width = kv_heads * dim;
  RecordSide sides[2];
  const at::Tensor* records[2] = {&k_records, &v_records};
  const std::string* forms[2] = {&k_form, &v_form};
  const int64_t groups[2] = {k_group, v_group};
  for (int side = 0; side < 2; ++side) {
    const at::Tensor& r = *records[side];
    const RecordLayout layout = record_layout(*forms[side], width, groups[side], what);
    TORCH_CHECK(r.scalar_type() == at::kByte && r.is_contiguous() && r.dim() == 2, what, ": ", side ? "V" : "K",
                " records must be contiguous uint8 [slots, record_bytes]");
    TORCH_CHECK(r.size(1) == layout.record_bytes, what, ": ", side ? "V" : "K", " records of ", r.size(1),
                " bytes, ", *forms[side], "'s are ", layout.record_bytes);
    sides[side] = {r.data_ptr<uint8_t>(), layout};
  }
  TORCH_CHECK(k_records.size(0) == v_records.size(0), what, ": K and V records of different slot counts");
  TORCH_CHECK(block > 0 && k_records.size(0) % block == 0, what, ": slots must fill whole blocks");
  const RecordSide k = sides[0], v = sides[1];
  return [=](const int64_t* table, int64_t h, int64_t row_heads) {
    return RecordRows{k, v, table, BlockSlots{block}, row_heads * dim, h * dim};
  };
}

at::Tensor paged_decode_attention_records(at::Tensor q, at::Tensor k_records, at::Tensor v_records,
                                          at::Tensor block_tables, at::Tensor context_lens, int64_t block,
                                          int64_t kv_heads, std::string k_form, int64_t k_group, std::string v_form,
                                          int64_t v_group, double scale, int64_t min_shared_tokens, int64_t window) {
  const auto rows = record_rows(k_records, v_records, block, kv_heads, q.size(2), k_form, k_group, v_form, v_group,
                                "paged_decode_attention_records");
  return run(q, block_tables, context_lens, kv_heads, block, k_records.size(0) / block, scale, rows, true,
             min_shared_tokens, window);
}

std::vector<at::Tensor> paged_read_records(at::Tensor k_records, at::Tensor v_records, at::Tensor block_tables,
                                           at::Tensor context_lens, int64_t block, int64_t kv_heads, int64_t dim,
                                           std::string k_form, int64_t k_group, std::string v_form, int64_t v_group) {
  const auto rows = record_rows(k_records, v_records, block, kv_heads, dim, k_form, k_group, v_form, v_group,
                                "paged_read_records");
  return read_rows(block_tables, context_lens, kv_heads, dim, block, k_records.size(0) / block, rows);
}

}  // namespace kvstrata
