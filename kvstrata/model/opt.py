"""OPT decoder (LayerNorm, learned positions, ReLU, biases) over one packed batch of tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_batch import AttentionBatch
from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.model.config import ModelConfig

# OPT's learned position table starts with two rows its training never used for text.
POSITION_OFFSET = 2
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x, kv: AttentionPolicy, batch: AttentionBatch) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = kv.attention(self.layer, q, k, v, batch)
        return self.out_proj(out.reshape(tokens, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.norm_before = config.norm_before
        self.self_attn = OPTAttention(config, layer)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x, kv: AttentionPolicy, batch: AttentionBatch) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.norm_before else x
        kv.on_layer_input(self.layer, x, batch)
        x = x + self.self_attn(h, kv, batch)
        if not self.norm_before:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.norm_before else x
        x = x + self.fc2(self.activation(self.fc1(h)))
        return x if self.norm_before else self.final_layer_norm(x)


class OPTForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.activation not in ACTIVATIONS:
            raise KvstrataError(f"OPT activation {config.activation!r} is not supported; supported: relu, gelu")
        self.config = config
        embed_dim = config.word_embed_proj_dim or config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        self.project_in = nn.Linear(embed_dim, config.hidden_size, bias=False) if config.word_embed_proj_dim else None
        self.project_out = nn.Linear(config.hidden_size, embed_dim, bias=False) if config.word_embed_proj_dim else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_layers))
        # OPT-350m (post-norm) has no final layer norm.
        self.final_layer_norm = nn.LayerNorm(config.hidden_size) if config.norm_before else None
        self.lm_head = nn.Linear(embed_dim, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv: AttentionPolicy, batch: AttentionBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, kv, batch)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def layer_queries(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s queries [T, heads, head_dim] of a residual stream x [T, hidden], e.g. an earlier
        layer's input (InfiniGen's speculation; OPT has no RoPE, so `positions` are not needed)."""
        target = self.layers[layer]
        h = target.self_attn_layer_norm(x) if target.norm_before else x
        attn = target.self_attn
        return attn.qkv_proj(h)[:, : attn.num_heads * attn.head_dim].view(x.shape[0], attn.num_heads, attn.head_dim)

    @staticmethod
    def state_dict_from_hf(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Rename a Hugging Face OPT checkpoint's tensors and fuse q/k/v."""
        hf = {k.removeprefix("model.").removeprefix("decoder."): v for k, v in hf.items()}
        out = {k: v for k, v in hf.items() if not k.startswith("layers.") and k != "lm_head.weight"}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if config.tie_word_embeddings else hf["lm_head.weight"]
        for i in range(config.num_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [p + f"self_attn.{n}_proj.{kind}" for n in "qkv"]
                if parts[0] in hf:
                    out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([hf[n] for n in parts])
            for name, tensor in hf.items():
                if name.startswith(p) and ".q_proj." not in name and ".k_proj." not in name and ".v_proj." not in name:
                    out[name] = tensor
        return out
