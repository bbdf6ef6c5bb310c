"""A step of decodes through every layer in one call of the weights' compiled kernels (model/kernels/
decode_layers.cpp): for a model whose products all run on GGUF blocks (block_linear.py) and whose KV policy offers
the one-operator store-and-attend (kv/fused_decode.py). Under any other KV policy or format, the same kernels run
each layer's work before and after attention (`dense_parts`), and the policy's attention runs between them.

On a small model a batch-1 decode step is half products, half a few hundred small operations (norms, RoPE,
residuals, the attention call), and each of those costs torch microseconds of dispatch and allocation whether it
runs eagerly or from a torch.compile graph; the compiled loop runs them as plain loops. It computes what
llama.py's decode_all_layers computes (tests/test_native_decode.py holds the two equal).
"""

from __future__ import annotations

import torch

from kvstrata.kv.fused_decode import FusedDecode
from kvstrata.model import block_linear
from kvstrata.model.block_linear import DENSE_FROM_ROWS, BlockLinear


class NativeDecode:
    def __init__(self, layers):
        self.layers = layers

    @classmethod
    def for_model(cls, model) -> NativeDecode | None:
        """The loop over `model`'s layers and its final norm, or None where a layer is not what the loop computes: a
        projection not on blocks, or with a bias other than q/k/v's (Qwen2's), norms not in float32, or no compiled
        kernels."""
        compiled = block_linear.kernel()
        if compiled is None or not hasattr(model, "layers"):
            return None
        norms, codes, scales, mins, bits, qkv_biases, head_norms = [], [], [], [], [], [], []
        none = torch.empty(0)
        for layer in model.layers:
            attention = layer.self_attn
            products = (attention.qkv_proj, attention.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not all(isinstance(p, BlockLinear) and (p.bias is None or p is attention.qkv_proj) for p in products):
                return None
            layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if attention.q_norm is not None:
                layer_norms += [attention.q_norm, attention.k_norm]
            float_weights = [norm.weight for norm in layer_norms] + [p.bias for p in products if p.bias is not None]
            if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in float_weights):
                return None
            norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            qkv_biases.append(none if attention.qkv_proj.bias is None else attention.qkv_proj.bias.detach())
            head_norms += [none, none] if attention.q_norm is None else [attention.q_norm.weight.detach(),
                                                                         attention.k_norm.weight.detach()]
            codes += [p.codes for p in products]
            scales += [p.scales for p in products]
            mins += [p.mins for p in products]
            bits += [p.bits for p in products]
        c, final_norm = model.config, model.norm.weight.detach()
        if final_norm.dtype != torch.float32:
            return None
        return cls(compiled.DecodeLayers(norms, codes, scales, mins, bits, qkv_biases, head_norms, final_norm,
                                         model.rotary.inv_freq.float(), c.num_heads, c.num_kv_heads, c.head_dim,
                                         c.norm_eps))

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether this step's hidden states go through the compiled layers (the loop, or its halves): float32, and
        fewer rows than the products switch to dense GEMMs at (block_linear.DENSE_FROM_ROWS)."""
        return x.dtype == torch.float32 and len(x) < DENSE_FROM_ROWS

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, step: FusedDecode) -> torch.Tensor:
        """The final norm of the last layer's output [n, hidden] for hidden states x [n, hidden] at `positions` [n]
        (RoPE's angles are computed inside); stores every layer's new K/V in the step's pools."""
        return self.layers.forward(x, positions, step.k_pools, step.v_pools, step.slots, step.block_tables,
                                   step.context_lens, step.min_shared_tokens, step.window)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [n, 1, head_dim] at `positions` [n], as the loop computes them (torch's may round
        apart): a step of these rows that runs the layers' halves rotates by them, and gets the loop's numbers."""
        return tuple(self.layers.cos_sin(positions))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final norm of x [n, hidden], as the loop computes it."""
        return self.layers.final_norm(x)

    @property
    def dense_parts(self):
        """A layer's work before and after attention, as llama.py's before_attention and after_attention take and
        return it, in the compiled kernels."""
        return self._before_attention, self._after_attention

    def _before_attention(self, layer, x, cos, sin):
        return tuple(self.layers.before_attention(layer.layer, x, cos, sin))

    def _after_attention(self, layer, x, attended):
        return self.layers.after_attention(layer.layer, x, attended)
