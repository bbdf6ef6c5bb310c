"""How much an error in each cached (layer, channel) of K and V costs the tokens that read the cache.

A stored context is decoded and placed in the cache; the tokens after it are computed fresh and attend over
it. So the quantity to measure is the loss of those later tokens as a function of the cached K and V, every
other layer's cache held as stored. For a small independent error e in one cached value, the loss grows by
about 1/2 h e^2, and the diagonal Fisher information (the mean squared gradient) stands in for h, as in
KVQuant's sensitivity-weighted calibration. A quantizer that gives channel (l, c) the step
s = const / sqrt(F[l, c]) spreads the expected loss evenly: the rate-distortion optimum for uniform
quantizers (quantize.py, "Steps from sensitivity").

The gradients come from one backward pass per window: the window's context K/V (from the engine's own
prefill) become leaves, and the scored tokens run through the engine's model with a dense attention policy
over those leaves plus their own new keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError
from kvstrata.kv.context_attention import AttendOverContext
from kvstrata.model.quantized_linear import KERNEL_LINEARS

if TYPE_CHECKING:
    from kvstrata.engine.llm_engine import LLMEngine


def context_gradients(engine: LLMEngine, token_ids: list[int], context_tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the summed next-token loss of token_ids[context_tokens:] with respect to the K and V
    of the first `context_tokens` tokens, [layers, context_tokens, kv_heads, head_dim] each."""
    if not 0 < context_tokens < len(token_ids) - 1:
        raise KvstrataError(f"context_tokens must leave at least two scored tokens; got {context_tokens} of "
                            f"{len(token_ids)}")
    model = engine.runner.model
    if any(isinstance(m, KERNEL_LINEARS) for m in model.modules()):
        raise KvstrataError("sensitivity needs float weights (e.g. --weights fp32): torch's int4/int8 kernels have "
                            "no gradient; the profile is keyed by the checkpoint, so it serves every weight form")
    k, v = compute_kv(engine, token_ids[:context_tokens])
    weight = next(model.parameters())
    leaves = [x[layer].to(weight.device, weight.dtype).clone().requires_grad_()
              for x in (k, v) for layer in range(x.shape[0])]
    num_layers = k.shape[0]
    scored = torch.tensor(token_ids[context_tokens:], device=weight.device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # gradients for the cache only
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            policy = AttendOverContext(leaves[:num_layers], leaves[num_layers:])
            hidden = model(scored, torch.arange(context_tokens, len(token_ids), device=weight.device), policy, None)
            logits = model.compute_logits(hidden).float()
            loss = torch.nn.functional.cross_entropy(logits[:-1], scored[1:], reduction="sum")
            grads = torch.autograd.grad(loss, leaves)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return torch.stack(grads[:num_layers]).float().cpu(), torch.stack(grads[num_layers:]).float().cpu()


def measure_sensitivity(engine: LLMEngine, token_ids: list[int], windows: int, context_tokens: int = 1024,
                        scored_tokens: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Mean squared gradient per (layer, KV channel) of K and of V, [L, kv_heads * head_dim] each, over
    `windows` windows spread over `token_ids`. A window's first token is left out: it is the attention sink,
    which the codec keeps at 8 bits, and its gradient dwarfs the rest."""
    span = context_tokens + scored_tokens
    if windows < 1 or len(token_ids) < span:
        raise KvstrataError(f"sensitivity needs at least one window of {span} tokens; got {windows} windows from "
                            f"{len(token_ids)} tokens")
    sums = None
    for start in np.linspace(0, len(token_ids) - span, windows).astype(int):
        grads = context_gradients(engine, token_ids[start : start + span], context_tokens)
        squares = [g[:, 1:].flatten(2).double().square().mean(dim=1) for g in grads]
        sums = squares if sums is None else [a + b for a, b in zip(sums, squares)]
    return tuple((s / windows).float().numpy() for s in sums)
