// Dense bfloat16 weights from torch's CPU int4 packing, for products of many rows (prefill chunks), where
// oneDNN's bfloat16 GEMM outruns the int4 kernel by more than the cost of widening a layer's weights per call.
//
// `packed` is what aten::_convert_weight_to_int4pack_for_cpu returns for N output rows (a multiple of 64) and
// K input columns: bytes [N / 64, K, 32], the low nibble of byte j the code of row 64 b + j, the high nibble
// that of row 64 b + 32 + j (model/int4_dense.py checks this layout against the packing op before use).
// `scale_zero` is the kernel's [K / group, N, 2]; a weight is (q - 8) * scale + zero, as the kernel computes it.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstring>

namespace kvstrata {

namespace {

constexpr int64_t kRows = 64;     // rows of one packed block
constexpr int64_t kColumns = 32;  // columns widened together: a tile of 64 x 32 codes, read as 1 KiB in a row

// float32 -> bfloat16, rounding to nearest even (weights are finite); integer ops, so the loop vectorizes
inline uint16_t to_bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

}  // namespace

torch::Tensor int4pack_to_bfloat16(torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size, torch::Tensor out) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(), "packed: uint8 [N, K/2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n % kRows == 0, "packed: N must be a multiple of 64, got ", n);
  TORCH_CHECK(group_size > 0 && group_size % kColumns == 0 && k % group_size == 0,
              "group_size must be a multiple of 32 that divides K, got ", group_size);
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == k / group_size && scale_zero.size(1) == n &&
              scale_zero.size(2) == 2, "scale_zero: [K / group, N, 2]");
  const auto params = scale_zero.to(torch::kFloat32).contiguous();  // [K / group, N, 2]
  TORCH_CHECK(out.dtype() == torch::kBFloat16 && out.is_contiguous() && out.size(0) == n && out.size(1) == k,
              "out: bfloat16 [N, K]");
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const float* p = params.data_ptr<float>();
  auto* w = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t tiles_per_block = k / kColumns;
  at::parallel_for(0, n / kRows * tiles_per_block, 4, [&](int64_t begin, int64_t end) {
    float tile[kRows][kColumns];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / tiles_per_block, first = (t % tiles_per_block) * kColumns;
      for (int64_t c = 0; c < kColumns; ++c) {
        const uint8_t* bytes = codes + (block * k + first + c) * 32;
        for (int64_t j = 0; j < 32; ++j) {
          tile[j][c] = static_cast<float>(bytes[j] & 15) - 8.0f;
          tile[32 + j][c] = static_cast<float>(bytes[j] >> 4) - 8.0f;
        }
      }
      const float* group = p + (first / group_size) * n * 2;
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = block * kRows + r;
        const float scale = group[2 * row], zero = group[2 * row + 1];
        uint16_t* dst = w + row * k + first;
        for (int64_t c = 0; c < kColumns; ++c) dst[c] = to_bfloat16_bits(tile[r][c] * scale + zero);
      }
    }
  });
  return out;
}

}  // namespace kvstrata

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4pack_to_bfloat16", &kvstrata::int4pack_to_bfloat16,
        "dense bfloat16 weights [N, K] from torch's CPU int4 packing and its (scale, zero) pairs");
}
