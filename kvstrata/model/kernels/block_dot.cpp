// Products of a few rows (decode steps) over weights kept in GGUF-style blocks of 32 columns, by integer dot
// products, as llama.cpp computes them: each row of the activations is quantized per block of 32 to int8 codes
// with one float scale, and a block's product is one integer dot product of the weight codes with those codes.
//
// Why not torch's int4 kernel: it widens every weight to float before multiplying, which bounds a batch-1 decode
// step on a 2-core CPU by arithmetic (about 25 G weights/s here); an integer dot product handles 32 weights in a
// handful of instructions, so the step is left to the memory's bandwidth.
//
// Weights (model/block_weights.py lays them out):
//   4-bit: codes uint8 [N, K / 2], block b of row n in bytes [16 b, 16 b + 16): byte j holds the code of column
//          32 b + j in its low nibble and of column 32 b + 16 + j in its high one (GGUF's Q4_1 order);
//          a weight is code * scale + min.
//   8-bit: codes int8 [N, K]; a weight is code * scale (GGUF's Q8_0).
//   scales, mins: float32 [N, K / 32], or float16 where every value is one (GGUF stores them so): a 4-bit weight
//          then reads 0.625 byte instead of 0.75, and a decode step is bound by the bytes it reads.
// With x's block quantized as dx * qx: sum_j w_j x_j = scale dx (codes . qx) + min dx (sum of qx).
//
// Without AVX-512 VNNI, products of kWidenedFromRows rows or more go to widened_rows.cpp instead (float32
// multiply-adds over each weight row widened once), which outruns these dot products there from 4 rows.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "block_product.h"
#include "widen_blocks.h"

namespace kvstrata {

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsTogether = 4;  // activation rows that share one read of a weight block
constexpr int64_t kPrefetchRows = 32;  // weight rows read ahead of the product
// from this many rows the AVX2 path's products run widened (widened_rows.cpp; on a 2-core AMD EPYC 1.16x the dot
// products' rate at 4 rows, 1.7-2.5x from 8, slower at 1 and 2: docs/BENCHMARKS.md)
constexpr int64_t kWidenedFromRows = 4;

// Each row of activations as int8 codes per block of 32, in the order the weights' codes are read:
//   after 4-bit weights: per group of four blocks, 64 bytes of columns 0-15 of each block, then 64 of columns
//     16-31 (the low and high nibbles of the weights' bytes); a last group of fewer blocks padded with zeros;
//   after 8-bit weights: columns in order.
struct QuantizedRows {
  int64_t row_stride;          // bytes of codes per row
  std::vector<int8_t> codes;   // [M, row_stride]
  std::vector<float> scales;   // [M, K / 32]: dx
  std::vector<float> sums;     // [M, K / 32]: dx * (sum of the block's codes)
};

// The byte of column j of block `block` in its row's codes.
int64_t code_position(int bits, int64_t block, int64_t j) {
  if (bits == 8) return block * kBlock + j;
  return (block / 4) * 128 + (j / 16) * 64 + (block % 4) * 16 + j % 16;
}

// Raw pointers only below the target pragma: an inline function of a library type instantiated there could be
// emitted with AVX-512 instructions and then shared with the AVX2 path.
struct Activations {
  const int8_t* codes;
  int64_t row_stride;
  const float* scales;
  const float* sums;

  // the code of column `column` of block `block` in row `row`, after weights of `bits` bits
  const int8_t* at(int64_t row, int bits, int64_t block, int64_t column) const {
    return codes + row * row_stride + code_position(bits, block, column);
  }
};

}  // namespace

// The product loop, built twice: AVX-512 VNNI dot products where the CPU has them, AVX2 multiply-adds elsewhere.
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl,avx512bw,avx512dq,avx512f")
namespace avx512 {
#include "block_rows_avx512.h"
#include "block_rows.h"
}  // namespace avx512
#pragma GCC pop_options

namespace avx2 {
#include "block_rows_avx2.h"
#include "block_rows.h"
}  // namespace avx2

namespace {

// Tests turn the AVX-512 path off to check the AVX2 one on a CPU that has both, and the widened rows off to check
// the dot products at every number of rows (benchmarks too, to time them).
std::atomic<bool> avx512_allowed{true};
std::atomic<bool> widened_rows_allowed{true};

bool avx512_path() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  return vnni && avx512_allowed;
}

