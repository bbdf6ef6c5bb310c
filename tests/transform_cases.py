"""Small K and V whose KV heads' channels are correlated, and profiles with transforms calibrated on them: shared by
the transform coding tests (the codec's and the KV store's)."""

from __future__ import annotations

import numpy as np
import torch

from kvstrata.cachegen.profile import CodecProfile, ProfileBuilder, TensorProfile
from kvstrata.cachegen.transform import MomentBuilder, rope_angles
from kvstrata.model.rotary import apply_rope

LAYERS, HEADS, DIM = 3, 2, 8
FREQUENCIES = (1.0 / 100.0 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32)  # as rope_inverse_frequencies gives


def correlated(tokens: int, seed: int, rotary: bool) -> torch.Tensor:
    """[L, T, H * D] whose heads' vectors (before RoPE, for keys) lie near two directions, plus a large offset;
    keys then rotated by RoPE at positions 0 ... T - 1, as a cache holds them."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(LAYERS, HEADS, 2, DIM, generator=torch.Generator().manual_seed(99))
    heads = torch.einsum("lthr,lhrd->lthd", 3 * torch.randn(LAYERS, tokens, HEADS, 2, generator=g), basis)
    heads = heads + 0.05 * torch.randn(LAYERS, tokens, HEADS, DIM, generator=g) + 2.0
    if rotary:
        heads = apply_rope(heads.double(), *rope_angles(FREQUENCIES, 0, tokens)).float()
    return heads.reshape(LAYERS, tokens, HEADS * DIM)


def sensitivity(seed: int = 5) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(LAYERS, HEADS * DIM, generator=g) + 0.1).numpy()


def profile_of(kind: str, windows: int = 4, tokens: int = 200) -> TensorProfile:
    rotary = kind == "k"
    builder = ProfileBuilder(MomentBuilder(HEADS, FREQUENCIES if rotary else None))
    for seed in range(windows):
        builder.add(correlated(tokens, seed, rotary))
    return builder.build(sensitivity())


def codec_profile() -> CodecProfile:
    """A model's profile of K and V with their transforms, as `kvstrata calibrate cachegen` writes it."""
    return CodecProfile("abcd1234abcd1234", profile_of("k"), profile_of("v"), 4)
