"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over one packed batch of tokens.

Every linear layer runs once over all packed tokens of a step; attention goes through the
KV policy, which knows which tokens belong to which sequence.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.kv.attention_batch import AttentionBatch
from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.fused_decode import FusedDecode, store_and_attend
from kvstrata.model.config import ModelConfig
from kvstrata.model.group_quantized import cat_rows
from kvstrata.model.rotary import RotaryEmbedding, apply_rope, as_the_layers_attend, qkv_row_order

if TYPE_CHECKING:
    from kvstrata.model.native_decode import NativeDecode


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32 whatever the dtype (one fused op), scaled in the dtype, as transformers does.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    """q/k/v and output projections; the attention itself runs through the KV policy."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        # q, k and v fused into one GEMM: the weights are read once per step.
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        # Llama's attention_bias covers the output projection too; Qwen2's does not.
        output_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=output_bias)
        # Qwen3 norms each head's queries and keys before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def before_attention(layer: LlamaDecoderLayer, x, cos, sin):
    """The layer's q, k (rotated) and v [tokens, heads, head_dim]: the dense work up to attention."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    tokens = h.shape[0]
    q, k, v = attn.qkv_proj(h).split(attn.split_sizes, dim=-1)
    q, k = q.view(tokens, attn.num_heads, attn.head_dim), k.view(tokens, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(tokens, attn.num_kv_heads, attn.head_dim)


def after_attention(layer: LlamaDecoderLayer, x, attended):
    """Output projection, residual, MLP and residual: the dense work after attention."""
    x = x + layer.self_attn.o_proj(attended.reshape(attended.shape[0], -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def decode_all_layers(model: LlamaForCausalLM, x, cos, sin, step: FusedDecode):
    """Every layer of a step of decodes whose attention is one operator (kv/fused_decode.py): no Python of the KV
    seam between layers, so that under --compile the whole loop is one graph."""
    for index, layer in enumerate(model.layers):
        q, k, v = before_attention(layer, x, cos, sin)
        x = after_attention(layer, x, store_and_attend(index, q, k, v, step))
    return x


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)
        # The dense parts, replaced by compiled versions under --compile; attention stays eager.
        self.dense_parts = (before_attention, after_attention)

    def forward(self, x, cos, sin, kv: AttentionPolicy, batch: AttentionBatch, dense_parts=None) -> torch.Tensor:
        """`dense_parts`: what runs before and after attention instead of this layer's own (the compiled loop's)."""
        before, after = dense_parts or self.dense_parts
        q, k, v = before(self, x, cos, sin)
        kv.on_layer_input(self.layer, x, batch)
        return after(self, x, kv.attention(self.layer, q, k, v, batch))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.decode_all_layers = decode_all_layers  # compiled under --compile
        self.native_decode = None  # the compiled loop over all layers (native_decode.py), where the engine sets it
        self.lora = None  # the LoRA adapters (lora_layers.py), where the engine loads any

    def forward(self, input_ids, positions, kv: AttentionPolicy, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states [T, hidden] of the packed tokens."""
        x = self.embed_tokens(input_ids)
        fused = kv.fused_decode(batch, x.dtype)
        native = self._native_for(x)
        if fused is not None and native is not None:
            return native(x, positions, fused)  # RoPE and the final norm included
        decodes = self._decodes_apart(x, batch, native)
        if decodes:
            return self._forward_decodes_apart(x, positions, kv, batch, decodes)
        cos, sin = self._cos_sin(positions, x, native)
        if fused is not None:
            x = self.decode_all_layers(self, x, cos, sin, fused)
        else:
            dense_parts = native.dense_parts if native is not None else None
            for layer in self.layers:
                x = layer(x, cos, sin, kv, batch, dense_parts)
        return native.final_norm(x) if native is not None else self.norm(x)  # as the loop ends, where it could run

    def _decodes_apart(self, x: torch.Tensor, batch: AttentionBatch | None, native: NativeDecode | None) -> int:
        """How many of the step's first rows, its decodes, run on the compiled halves apart from its other rows: where
        the step is too large for the halves (a long prompt chunk beside decodes) and its decodes alone are not, so
        that a decode rounds as it does in a step of decodes alone (its products' activations to 8 bits, where the
        whole step's dense GEMM would take them in bfloat16). 0: the step runs as one."""
        if native is not None or batch is None:  # None: a policy that attends a context of its own (no step)
            return 0
        first = batch.groups[0]
        if first.chunk_start is not None or first.rows.stop >= len(x):
            return 0
        return first.rows.stop if self._native_for(x[: first.rows.stop]) is not None else 0

    def _forward_decodes_apart(self, x, positions, kv: AttentionPolicy, batch: AttentionBatch, decodes: int):
        """forward for a step whose first `decodes` rows run on the compiled halves, the others on the layers' own;
        attention and the policy's hooks see every row at once."""
        native = self.native_decode
        angles = zip(native.cos_sin(positions[:decodes]), self.rotary.cos_sin(positions[decodes:], x.dtype))
        cos, sin = (torch.cat(pair) for pair in angles)
        (native_before, native_after), split = native.dense_parts, slice(decodes, None)

        def before(layer, x, cos, sin):
            head = native_before(layer, x[:decodes], cos[:decodes], sin[:decodes])
            rest = layer.dense_parts[0](layer, x[split], cos[split], sin[split])
            return tuple(torch.cat(pair) for pair in zip(head, rest))

        def after(layer, x, attended):
            return torch.cat((native_after(layer, x[:decodes], attended[:decodes]),
                              layer.dense_parts[1](layer, x[split], attended[split])))

        for layer in self.layers:
            x = layer(x, cos, sin, kv, batch, (before, after))
        return torch.cat((native.final_norm(x[:decodes]), self.norm(x[split])))

    def _cos_sin(self, positions: torch.Tensor, x: torch.Tensor, native: NativeDecode | None):
        """RoPE's cos and sin for rows x: the compiled loop's angles where its halves take the rows (torch's may round
        apart), so that a row gets the same numbers whether its step runs the loop or the layers around a policy's
        attention."""
        return native.cos_sin(positions) if native is not None else self.rotary.cos_sin(positions, x.dtype)

    def _native_for(self, x: torch.Tensor) -> NativeDecode | None:
        """The compiled loop (native_decode.py) where the engine set one and it takes these hidden states; not in a
        step with rows on a LoRA adapter, whose updates are added where the projections run as modules."""
        if self.native_decode is None or (self.lora is not None and self.lora.active):
            return None
        return self.native_decode if self.native_decode.takes(x) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def layer_queries(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s queries [T, heads, head_dim] (after RoPE) of a residual stream x [T, hidden], e.g. an
        earlier layer's input (InfiniGen's speculation)."""
        native = self._native_for(x)  # what the layer itself runs in a step of these rows
        before = native.dense_parts[0] if native is not None else self.layers[layer].dense_parts[0]
        return before(self.layers[layer], x, *self._cos_sin(positions, x, native))[0]

    def compile_dense_parts(self) -> None:
        """Compile every layer's dense parts (one graph shared by all layers; torch makes the token
        count dynamic at the first new shape, so batches of any size reuse it), and a step of decodes whose
        attention is one operator as one graph of all layers."""
        compiled = (CompiledOrEager(before_attention), CompiledOrEager(after_attention))
        for layer in self.layers:
            layer.dense_parts = compiled
        # the graph's caller in C++ rather than Python (a few hundred kernel calls per step, each a Python line)
        compiled_step = CompiledOrEager(decode_all_layers, options={"cpp_wrapper": True})

        def decode_all_layers_any_width(model, x, cos, sin, step: FusedDecode):
            # the block tables widen as contexts grow: one graph for every width, not a first one for the width of
            # the first step (each compile of a whole-model graph is long)
            torch._dynamo.maybe_mark_dynamic(step.block_tables, 1)
            return compiled_step(model, x, cos, sin, step)

        self.decode_all_layers = decode_all_layers_any_width

    @staticmethod
    def state_dict_from_hf(hf: dict, config: ModelConfig) -> dict:
        """Rename a Hugging Face checkpoint's tensors and fuse q/k/v and gate/up (quantized ones stay quantized)."""
        out = {
            "embed_tokens.weight": hf["model.embed_tokens.weight"],
            "norm.weight": hf["model.norm.weight"],
        }
        out["lm_head.weight"] = (
            out["embed_tokens.weight"] if config.tie_word_embeddings else hf["lm_head.weight"]
        )
        order = qkv_row_order(config)  # q and k norms' channels follow it too
        for i in range(config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            qkv = _fused(hf, attn + "qkv_proj.weight", [attn + f"{p}_proj.weight" for p in "qkv"])
            out[dst + "self_attn.qkv_proj.weight"] = as_the_layers_attend(qkv, config)
            if config.attention_bias:
                bias = torch.cat([hf[attn + f"{p}_proj.bias"] for p in "qkv"])
                out[dst + "self_attn.qkv_proj.bias"] = as_the_layers_attend(bias, config)
            out[dst + "self_attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
            if config.qk_norm:
                head = slice(None) if order is None else order[: config.head_dim]
                out[dst + "self_attn.q_norm.weight"] = hf[attn + "q_norm.weight"][head]
                out[dst + "self_attn.k_norm.weight"] = hf[attn + "k_norm.weight"][head]
            if attn + "o_proj.bias" in hf:
                out[dst + "self_attn.o_proj.bias"] = hf[attn + "o_proj.bias"]
            out[dst + "mlp.gate_up_proj.weight"] = _fused(hf, src + "mlp.gate_up_proj.weight",
                                                          [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"])
            out[dst + "mlp.down_proj.weight"] = hf[src + "mlp.down_proj.weight"]
            out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
            out[dst + "post_attention_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        return out


def _fused(hf: dict, fused: str, parts: list[str]):
    """A fused product as the checkpoint ships it (Phi-3's q/k/v and gate/up, in the order fused here), else its
    parts' rows one after another."""
    return hf[fused] if fused in hf else cat_rows([hf[part] for part in parts])


class CompiledOrEager:
    """`fn` through torch.compile, or eager (with one warning) where the compiler cannot build it,
    e.g. a machine without a C++ compiler."""

    def __init__(self, fn, options: dict | None = None):
        self.eager, self.compiled = fn, torch.compile(fn, options=options)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                warnings.warn(f"torch.compile failed ({exc}); running {self.eager.__name__} eager", stacklevel=2)
                self.compiled = None
        return self.eager(*args)