// Per thread and reused: a decode step calls the kernel about 120 times with the same few rows. A block is
// quantized 16 values to a vector where the CPU has AVX-512 (a batch-1 step quantizes about 100,000 values), else,
// and for a block holding a value that is not finite, one value at a time; both round alike.
const QuantizedRows& quantize_rows(const float* x, int64_t rows, int64_t k, int bits) {
  thread_local QuantizedRows q;
  const int64_t blocks = k / kBlock;
  const bool vector = avx512_path();
  q.row_stride = bits == 8 ? k : (blocks + 3) / 4 * 128;
  q.codes.assign(rows * q.row_stride, 0);
  q.scales.resize(rows * blocks);
  q.sums.resize(rows * blocks);
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const float* v = x + i * kBlock;
    int8_t* row_codes = q.codes.data() + (i / blocks) * q.row_stride;
    const int64_t block = i % blocks;
    if (vector && avx512::quantize_block(v, row_codes + code_position(bits, block, 0),
                                         row_codes + code_position(bits, block, 16), q.scales[i], q.sums[i])) {
      continue;
    }
    float amax = 0.0f;
    bool finite = true;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j])), finite &= std::isfinite(v[j]);
    // a non-finite value makes its row's products NaN, as a float product would, instead of a finite wrong number
    const float scale = finite ? amax / 127.0f : NAN, inverse = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int code = static_cast<int>(std::nearbyint(v[j] * inverse));
      row_codes[code_position(bits, block, j)] = static_cast<int8_t>(code);
      sum += code;
    }
    q.scales[i] = scale;
    q.sums[i] = scale * static_cast<float>(sum);
  }
  return q;
}

template <int Bits, int R, typename S>
void rows_on(bool avx512_path, const Activations a, const uint8_t* codes, const S* scales, const S* mins, int64_t k,
             int64_t begin, int64_t end, int64_t n, float* y) {
  if (avx512_path) {
    avx512::block_rows<Bits, R>(a, codes, scales, mins, k, begin, end, n, y);
  } else {
    avx2::block_rows<Bits, R>(a, codes, scales, mins, k, begin, end, n, y);
  }
}

template <int Bits, typename S>
void dispatch(const QuantizedRows& q, int64_t m, const uint8_t* codes, const S* scales, const S* mins,
              int64_t k, int64_t n, float* y) {
  const int64_t blocks = k / kBlock;
  const bool avx512_blocks = avx512_path() && (Bits == 4 || blocks % 2 == 0);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += kRowsTogether) {
      const Activations a{q.codes.data() + first * q.row_stride, q.row_stride, q.scales.data() + first * blocks,
                          q.sums.data() + first * blocks};
      float* out = y + first * n;
      switch (std::min(kRowsTogether, m - first)) {
        case 1: rows_on<Bits, 1, S>(avx512_blocks, a, codes, scales, mins, k, begin, end, n, out); break;
        case 2: rows_on<Bits, 2, S>(avx512_blocks, a, codes, scales, mins, k, begin, end, n, out); break;
        case 3: rows_on<Bits, 3, S>(avx512_blocks, a, codes, scales, mins, k, begin, end, n, out); break;
        default: rows_on<Bits, 4, S>(avx512_blocks, a, codes, scales, mins, k, begin, end, n, out); break;
      }
    }
  });
}

}  // namespace

namespace {

template <typename S>
void product(const float* x, int64_t m, int64_t k, const uint8_t* codes, const void* scales, const void* mins,
             int bits, int64_t n, float* y) {
  const auto* s = static_cast<const S*>(scales);
  const auto* z = static_cast<const S*>(mins);
  if (m >= kWidenedFromRows && widened_rows_allowed && !avx512_path()) {
    widened_rows_product(x, m, k, codes, s, z, bits, n, y);
    return;
  }
  const QuantizedRows& q = quantize_rows(x, m, k, bits);
  if (bits == 4) {
    dispatch<4>(q, m, codes, s, z, k, n, y);
  } else {
    dispatch<8>(q, m, codes, s, z, k, n, y);
  }
}

}  // namespace

int64_t check_block_weight(const char* op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.element_size() == 1 && codes.is_cpu() &&
                  codes.size(1) * 8 / bits % kBlock == 0,
              op, ": codes must be contiguous bytes [N, K * bits / 8] on the CPU, K a multiple of 32");
  const int64_t n = codes.size(0), k = codes.size(1) * 8 / bits;
  TORCH_CHECK((scales.dtype() == at::kFloat || scales.dtype() == at::kHalf) && scales.is_contiguous() &&
                  scales.is_cpu() && scales.numel() == n * (k / kBlock),
              op, ": scales must be float32 or float16 [N, K / 32]");
  TORCH_CHECK(bits == 8 || (mins.dtype() == scales.dtype() && mins.is_contiguous() && mins.numel() == scales.numel()),
              op, ": 4-bit mins must be [N, K / 32] of the scales' dtype");
  return k;
}

