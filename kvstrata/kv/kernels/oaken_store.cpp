// Oaken's store of one layer's new K and V in one call (OakenFormat.store_in_place): keys put in the form Oaken
// quantizes (rotated back where keys are quantized before RoPE; the model's mean key subtracted, rotated to each
// key's position where they are quantized after it), both sides encoded (oaken_encode.cpp), their records written
// at the slots and their outliers appended to the sparse pages (sparse_write.cpp). The torch path spends a dozen
// calls per layer on this; every rounding here is its own, so the cache holds the same bytes.
//
// k, v float32 [n, width]; positions, slots int64 [n]; each side [records uint8 [slots, record], the 7 tensors of
// a sparse-page layer (sparse_write.h), bounds, shift lo, shift hi, slot of group (the encoder's tables)]; layout
// [groups, dense group, dense group shifted, float16 outliers, block size, page bytes, center keys (0 no, 1 the mean
// as it is, 2 the mean rotated to the position), rotate keys back]; key_mean float32 [width]; cos, sin float32
// [positions, head_dim], RoPE's tables. Returns each side's shortfall of free pages [k, v]: nothing is written
// unless both are 0 (the caller grows the pools and calls again); [-1, -1] where a value leaves float16's range
// (nothing written: the torch path then raises the clear error).
#include "oaken_encode.h"
#include "sparse_write.h"

#include "attend.h"

namespace kvstrata {

namespace {

// The keys [n, width] as Oaken quantizes them; the same operations in the same order as OakenFormat._quantized_key
// (apply_rope: x * cos + rotate_half(x) * sin, each product rounded on its own).
std::vector<float> quantized_keys(const float* k, const int64_t* positions, int64_t n, int64_t width,
                                  int64_t center, bool rotate_back, const float* mean, const float* cos,
                                  const float* sin, int64_t dim) {
  std::vector<float> out(k, k + n * width), y(dim);
  const int64_t half = dim / 2;
  const bool positional = center == 2 || rotate_back;
  for (int64_t t = 0; t < n; ++t) {
    const float* c = positional ? cos + positions[t] * dim : nullptr;
    const float* s = positional ? sin + positions[t] * dim : nullptr;
    for (int64_t head = 0; head < width / dim; ++head) {
      float* x = out.data() + t * width + head * dim;
      const float* m = center != 0 ? mean + head * dim : nullptr;
      if (rotate_back) {  // undo_rope: the rotation by the opposite angles
        std::copy(x, x + dim, y.begin());
        for (int64_t d = 0; d < half; ++d) x[d] = product(y[d], c[d]) + product(y[d + half], s[d]);
        for (int64_t d = half; d < dim; ++d) x[d] = product(y[d], c[d]) - product(y[d - half], s[d]);
      }
      if (center == 1) {
        for (int64_t d = 0; d < dim; ++d) x[d] -= m[d];
      } else if (center == 2) {  // the mean key rotated to the position
        for (int64_t d = 0; d < half; ++d) x[d] -= product(m[d], c[d]) - product(m[d + half], s[d]);
        for (int64_t d = half; d < dim; ++d) x[d] -= product(m[d], c[d]) + product(m[d - half], s[d]);
      }
    }
  }
  return out;
}

// One side's encoded tokens.
struct Encoded {
  std::vector<uint8_t> dense, sparse;
  std::vector<int64_t> counts;
};

}  // namespace

std::vector<int64_t> oaken_store(at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor slots,
                                 std::vector<at::Tensor> k_side, std::vector<at::Tensor> v_side,
                                 std::vector<int64_t> layout, at::Tensor key_mean, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(layout.size() == 8 && k_side.size() == 12 && v_side.size() == 12,
              "oaken_store: a layout of 8 numbers and 12 tensors per side");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 2 &&
                  k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous(),
              "oaken_store: k and v must be contiguous float32 [tokens, width] alike");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slots.is_contiguous() && positions.numel() == k.size(0) &&
                  slots.numel() == k.size(0),
              "oaken_store: one int64 position and slot per token");
  const int64_t n = k.size(0), width = k.size(1), block_size = layout[4], page_bytes = layout[5];
  const int64_t center = layout[6];
  const bool rotate_back = layout[7] != 0;
  const int64_t* position = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* keys = k.data_ptr<float>();
  std::vector<float> centered;
  if (center != 0 || rotate_back) {
    TORCH_CHECK(center == 0 || (key_mean.scalar_type() == at::kFloat && key_mean.is_contiguous() &&
                                key_mean.numel() == width),
                "oaken_store: the mean key must be float32 [width]");
    const bool positional = center == 2 || rotate_back;
    const int64_t dim = positional ? cos.size(-1) : width;
    if (positional) {
      TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                      cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && dim % 2 == 0 &&
                      width % dim == 0,
                  "oaken_store: cos and sin must be float32 [positions, head_dim]");
      for (int64_t t = 0; t < n; ++t) {
        TORCH_CHECK(position[t] >= 0 && position[t] < cos.size(0), "oaken_store: position ", position[t],
                    " beyond RoPE's tables of ", cos.size(0));
      }
    }
    centered = quantized_keys(keys, position, n, width, center, rotate_back,
                              center != 0 ? key_mean.data_ptr<float>() : nullptr,
                              positional ? cos.data_ptr<float>() : nullptr,
                              positional ? sin.data_ptr<float>() : nullptr, dim);
    keys = centered.data();
  }

  std::vector<SparseLayer> pages;
  pages.reserve(2);  // the writes below keep references into it
  std::vector<Encoded> encoded(2);
  const std::vector<at::Tensor>* sides[2] = {&k_side, &v_side};
  const float* inputs[2] = {keys, v.data_ptr<float>()};
  for (int side = 0; side < 2; ++side) {
    const std::vector<at::Tensor>& t = *sides[side];
    const OakenEncoder encoder(t[8], t[9], t[10], t[11], layout, width);
    const at::Tensor& records = t[0];
    TORCH_CHECK(records.scalar_type() == at::kByte && records.dim() == 2 && records.is_contiguous() &&
                    records.size(1) == encoder.record_bytes,
                "oaken_store: records must be contiguous uint8 [slots, ", encoder.record_bytes, "]");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < records.size(0), "oaken_store: slot ", slot[i], " out of range");
    }
    Encoded& e = encoded[side];
    e.dense.resize(n * encoder.record_bytes);
    e.counts.resize(n);
    if (!encoder.encode(inputs[side], n, e.dense.data(), e.sparse, e.counts.data())) return {-1, -1};
    pages.emplace_back(std::vector<at::Tensor>(t.begin() + 1, t.begin() + 8), block_size, page_bytes);
  }
  SparseWrite writes[2] = {SparseWrite(pages[0], slot, encoded[0].counts.data(), n),
                           SparseWrite(pages[1], slot, encoded[1].counts.data(), n)};
  const std::vector<int64_t> short_by = {writes[0].pages_short(), writes[1].pages_short()};
  if (short_by[0] != 0 || short_by[1] != 0) return short_by;
  for (int side = 0; side < 2; ++side) {
    const at::Tensor& records = (*sides[side])[0];
    const int64_t record_bytes = records.size(1);
    uint8_t* rows = records.data_ptr<uint8_t>();
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(rows + slot[i] * record_bytes, encoded[side].dense.data() + i * record_bytes, record_bytes);
    }
    writes[side].apply(encoded[side].sparse.data());
  }
  return short_by;
}

}  // namespace kvstrata
