"""Transform coding: each KV head's channels decorrelated before they are quantized.

Steps from sensitivity (quantize.py) treat every channel apart, but a KV head's channels are correlated, and
keys before RoPE lie close to a few directions. A transform that turns each head's vector into uncorrelated
components packs its variance into a few of them, and a component with little variance costs almost no bits
at a given step (papers/cachegen.md §2.2 quantizes channel by channel; this stage is ours).

Per (layer, KV head), with x the head's vector (a key first turned back by RoPE's angle at its position):

    y = w * x          w = sqrt(sensitivity), so an error e in y costs about e^2 in any channel
    z = R^T (y - m)    m: the calibration mean of y; R: the eigenvectors of y's calibration covariance

R is orthogonal, so squared error in z is squared error in y: one step for every component is, as the
sensitivity steps are channel by channel, the rate-distortion optimum of uniform quantizers, now over
uncorrelated components (a Karhunen-Loeve transform in sensitivity-weighted units). RoPE mixes channel i with
channel i + D/2, so a key's two channels share the mean of their sensitivities. m and R come from the
calibration text (profile.py); the decoder inverts the transform with the same profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvstrata.model.rotary import apply_rope, rope_cos_sin, undo_rope

SENSITIVITY_FLOOR = 1e-6  # of the head's mean: a channel no loss was seen on is still coded at a finite step


def transform_weights(sensitivity: np.ndarray, num_heads: int, rotary: bool) -> np.ndarray:
    """w [L, H, D] from a tensor's sensitivity [L, H * D] (finite, non-negative, some in every head: the profile
    checks); `rotary`: keys coded before RoPE."""
    f = sensitivity.astype(np.float64).reshape(sensitivity.shape[0], num_heads, -1)
    if rotary:
        half = f.shape[-1] // 2
        f = 0.5 * (f + np.roll(f, half, axis=-1))
    return np.sqrt(np.maximum(f, SENSITIVITY_FLOOR * f.mean(axis=-1, keepdims=True)))


def rope_angles(inverse_frequencies: np.ndarray, first_position: int, num_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D] of RoPE at positions first_position ... first_position + T - 1, as the model computes
    them, so that undoing RoPE gives back the key before it."""
    positions = torch.arange(first_position, first_position + num_tokens)
    return rope_cos_sin(torch.from_numpy(inverse_frequencies), positions, torch.float32)


@dataclass
class ChannelTransform:
    weight: np.ndarray  # [L, H, D], float64 (from the profile's sensitivity: transform_weights)
    mean: np.ndarray  # [L, H, D], weighted units, float32 as stored
    rotation: np.ndarray  # [L, H, D, D], float32 as stored: orthogonal, column j is component j
    inverse_frequencies: np.ndarray | None  # RoPE's [D / 2] for keys coded before RoPE; None: coded as cached

    def forward(self, x: torch.Tensor, first_position: int) -> torch.Tensor:
        """Components [L, T, H * D] of x [L, T, H * D] whose first token sits at `first_position`. In float32, as
        one product per (layer, head) with the weights and the mean folded in: a chunk's inverse is on the time
        to first token."""
        encode, offset, _, _ = self._matrices
        heads = self._heads(x)
        if self.inverse_frequencies is not None:
            heads = undo_rope(heads, *rope_angles(self.inverse_frequencies, first_position, x.shape[1]))
        return (torch.einsum("lthd,lhde->lthe", heads, encode) + offset).reshape(x.shape)

    def inverse(self, z: torch.Tensor, first_position: int) -> torch.Tensor:
        _, _, decode, mean = self._matrices
        heads = torch.einsum("lthe,lhed->lthd", self._heads(z), decode) + mean
        if self.inverse_frequencies is not None:
            heads = apply_rope(heads, *rope_angles(self.inverse_frequencies, first_position, z.shape[1]))
        return heads.reshape(z.shape)

    def layers(self, first: int, end: int) -> ChannelTransform:
        """The transform of layers first ... end - 1 alone, for a tensor of those layers only (KV store objects);
        kept, so every reader and writer of those layers shares its products."""
        if not 0 <= first < end <= len(self.weight):
            raise ValueError(f"layers {first} to {end - 1} are not among the transform's {len(self.weight)}")
        if (first, end) == (0, len(self.weight)):
            return self
        if (first, end) not in self._slices:
            span = slice(first, end)
            self._slices[first, end] = ChannelTransform(self.weight[span], self.mean[span], self.rotation[span],
                                                        self.inverse_frequencies)
        return self._slices[first, end]

    @cached_property
    def _slices(self) -> dict[tuple[int, int], ChannelTransform]:
        return {}

    @cached_property
    def _matrices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per (layer, head), z = x E + e and x = z F + f, float32: E = diag(w) R and F = R^T diag(1 / w)
        [L, H, D, D], e = -m R and f = m / w [L, 1, H, D] (broadcast over tokens). Contiguous whatever the layout
        of the profile's arrays (a calibrated rotation is transposed, a loaded one is not): products over other
        strides take other kernels, which round differently, and a reader must decode what the writer would."""
        weight = torch.from_numpy(self.weight)
        rotation = torch.from_numpy(self.rotation).double()
        mean = torch.from_numpy(self.mean).double()
        encode = weight[..., :, None] * rotation
        decode = rotation.transpose(-1, -2) / weight[..., None, :]
        offset = -torch.einsum("lhd,lhde->lhe", mean, rotation)
        matrices = encode, offset[:, None], decode, (mean / weight)[:, None]
        return tuple(matrix.float().contiguous() for matrix in matrices)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        num_layers, num_heads, dim = self.weight.shape
        if x.dim() != 3 or x.shape[0] != num_layers or x.shape[2] != num_heads * dim:
            raise ValueError(f"a tensor of shape {tuple(x.shape)} does not fit a transform of {num_layers} layers x "
                             f"{num_heads} heads x {dim}")
        return x.float().reshape(num_layers, x.shape[1], num_heads, dim)


class MomentBuilder:
    """Sums of pre-RoPE vectors and their outer products per (layer, head), over calibration windows."""

    def __init__(self, num_heads: int, inverse_frequencies: np.ndarray | None):
        self.num_heads, self.inverse_frequencies = num_heads, inverse_frequencies
        self.count, self.sum, self.products = 0, 0.0, 0.0

    def add(self, x: torch.Tensor) -> None:
        """x [L, T, H * D] of a window starting at position 0; its first token (the attention sink, coded at 8
        bits as the chunk's anchor) is left out."""
        heads = x.float().reshape(x.shape[0], x.shape[1], self.num_heads, -1)
        if self.inverse_frequencies is not None:
            heads = undo_rope(heads, *rope_angles(self.inverse_frequencies, 0, x.shape[1]))
        heads = heads[:, 1:].double()
        self.count += heads.shape[1]
        self.sum = self.sum + heads.sum(dim=1)
        self.products = self.products + torch.einsum("lthd,lthe->lhde", heads, heads)

    def build(self, sensitivity: np.ndarray) -> ChannelTransform:
        weight = transform_weights(sensitivity, self.num_heads, self.inverse_frequencies is not None)
        w = torch.from_numpy(weight)
        mean = self.sum / self.count
        covariance = self.products / self.count - mean[..., :, None] * mean[..., None, :]
        weighted = covariance * w[..., :, None] * w[..., None, :]
        _, rotation = torch.linalg.eigh(weighted)
        return ChannelTransform(weight, (mean * w).float().numpy(), rotation.float().numpy(), self.inverse_frequencies)
