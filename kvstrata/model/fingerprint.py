"""A short digest that identifies a model's weights, so files made for one model are refused by another."""

from __future__ import annotations

import hashlib

import torch

from kvstrata.model.config import ModelConfig
from kvstrata.model.group_quantized import GroupQuantized


def model_fingerprint(state: dict[str, torch.Tensor | GroupQuantized], config: ModelConfig) -> str:
    """sha256 over the architecture's shape and a sample of every weight tensor (16 hex digits).

    `state` is the checkpoint as the model names it, before --weights picks a form, so the same
    checkpoint has one fingerprint in every weight format. Sampling (each tensor's first and last 256
    values, and its shape) keeps this fast for large models while telling apart any two checkpoints
    that differ in more than a few untouched weights. Samples are rounded to bfloat16, so the same
    checkpoint loaded in float32 or bfloat16 agrees.
    """
    digest = hashlib.sha256()
    shape = (config.architecture, config.num_layers, config.num_kv_heads, config.head_dim, config.vocab_size)
    digest.update(repr(shape).encode())
    if config.long_rope is not None:  # the same weights rotate keys otherwise for long contexts than for short
        digest.update(repr(config.rope_freq_factors).encode())
    for name, tensor in sorted(state.items()):
        if isinstance(tensor, GroupQuantized):
            sample = tensor.sample(256)
        else:
            flat = tensor.detach().reshape(-1)
            sample = torch.cat([flat[:256], flat[-256:]])
        sample = sample.to(device="cpu", dtype=torch.bfloat16).float()
        digest.update(name.encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
