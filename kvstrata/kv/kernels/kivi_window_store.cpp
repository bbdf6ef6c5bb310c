// KIVI's store of one layer's new K and V rows into its float16 window (KiviPagedKVCache.store): both sides in one
// call, where the torch path converts each side and writes it through advanced indexing, several operators per side
// in every layer of every step. Rounding to float16 is torch's (nearest, ties to even).
//
// k, v float32 [n, width]; rows int64 [m], the rows of k and v that go to the window (empty: all n, in order);
// places int64 [m], each one's row in the layer's window [window_slots * block, width]; window_k, window_v float16
// [layers, window_slots, block, width].
#include "attend.h"

namespace kvstrata {

void kivi_window_store(at::Tensor k, at::Tensor v, at::Tensor rows, at::Tensor places, at::Tensor window_k,
                       at::Tensor window_v, int64_t layer) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 2 && k.sizes() == v.sizes() && k.is_contiguous() &&
                  v.is_contiguous() && v.scalar_type() == at::kFloat,
              "kivi_window_store: k and v must be contiguous float32 [tokens, width] alike");
  TORCH_CHECK(window_k.scalar_type() == at::kHalf && window_k.dim() == 4 && window_k.sizes() == window_v.sizes() &&
                  window_k.is_contiguous() && window_v.is_contiguous() && window_k.size(3) == k.size(1) &&
                  layer >= 0 && layer < window_k.size(0),
              "kivi_window_store: the window must be contiguous float16 [layers, window_slots, block, width] and "
              "hold layer ", layer);
  TORCH_CHECK(places.scalar_type() == at::kLong && places.is_contiguous() && rows.scalar_type() == at::kLong &&
                  rows.is_contiguous() && (rows.numel() == 0 ? places.numel() == k.size(0)
                                                             : rows.numel() == places.numel()),
              "kivi_window_store: one int64 window place per row written");
  const int64_t width = k.size(1), layer_rows = window_k.size(1) * window_k.size(2), n = places.numel();
  const int64_t* place = places.data_ptr<int64_t>();
  const int64_t* row = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {  // before anything is written
    TORCH_CHECK(place[i] >= 0 && place[i] < layer_rows, "kivi_window_store: window place ", place[i],
                " is outside the layer's ", layer_rows, " rows");
    TORCH_CHECK(!row || (row[i] >= 0 && row[i] < k.size(0)), "kivi_window_store: row out of range");
  }
  const float* sides[2] = {k.data_ptr<float>(), v.data_ptr<float>()};
  at::Half* windows[2] = {window_k.data_ptr<at::Half>() + layer * layer_rows * width,
                          window_v.data_ptr<at::Half>() + layer * layer_rows * width};
  for (int side = 0; side < 2; ++side) {
    for (int64_t i = 0; i < n; ++i) {
      const float* from = sides[side] + (row ? row[i] : i) * width;
      at::Half* to = windows[side] + place[i] * width;
      int64_t d = 0;
      for (; d + 8 <= width; d += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(to + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(from + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      for (; d < width; ++d) to[d] = static_cast<at::Half>(from[d]);
    }
  }
}

}  // namespace kvstrata
