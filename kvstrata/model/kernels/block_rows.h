// The product loop's walk over output rows, shared by both instruction sets: included in namespaces `avx512` and
// `avx2` after their `block_tile`.
// outputs [n_begin, n_end) for R rows of activations, tile_outputs(Bits, R) output rows at a time
template <int Bits, int R, typename S>
void block_rows(const Activations a, const uint8_t* codes, const S* scales, const S* mins, int64_t k,
                int64_t n_begin, int64_t n_end, int64_t n_total, float* y) {
  int64_t n = n_begin;
  constexpr int T = tile_outputs(Bits, R);
  for (; n + T <= n_end; n += T) block_tile<Bits, R, T, S>(a, codes, scales, mins, k, n, n_total, y);
  for (; n < n_end; ++n) block_tile<Bits, R, 1, S>(a, codes, scales, mins, k, n, n_total, y);
}
