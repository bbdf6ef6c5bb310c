// A step of decodes through every layer of a Llama-family model in one call (model/native_decode.py says when the
// engine takes it). Each layer computes what model/llama.py's before_attention, store_and_attend and
// after_attention compute (up to the order of float sums and fused multiply-adds): RMSNorm, the q/k/v product
// (plus Qwen2's biases), each head's RMSNorm of q and k (Qwen3's), RoPE, the KV kernels' store-and-attend
// operator, the output product and residual, RMSNorm, the gate/up product, SiLU(gate) * up, the down product and
// residual.
//
// Where the step's attention is not one operator (a quantized cache's store, a policy that selects tokens), the
// model calls the layer's two halves from Python instead (before_attention, after_attention), with the KV
// policy's attention between them.
//
// Why: at batch 1 the products over the blocks take about half of a step; the rest is a few hundred small
// operations, each of which costs torch (eager or compiled) microseconds of dispatch, allocation and thread
// start-up for nanoseconds of arithmetic. Here the small operations are plain loops over a few thousand floats,
// and only the products (block_dot.cpp) and the attention run on torch's threads.
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <vector>

#include "block_product.h"

namespace kvstrata {

namespace {

struct BlockWeight {
  at::Tensor codes, scales, mins;
  int bits;
  int64_t in, out;

  BlockWeight(at::Tensor codes_, at::Tensor scales_, at::Tensor mins_, int64_t bits_)
      : codes(std::move(codes_)), scales(std::move(scales_)), mins(std::move(mins_)), bits(static_cast<int>(bits_)),
        in(check_block_weight("DecodeLayers", codes, scales, mins, bits_)), out(codes.size(0)) {}

  // y [m, out] = x [m, in] W^T
  void apply(const float* x, int64_t m, float* y) const {
    block_product(x, m, in, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
                  bits == 4 ? mins.data_ptr() : nullptr, scales.dtype() == at::kHalf, bits, out, y);
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  BlockWeight qkv, o, gate_up, down;
  at::Tensor qkv_bias;        // [q/k/v width], or empty where the product has none (Qwen2 has one)
  at::Tensor q_norm, k_norm;  // [head_dim], or empty where heads are not normed (Qwen3 norms them)
};

// out = weight * x / sqrt(mean(x^2) + eps), per row of `size`, in float32 (torch's rms_norm sums in another order)
void rms_norm(const float* x, const float* weight, int64_t rows, int64_t size, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * size;
    float squares = 0.0f;
    for (int64_t i = 0; i < size; ++i) squares += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(eps));
    for (int64_t i = 0; i < size; ++i) out[r * size + i] = weight[i] * (row[i] * inverse);
  }
}

// RoPE of one head [dim] in the halves layout (model/rotary.py's apply_rope), from `from` into `to`
void rotate(const float* from, const float* cos, const float* sin, int64_t dim, float* to) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    to[d] = from[d] * cos[d] - from[d + half] * sin[d];
    to[d + half] = from[d + half] * cos[d + half] + from[d] * sin[d + half];
  }
}

// The KV kernels' operator (kv/kernels/paged_decode.cpp), found through torch's dispatcher: the two extensions are
// built apart, and the KV one is loaded before a step takes this path.
at::Tensor store_and_attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& k_pools,
                            at::Tensor& v_pools, int64_t layer, const at::Tensor& slots, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t min_shared_tokens,
                            int64_t window) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvstrata::store_and_decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, int64_t,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>();
  return op.call(q, k_new, v_new, k_pools, v_pools, layer, slots, block_tables, context_lens, scale,
                 min_shared_tokens, window);
}

}  // namespace

