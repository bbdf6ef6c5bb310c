// The products over GGUF-style blocks (block_dot.cpp), for the other kernels of the weights' extension.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvstrata {

// y [m, n] = x [m, k] W^T for W's blocks laid out as block_dot.cpp describes: scales and mins float32, or float16
// where `half_scales` (`mins` unused for 8 bits).
void block_product(const float* x, int64_t m, int64_t k, const uint8_t* codes, const void* scales, const void* mins,
                   bool half_scales, int bits, int64_t n, float* y);

// The same product in float32 over each weight row widened once (widened_rows.cpp), scales and mins of type S (float,
// or uint16_t holding float16); block_product takes it for enough rows where the CPU has no AVX-512 VNNI.
template <typename S>
void widened_rows_product(const float* x, int64_t m, int64_t k, const uint8_t* codes, const S* scales, const S* mins,
                          int bits, int64_t n, float* y);

// Checks a block weight's tensors against that layout (bad input raises naming `op`); returns K.
int64_t check_block_weight(const char* op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           int64_t bits);

}  // namespace kvstrata
