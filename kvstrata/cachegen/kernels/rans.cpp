// rANS coding of groups of integer symbols, each group under one of a list of static models (entropy.py): the
// compiled coder of CacheGen's streams. Every group of a tensor is coded in one call, without the GIL, where
// constriction's coder took one Python call (and model) per group. Several groups may share a model (fitted
// models: fitted_models.py); each model is built once per call.
//
// A model is a probability vector over symbols 0 .. n-1; both sides quantize it to integer frequencies that sum
// to 2^24, every symbol at least 1 (frequencies()), with the same double arithmetic, so encoder and decoder
// agree. The state is 64-bit and renormalizes 32 bits at a time (rANS with L = 2^31): the stream is a sequence
// of uint32 words, the final state (two words) first. Groups are encoded last to first so they decode first to
// last. A decoder that runs out of words, or whose final state is not the initial one, reports a corrupt stream.
#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvstrata {

namespace {

constexpr int kPrecision = 24;
constexpr uint64_t kTotal = uint64_t{1} << kPrecision;
constexpr uint64_t kLow = uint64_t{1} << 31;  // the state stays in [kLow, kLow << 32)

struct Model {
  std::vector<uint32_t> start;  // n + 1 cumulative frequencies
  std::vector<uint32_t> lookup;  // slot >> shift -> the symbol holding the bucket's first slot
  int shift = 0;

  uint32_t frequency(int64_t symbol) const { return start[symbol + 1] - start[symbol]; }
};

Model build_model(const double* probabilities, int64_t n, bool with_lookup) {
  TORCH_CHECK(n >= 1 && static_cast<uint64_t>(n) <= kTotal / 2, "a model must have 1 to 2^23 symbols, got ", n);
  std::vector<uint32_t> frequency(n);
  const double spare = static_cast<double>(kTotal - n);  // every symbol gets 1, the rest by probability
  uint64_t sum = 0;
  int64_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double p = std::isfinite(probabilities[i]) ? std::clamp(probabilities[i], 0.0, 1.0) : 0.0;
    frequency[i] = 1 + static_cast<uint32_t>(std::floor(p * spare));
    sum += frequency[i];
    if (frequency[i] > frequency[largest]) largest = i;
  }
  // probabilities summing to a little more or less than 1: the largest symbol absorbs the difference
  if (sum > kTotal) {
    TORCH_CHECK(frequency[largest] > sum - kTotal, "model probabilities sum far above 1");
    frequency[largest] -= static_cast<uint32_t>(sum - kTotal);
  } else {
    frequency[largest] += static_cast<uint32_t>(kTotal - sum);
  }
  Model model;
  model.start.resize(n + 1);
  model.start[0] = 0;
  for (int64_t i = 0; i < n; ++i) model.start[i + 1] = model.start[i] + frequency[i];
  if (with_lookup) {
    int bits = 4;
    while (bits < 12 && (int64_t{1} << (bits - 2)) < n) ++bits;
    model.shift = kPrecision - bits;
    model.lookup.resize(size_t{1} << bits);
    int64_t symbol = 0;
    for (size_t j = 0; j < model.lookup.size(); ++j) {
      const uint64_t slot = static_cast<uint64_t>(j) << model.shift;
      while (model.start[symbol + 1] <= slot) ++symbol;
      model.lookup[j] = static_cast<uint32_t>(symbol);
    }
  }
  return model;
}

bool is_vector(const at::Tensor& t, at::ScalarType dtype) {
  return t.dtype() == dtype && t.dim() == 1 && t.is_contiguous();
}

// Checked with plain loops: the arrays are small, and torch reductions would cost more than the check (the decoder
// runs beside others, and each torch call holds the GIL). Returns the number of symbols.
int64_t check_layout(const at::Tensor& sizes, const at::Tensor& group_models, const at::Tensor& lengths,
                     const at::Tensor& probabilities) {
  TORCH_CHECK(is_vector(sizes, at::kLong) && is_vector(group_models, at::kLong) &&
              sizes.numel() == group_models.numel(), "sizes and group models: int64 [groups]");
  TORCH_CHECK(is_vector(lengths, at::kLong), "model lengths: int64 [models]");
  TORCH_CHECK(is_vector(probabilities, at::kDouble), "probabilities: float64, every model's concatenated");
  const int64_t* length = lengths.data_ptr<int64_t>();
  int64_t covered = 0;
  for (int64_t m = 0; m < lengths.numel(); ++m) {
    TORCH_CHECK(length[m] >= 1, "an empty model");
    covered += length[m];
  }
  TORCH_CHECK(covered == probabilities.numel(), "model lengths do not cover the probabilities");
  const int64_t* size = sizes.data_ptr<int64_t>();
  const int64_t* model_of = group_models.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t g = 0; g < sizes.numel(); ++g) {
    TORCH_CHECK(size[g] >= 0, "a negative group size");
    TORCH_CHECK(model_of[g] >= 0 && model_of[g] < lengths.numel(), "a group names a model that does not exist");
    total += size[g];
  }
  return total;
}

// Each model built once, when a group first uses it.
class Models {
 public:
  Models(const at::Tensor& lengths, const at::Tensor& probabilities, bool with_lookup)
      : length_(lengths.data_ptr<int64_t>()), probability_(probabilities.data_ptr<double>()),
        first_(lengths.numel() + 1, 0), built_(lengths.numel()), with_lookup_(with_lookup) {
    for (int64_t m = 0; m < lengths.numel(); ++m) first_[m + 1] = first_[m] + length_[m];
  }

  int64_t length(int64_t m) const { return length_[m]; }