void block_product(const float* x, int64_t m, int64_t k, const uint8_t* codes, const void* scales, const void* mins,
                   bool half_scales, int bits, int64_t n, float* y) {
  if (half_scales) {
    product<uint16_t>(x, m, k, codes, scales, mins, bits, n, y);
  } else {
    product<float>(x, m, k, codes, scales, mins, bits, n, y);
  }
}

at::Tensor block_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins, int64_t bits) {
  const int64_t k = check_block_weight("block_linear", codes, scales, mins, bits);
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat && x.size(1) == k, "block_linear: x must be float32 [M, ",
              k, "]");
  const int64_t m = x.size(0), n = codes.size(0);
  const auto input = x.contiguous();
  auto y = at::empty({m, n}, x.options());
  block_product(input.data_ptr<float>(), m, k, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
                bits == 4 ? mins.data_ptr() : nullptr, scales.dtype() == at::kHalf, static_cast<int>(bits), n,
                y.data_ptr<float>());
  return y;
}

// Whether the products may take the AVX-512 path where the CPU has it; returns the previous setting.
bool allow_avx512(bool allowed) { return avx512_allowed.exchange(allowed); }

// Whether products of kWidenedFromRows rows or more may run widened where the dot products are AVX2's; returns the
// previous setting.
bool allow_widened_rows(bool allowed) { return widened_rows_allowed.exchange(allowed); }

namespace {

template <typename S, typename W>
void widen(const uint8_t* bytes, const S* scale, const S* min, int64_t bits, int64_t n, int64_t blocks, W* w) {
  const int64_t k = blocks * kBlock, row_bytes = k * bits / 8;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<W, float> ? 0 : k);  // a row before its bfloat16 rounding
    for (int64_t row = begin; row < end; ++row) {
      float* out = std::is_same_v<W, float> ? reinterpret_cast<float*>(w + row * k) : widened.data();
      if (bits == 4) {
        widen_row<4>(bytes + row * row_bytes, scale + row * blocks, min + row * blocks, blocks, out);
      } else {
        widen_row<8>(bytes + row * row_bytes, scale + row * blocks, min, blocks, out);
      }
      if constexpr (!std::is_same_v<W, float>) std::copy(widened.begin(), widened.end(), w + row * k);
    }
  });
}

template <typename W>
void widen_into(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                int64_t blocks, at::Tensor& out) {
  const auto* bytes = static_cast<const uint8_t*>(codes.data_ptr());
  const int64_t n = codes.size(0);
  auto* w = out.data_ptr<W>();
  if (scales.dtype() == at::kHalf) {
    const auto* min = bits == 4 ? static_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
    widen(bytes, static_cast<const uint16_t*>(scales.data_ptr()), min, bits, n, blocks, w);
  } else {
    widen(bytes, scales.data_ptr<float>(), bits == 4 ? mins.data_ptr<float>() : nullptr, bits, n, blocks, w);
  }
}

}  // namespace

// The weights as dense bfloat16 or float32 [N, K] into `out`, for products of many rows (prefill chunks), where a
// dense GEMM (oneDNN's bfloat16 one where the CPU has bfloat16 dot products, float32 elsewhere) outruns the dot
// products by more than widening a layer's weights per call costs.
void block_to_dense(at::Tensor codes, at::Tensor scales, at::Tensor mins, int64_t bits, at::Tensor out) {
  const int64_t n = codes.size(0), k = check_block_weight("block_to_dense", codes, scales, mins, bits);
  TORCH_CHECK((out.dtype() == at::kBFloat16 || out.dtype() == at::kFloat) && out.is_contiguous() &&
                  out.size(0) == n && out.size(1) == k,
              "block_to_dense: out must be bfloat16 or float32 [N, K]");
  if (out.dtype() == at::kBFloat16) {
    widen_into<c10::BFloat16>(codes, scales, mins, bits, k / kBlock, out);
  } else {
    widen_into<float>(codes, scales, mins, bits, k / kBlock, out);
  }
}

}  // namespace kvstrata

TORCH_LIBRARY(kvstrata_weights, m) {
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
  m.def("block_to_dense(Tensor codes, Tensor scales, Tensor mins, int bits, Tensor(a!) out) -> ()");
  m.def("allow_avx512(bool allowed) -> bool", &kvstrata::allow_avx512);
  m.def("allow_widened_rows(bool allowed) -> bool", &kvstrata::allow_widened_rows);
}

TORCH_LIBRARY_IMPL(kvstrata_weights, CPU, m) {
  m.impl("block_linear", &kvstrata::block_linear);
  m.impl("block_to_dense", &kvstrata::block_to_dense);
}
