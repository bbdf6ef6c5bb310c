"""Rotary position embeddings (RoPE), computed in fp32 for the positions of one step.

RoPE turns each head's channel i with channel i + head_dim / 2 (the halves layout of Hugging Face checkpoints). A
model whose RoPE turns only its first `rotary_dim` channels (Phi-4-mini) pairs i with i + rotary_dim / 2 instead
and leaves the rest alone. Its q and k rows are put in another order at load (`qkv_row_order`): the turned pairs
at i and i + head_dim / 2, the channels left alone between them, which turn by 0 (their frequencies are 0). q.k is
the same sum in another order, so every layer computes what the model's own order computes, through one RoPE."""

from __future__ import annotations

import math

import torch

from kvstrata.model.config import ModelConfig, RopeScaling
from kvstrata.model.group_quantized import GroupQuantized, scale_rows


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2]: those of the turned channels, then 0 for each pair RoPE leaves alone."""
    dim = config.rotary_dim or config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:  # the same scaling as llama.cpp ships it, worked out per frequency
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, device="cpu")
    return torch.nn.functional.pad(inv_freq, (0, (config.head_dim - dim) // 2))


def qkv_row_order(config: ModelConfig) -> torch.Tensor | None:
    """Where each row of the fused q/k/v product comes from, for a model whose RoPE turns part of each head (see
    the module's docstring); None for every other model. Each head's q and k rows are reordered within the head,
    v's stay."""
    if config.rotary_dim is None:
        return None
    dim, turned = config.head_dim, config.rotary_dim
    left = (dim - turned) // 2  # channels left alone in each half of the new order
    head = torch.cat((torch.arange(turned // 2), turned + torch.arange(left),
                      turned // 2 + torch.arange(turned // 2), turned + left + torch.arange(left)))
    heads = config.num_heads + config.num_kv_heads  # q's, then k's
    rows = (torch.arange(heads)[:, None] * dim + head).reshape(-1)
    return torch.cat((rows, torch.arange(heads * dim, heads * dim + config.num_kv_heads * dim)))


def as_the_layers_attend(qkv: torch.Tensor | GroupQuantized, config: ModelConfig) -> torch.Tensor | GroupQuantized:
    """Rows of the fused q/k/v product (or of its bias, or of an adapter's update of it) as the layers use them: the
    query channels RoPE turns carrying LongRoPE's attention factor (ModelConfig.query_scale; transformers multiplies
    q's and k's turned channels by its root and leaves the others), each head's q and k channels in RoPE's order
    (qkv_row_order)."""
    if config.query_scale != 1.0:
        factors = torch.ones(config.num_heads + 2 * config.num_kv_heads, config.head_dim)
        factors[: config.num_heads, : config.rotary_dim or config.head_dim] = config.query_scale
        qkv = scale_rows(qkv, factors.reshape(-1))
    order = qkv_row_order(config)
    if order is None:
        return qkv
    return qkv.select_rows(order) if isinstance(qkv, GroupQuantized) else qkv[order]


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by `factor`."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Not a module on purpose: the frequencies stay fp32 whatever dtype the model is cast to."""

    def __init__(self, config: ModelConfig):
        self.inv_freq = rope_inverse_frequencies(config)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, 1, head_dim] for the packed tokens' positions."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_cos_sin(self.inv_freq, positions, dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] at `positions` for RoPE's inverse frequencies [head_dim / 2], angles in fp32."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the per-token angles (halves layout, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of `apply_rope` (a rotation by the opposite angles): keys as they were before RoPE."""
    return apply_rope(x, cos, -sin)