// Holds the layers' weights (the model's own tensors, not copies) and runs a step of decodes through them.
class DecodeLayers {
 public:
  // Per layer, in order: norms [input, post-attention]; block weights [q/k/v, output, gate/up, down] as codes,
  // scales, mins (empty for 8 bits) and bits; the q/k/v product's bias; the head norms [q, k] (empty tensors where
  // the model has none).
  // Then the final norm's weight, and RoPE's inverse frequencies [head_dim / 2] (float32, model/rotary.py).
  DecodeLayers(const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& codes,
               const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& mins,
               const std::vector<int64_t>& bits, const std::vector<at::Tensor>& qkv_biases,
               const std::vector<at::Tensor>& head_norms, at::Tensor final_norm, at::Tensor inverse_frequencies,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : final_norm_(std::move(final_norm)), inverse_frequencies_(std::move(inverse_frequencies)), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
    const size_t count = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * count && codes.size() == 4 * count && scales.size() == codes.size() &&
                    mins.size() == codes.size() && bits.size() == codes.size() && qkv_biases.size() == count &&
                    head_norms.size() == 2 * count,
                "DecodeLayers: 2 norms, 4 block weights, a bias and 2 head norms per layer");
    TORCH_CHECK(count > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0, "DecodeLayers: ", count,
                " layers, heads ", heads, ", kv_heads ", kv_heads, ", head_dim ", head_dim);
    for (size_t l = 0; l < count; ++l) {
      auto weight = [&](size_t i) { return BlockWeight(codes[4 * l + i], scales[4 * l + i], mins[4 * l + i], bits[4 * l + i]); };
      layers_.push_back(Layer{norms[2 * l], norms[2 * l + 1], weight(0), weight(1), weight(2), weight(3),
                              qkv_biases[l], head_norms[2 * l], head_norms[2 * l + 1]});
      const Layer& layer = layers_.back();
      if (l == 0) {  // every layer must have the first one's sizes: the step's buffers are sized by them
        hidden_ = layer.qkv.in;
        intermediate_ = layer.down.in;
      }
      TORCH_CHECK(layer.qkv.in == hidden_ && layer.down.in == intermediate_ &&
                      layer.qkv.out == (heads + 2 * kv_heads) * head_dim && layer.o.in == heads * head_dim &&
                      layer.o.out == hidden_ && layer.gate_up.in == hidden_ && layer.gate_up.out == 2 * intermediate_ &&
                      layer.down.out == hidden_,
                      "DecodeLayers: layer ", l, "'s products do not fit one another or the first layer's");
      for (const auto& norm : {layer.input_norm, layer.post_attention_norm}) check_norm(norm, hidden_);
      check_optional(layer.qkv_bias, layer.qkv.out, "the q/k/v bias");
      check_optional(layer.q_norm, head_dim, "a head norm");
      check_optional(layer.k_norm, head_dim, "a head norm");
      TORCH_CHECK(layer.q_norm.numel() == layer.k_norm.numel(), "DecodeLayers: q and k are normed both or neither");
    }
    check_norm(final_norm_, hidden_);
    TORCH_CHECK(inverse_frequencies_.dtype() == at::kFloat && inverse_frequencies_.is_contiguous() &&
                    inverse_frequencies_.numel() == head_dim / 2,
                "DecodeLayers: RoPE's inverse frequencies must be float32 [head_dim / 2]");
  }

  // x [n, hidden] float32 (one token per sequence) at `positions` [n]; the pools and the step's slots, block
  // tables, context lengths, shared prefix's threshold and sliding window as kv/fused_decode.py's FusedDecode holds
  // them. Returns the final norm of the last layer's output [n, hidden]; the pools hold every layer's new K/V.
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor k_pools, at::Tensor v_pools, at::Tensor slots,
                     at::Tensor block_tables, at::Tensor context_lens, int64_t min_shared_tokens, int64_t window) {
    check_hidden(x);
    const int64_t n = x.size(0), dim = head_dim_;
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n, "DecodeLayers: positions must be [n], one per row");
    const at::Tensor position_values = positions.to(at::kLong).contiguous();
    std::vector<float> cos(n * dim), sin(n * dim);
    angles(position_values.data_ptr<int64_t>(), n, cos.data(), sin.data());
    at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
    at::Tensor q = at::empty({n, heads_, dim}, x.options()), k = at::empty({n, kv_heads_, dim}, x.options()),
               v = at::empty({n, kv_heads_, dim}, x.options());
    Scratch scratch(n, hidden_, (heads_ + 2 * kv_heads_) * dim, intermediate_);
    float* h = out.data_ptr<float>();
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    for (size_t l = 0; l < layers_.size(); ++l) {
      attention_inputs(layers_[l], h, cos.data(), sin.data(), n, q.data_ptr<float>(), k.data_ptr<float>(),
                       v.data_ptr<float>(), scratch);
      const at::Tensor attended = store_and_attend(q, k, v, k_pools, v_pools, static_cast<int64_t>(l), slots,
                                                   block_tables, context_lens, scale, min_shared_tokens, window);
      finish_layer(layers_[l], h, attended.data_ptr<float>(), n, scratch);
    }
    rms_norm(h, final_norm_.data_ptr<float>(), n, hidden_, eps_, h);
    return out;
  }

  // RoPE's cos and sin [n, 1, head_dim] at `positions` [n], computed as forward computes them: a step whose
  // attention runs elsewhere rotates by these (torch's cos and sin may round apart), so that its rows get the
  // numbers they get in a step of the loop.
  std::vector<at::Tensor> cos_sin(at::Tensor positions) const {
    TORCH_CHECK(positions.dim() == 1, "DecodeLayers: positions must be [n], one per row");
    const int64_t n = positions.size(0);
    const at::Tensor position_values = positions.to(at::kLong).contiguous();
    at::Tensor cos = at::empty({n, 1, head_dim_}, at::kFloat), sin = at::empty({n, 1, head_dim_}, at::kFloat);
    angles(position_values.data_ptr<int64_t>(), n, cos.data_ptr<float>(), sin.data_ptr<float>());
    return {cos, sin};
  }

  // The final norm of x [n, hidden], as forward ends (torch's rms_norm sums in another order).
  at::Tensor final_norm(at::Tensor x) const {
    check_hidden(x);
    const at::Tensor rows = x.contiguous();
    at::Tensor out = at::empty({rows.size(0), hidden_}, rows.options());
    rms_norm(rows.data_ptr<float>(), final_norm_.data_ptr<float>(), rows.size(0), hidden_, eps_,
             out.data_ptr<float>());
    return out;
  }

  // One layer's work up to attention, for a step whose attention runs elsewhere (a KV policy in Python): q, k
  // (rotated) and v [n, heads or kv_heads, head_dim] of x [n, hidden] with RoPE's cos and sin [n, (1,) head_dim]
  // (model/rotary.py's cos_sin).
  std::vector<at::Tensor> before_attention(int64_t layer, at::Tensor x, at::Tensor cos, at::Tensor sin) {
    const Layer& weights = layer_at(layer);
    check_hidden(x);
    const int64_t n = x.size(0), dim = head_dim_;
    x = x.contiguous();
    for (at::Tensor* angle : {&cos, &sin}) {
      TORCH_CHECK(angle->dtype() == at::kFloat && angle->numel() == n * dim && angle->size(0) == n,
                  "DecodeLayers: cos and sin must be float32 [n, (1,) ", dim, "]");
      *angle = angle->contiguous();
    }
    at::Tensor q = at::empty({n, heads_, dim}, x.options()), k = at::empty({n, kv_heads_, dim}, x.options()),
               v = at::empty({n, kv_heads_, dim}, x.options());
    Scratch scratch(n, hidden_, (heads_ + 2 * kv_heads_) * dim, 0);
    attention_inputs(weights, x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), n,
                     q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), scratch);
    return {q, k, v};
  }

  // The rest of the layer: x [n, hidden] after the output product and residual, the MLP and residual, given the
  // attention output `attended` [n, heads, head_dim].
  at::Tensor after_attention(int64_t layer, at::Tensor x, at::Tensor attended) {
    const Layer& weights = layer_at(layer);
    check_hidden(x);
    const int64_t n = x.size(0);
    TORCH_CHECK(attended.dtype() == at::kFloat && attended.numel() == n * heads_ * head_dim_ && attended.size(0) == n,
                "DecodeLayers: the attention output must be float32 [n, ", heads_, ", ", head_dim_, "]");
    at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
    const at::Tensor attended_values = attended.contiguous();
    Scratch scratch(n, hidden_, 0, intermediate_);
    finish_layer(weights, out.data_ptr<float>(), attended_values.data_ptr<float>(), n, scratch);
    return out;
  }

 private:
  // A step's intermediate rows: the normed input, the q/k/v and output products, the MLP's gate/up and activation.
  struct Scratch {
    std::vector<float> normed, qkv, projected, gate_up, activated;
    Scratch(int64_t n, int64_t hidden, int64_t qkv_width, int64_t intermediate)
        : normed(n * hidden), qkv(n * qkv_width), projected(n * hidden), gate_up(n * 2 * intermediate),
          activated(n * intermediate) {}
  };

  // RMSNorm, the q/k/v product and RoPE of h [n, hidden] into q, k and v
  void attention_inputs(const Layer& layer, const float* h, const float* cos, const float* sin, int64_t n, float* q,
                        float* k, float* v, Scratch& scratch) const {
    rms_norm(h, layer.input_norm.data_ptr<float>(), n, hidden_, eps_, scratch.normed.data());
    layer.qkv.apply(scratch.normed.data(), n, scratch.qkv.data());
    if (layer.qkv_bias.numel() > 0) {
      const float* bias = layer.qkv_bias.data_ptr<float>();
      const int64_t width = layer.qkv.out;
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t i = 0; i < width; ++i) scratch.qkv[r * width + i] += bias[i];
      }
    }
    split_and_rotate(layer, scratch.qkv.data(), cos, sin, n, q, k, v);
  }

  // h += the output product of `attended` [n, heads * head_dim]; then h += the MLP of RMSNorm(h)
  void finish_layer(const Layer& layer, float* h, const float* attended, int64_t n, Scratch& scratch) const {
    layer.o.apply(attended, n, scratch.projected.data());
    for (int64_t i = 0; i < n * hidden_; ++i) h[i] += scratch.projected[i];
    rms_norm(h, layer.post_attention_norm.data_ptr<float>(), n, hidden_, eps_, scratch.normed.data());
    layer.gate_up.apply(scratch.normed.data(), n, scratch.gate_up.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* gate = scratch.gate_up.data() + r * 2 * intermediate_;
      const float* up = gate + intermediate_;
      float* activated = scratch.activated.data() + r * intermediate_;
      for (int64_t i = 0; i < intermediate_; ++i) activated[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
    layer.down.apply(scratch.activated.data(), n, scratch.projected.data());
    for (int64_t i = 0; i < n * hidden_; ++i) h[i] += scratch.projected[i];
  }

  const Layer& layer_at(int64_t layer) const {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "DecodeLayers: layer ", layer,
                " out of range: the model has ", layers_.size());
    return layers_[layer];
  }

  void check_hidden(const at::Tensor& x) const {
    TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_ && x.is_cpu(),
                "DecodeLayers: x must be float32 [n, ", hidden_, "] on the CPU");
  }

  static void check_norm(const at::Tensor& norm, int64_t size) {
    TORCH_CHECK(norm.dtype() == at::kFloat && norm.is_contiguous() && norm.is_cpu() && norm.numel() == size,
                "DecodeLayers: norm weights must be float32 [", size, "] on the CPU");
  }

  // A weight the model may not have: empty, or float32 [size] on the CPU.
  static void check_optional(const at::Tensor& weight, int64_t size, const char* what) {
    TORCH_CHECK(weight.numel() == 0 || (weight.dtype() == at::kFloat && weight.is_contiguous() && weight.is_cpu() &&
                                        weight.numel() == size),
                "DecodeLayers: ", what, " must be empty or float32 [", size, "] on the CPU");
  }

  // cos and sin [n, head_dim] of each row's angles position * frequency, both halves alike (model/rotary.py)
  void angles(const int64_t* positions, int64_t n, float* cos, float* sin) const {
    const int64_t half = head_dim_ / 2;
    const float* frequencies = inverse_frequencies_.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[r]) * frequencies[i];
        cos[r * head_dim_ + i] = cos[r * head_dim_ + half + i] = std::cos(angle);
        sin[r * head_dim_ + i] = sin[r * head_dim_ + half + i] = std::sin(angle);
      }
    }
  }

  // qkv [n, (heads + 2 kv_heads) * dim] into q and k (each head normed where the layer norms heads, then rotated)
  // and v, each [n, heads or kv_heads, dim]
  void split_and_rotate(const Layer& layer, const float* qkv, const float* cos, const float* sin, int64_t n, float* q,
                        float* k, float* v) const {
    const int64_t dim = head_dim_, width = (heads_ + 2 * kv_heads_) * dim;
    std::vector<float> normed(dim);
    auto norm_and_rotate = [&](const float* head, const at::Tensor& norm, const float* c, const float* s, float* to) {
      if (norm.numel() > 0) {
        rms_norm(head, norm.data_ptr<float>(), 1, dim, eps_, normed.data());
        head = normed.data();
      }
      rotate(head, c, s, dim, to);
    };
    for (int64_t r = 0; r < n; ++r) {
      const float* row = qkv + r * width;
      const float *c = cos + r * dim, *s = sin + r * dim;
      for (int64_t head = 0; head < heads_; ++head) {
        norm_and_rotate(row + head * dim, layer.q_norm, c, s, q + (r * heads_ + head) * dim);
      }
      for (int64_t head = 0; head < kv_heads_; ++head) {
        norm_and_rotate(row + (heads_ + head) * dim, layer.k_norm, c, s, k + (r * kv_heads_ + head) * dim);
        std::copy_n(row + (heads_ + kv_heads_ + head) * dim, dim, v + (r * kv_heads_ + head) * dim);
      }
    }
  }

  std::vector<Layer> layers_;
  at::Tensor final_norm_, inverse_frequencies_;
  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0, intermediate_ = 0;
  double eps_;
};

}  // namespace kvstrata

// torch's extension loader imports the library as a Python module: the operators of block_dot.cpp are registered
// with torch, the layer loop is bound here.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<kvstrata::DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<int64_t>&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, at::Tensor, at::Tensor,
                          int64_t, int64_t, int64_t, double>())
      .def("forward", &kvstrata::DecodeLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("before_attention", &kvstrata::DecodeLayers::before_attention,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("after_attention", &kvstrata::DecodeLayers::after_attention,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("cos_sin", &kvstrata::DecodeLayers::cos_sin, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("final_norm", &kvstrata::DecodeLayers::final_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
}