  const Model& get(int64_t m) {
    if (built_[m].start.empty()) built_[m] = build_model(probability_ + first_[m], length_[m], with_lookup_);
    return built_[m];
  }

 private:
  const int64_t* length_;
  const double* probability_;
  std::vector<int64_t> first_;
  std::vector<Model> built_;
  bool with_lookup_;
};

}  // namespace

at::Tensor rans_encode(at::Tensor symbols, at::Tensor sizes, at::Tensor group_models,
                       at::Tensor lengths, at::Tensor probabilities) {
  const int64_t total = check_layout(sizes, group_models, lengths, probabilities);
  TORCH_CHECK(is_vector(symbols, at::kInt) && symbols.numel() == total, "symbols: int32 [sum of sizes]");
  const int64_t groups = sizes.numel();
  const int64_t* size = sizes.data_ptr<int64_t>();
  const int64_t* model_of = group_models.data_ptr<int64_t>();
  const int32_t* symbol = symbols.data_ptr<int32_t>();
  Models models(lengths, probabilities, false);
  std::vector<uint32_t> words;  // written backwards: reversed at the end
  {
    pybind11::gil_scoped_release unlocked;
    std::vector<int64_t> first_symbol(groups + 1, 0);
    for (int64_t g = 0; g < groups; ++g) first_symbol[g + 1] = first_symbol[g] + size[g];
    words.reserve(static_cast<size_t>(first_symbol[groups] / 4 + 16));
    uint64_t state = kLow;
    for (int64_t g = groups - 1; g >= 0; --g) {
      if (size[g] == 0) continue;
      const Model& model = models.get(model_of[g]);
      const int64_t n = models.length(model_of[g]);
      for (int64_t i = first_symbol[g + 1] - 1; i >= first_symbol[g]; --i) {
        const int64_t s = symbol[i];
        TORCH_CHECK(s >= 0 && s < n, "symbol ", s, " outside its model's range [0, ", n, ")");
        const uint64_t frequency = model.frequency(s);
        const uint64_t limit = ((kLow >> kPrecision) << 32) * frequency;
        if (state >= limit) {
          words.push_back(static_cast<uint32_t>(state));
          state >>= 32;
        }
        state = ((state / frequency) << kPrecision) + state % frequency + model.start[s];
      }
    }
    words.push_back(static_cast<uint32_t>(state));
    words.push_back(static_cast<uint32_t>(state >> 32));
    std::reverse(words.begin(), words.end());
  }
  auto out = at::empty({static_cast<int64_t>(words.size())}, at::kInt);
  std::memcpy(out.data_ptr<int32_t>(), words.data(), words.size() * sizeof(uint32_t));
  return out;
}

// Each decoded symbol comes back plus its group's offset (the model's lowest symbol, and what else the caller
// took off the group), so the caller adds nothing.
at::Tensor rans_decode(at::Tensor words, at::Tensor sizes, at::Tensor group_models,
                       at::Tensor lengths, at::Tensor probabilities, at::Tensor group_offsets) {
  const int64_t total = check_layout(sizes, group_models, lengths, probabilities);
  TORCH_CHECK(is_vector(words, at::kInt), "words: int32 [n]");
  TORCH_CHECK(is_vector(group_offsets, at::kInt) && group_offsets.numel() == sizes.numel(),
              "group offsets: int32 [groups]");
  const int64_t groups = sizes.numel();
  auto out = at::empty({total}, at::kInt);
  const int64_t* size = sizes.data_ptr<int64_t>();
  const int64_t* model_of = group_models.data_ptr<int64_t>();
  const int32_t* offset = group_offsets.data_ptr<int32_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK_VALUE(int64_t{offset[g]} + length[model_of[g]] - 1 <= INT32_MAX,
                      "corrupt rANS stream: a group's symbols would lie beyond 32-bit integers");
  }
  Models models(lengths, probabilities, true);
  const auto* stream = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const int64_t num_words = words.numel();
  int32_t* symbol = out.data_ptr<int32_t>();
  bool whole = num_words >= 2;
  {
    pybind11::gil_scoped_release unlocked;
    int64_t next = 2;
    uint64_t state = whole ? (uint64_t{stream[0]} << 32) | stream[1] : 0;
    for (int64_t g = 0; g < groups && whole; ++g) {
      if (size[g] > 0) {
        const Model& model = models.get(model_of[g]);
        for (int64_t i = 0; i < size[g]; ++i) {
          const uint32_t slot = static_cast<uint32_t>(state & (kTotal - 1));
          uint32_t s = model.lookup[slot >> model.shift];
          if (model.start[s + 1] <= slot) {  // the bucket holds several symbols (wide models): search the rest
            s = static_cast<uint32_t>(std::upper_bound(model.start.begin() + s + 1, model.start.end(), slot) -
                                      model.start.begin() - 1);
          }
          state = model.frequency(s) * (state >> kPrecision) + slot - model.start[s];
          if (state < kLow) {
            if (next >= num_words) {
              whole = false;
              break;
            }
            state = (state << 32) | stream[next++];
          }
          *symbol++ = static_cast<int32_t>(s) + offset[g];
        }
      }
    }
    whole = whole && next == num_words && state == kLow;
  }
  TORCH_CHECK_VALUE(whole, "corrupt rANS stream: its words do not decode to the symbols and final state expected");
  return out;
}

}  // namespace kvstrata

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rans_encode", &kvstrata::rans_encode, "rANS words of groups of symbols, each group under the model it names");
  m.def("rans_decode", &kvstrata::rans_decode, "the symbols of rans_encode's words");
}
