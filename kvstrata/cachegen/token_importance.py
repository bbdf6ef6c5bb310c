"""Which tokens of a saved context later queries will read most, and the step codes that follow from it.

An error in a cached token costs in proportion to the attention later queries pay it, and that attention is
very uneven: recent tokens and a few sink-like ones take most of it (the gradients behind the profile's
sensitivity, sensitivity.py, show it per token). The queries that will read a saved context are unknown when it
is saved, so the context's own last OBSERVED_TOKENS queries stand in for them, as SnapKV and H2O do: each token's
importance is the attention those queries pay it, averaged over the query heads.

Codes: a token whose importance is 2**c times the geometric mean of its layer's gets code round(c), its steps
2 ** (-c / TOKEN_CODE_STEPS) times the layer's (quantize.py): steps follow importance ** -1/4, a softened
version of the importance ** -1/2 that equal loss per token would ask for (the observed queries are not the
future ones), and V's grow at most 4x coarser. K's steps only grow finer: a coarser key can pull a large
share of attention to a token no query used to read, which the observed queries cannot foresee. Chosen on
the tuning texts (docs/BENCHMARKS.md, "Steps per token").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstrata.cachegen.quantize import TOKEN_CODE_LIMIT
from kvstrata.kv.context_attention import AttendOverContext

if TYPE_CHECKING:
    from kvstrata.engine.llm_engine import LLMEngine

OBSERVED_TOKENS = 128
V_COARSEST_CODE = -8  # V's steps grow at most 4x coarser: the observed queries do not see every later reader


class _RecordAttention(AttendOverContext):
    """AttendOverContext that also records, per layer, the attention every key receives [context + new]."""

    def __init__(self, context_k, context_v):
        super().__init__(context_k, context_v)
        self.received: list[torch.Tensor] = []

    def attention(self, layer, q, k_new, v_new, batch):
        keys = torch.cat((self.context_k[layer], k_new)).float()  # [T, kv_heads, D]
        group = q.shape[1] // keys.shape[1]
        scores = torch.einsum("mhd,thd->hmt", q.float(), keys.repeat_interleave(group, dim=1)) * q.shape[-1] ** -0.5
        context, m = self.context_k[layer].shape[0], q.shape[0]
        order = torch.arange(m, device=q.device)
        future = order[:, None] < order[None]  # new token i does not see new token j > i
        scores[:, :, context:] = scores[:, :, context:].masked_fill(future, float("-inf"))
        self.received.append(scores.softmax(-1).mean(dim=(0, 1)))
        return super().attention(layer, q, k_new, v_new, batch)


@torch.inference_mode()
def observed_importance(engine: LLMEngine, token_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention the context's last OBSERVED_TOKENS tokens pay each of its tokens, [layers, tokens]: K and V
    [layers, tokens, kv_heads, head_dim] are the context's own (compute_kv). A context of one token gets ones."""
    num_tokens = len(token_ids)
    observed = min(OBSERVED_TOKENS, num_tokens - 1)
    if observed < 1:
        return torch.ones(k.shape[0], num_tokens)
    first = num_tokens - observed
    model = engine.runner.model
    weight = next(model.parameters())
    policy = _RecordAttention(*([x[layer, :first].to(weight.device, weight.dtype) for layer in range(x.shape[0])]
                                for x in (k, v)))
    positions = torch.arange(first, num_tokens, device=weight.device)
    model(torch.tensor(token_ids[first:], device=weight.device), positions, policy, None)
    return torch.stack(policy.received).cpu()


def token_codes(importance: torch.Tensor, kind: str) -> torch.Tensor:
    """Step codes int8 [layers, tokens] for the K ("k") or V ("v") tensor of tokens with `importance`
    [layers, tokens]. The first token is the attention sink, which the codec keeps at 8 bits: it gets code 0
    and stays out of the mean."""
    logs = importance.double().clamp_min(1e-12).log2()
    if logs.shape[1] > 1:
        logs = logs - logs[:, 1:].mean(dim=1, keepdim=True)
    lowest = 0 if kind == "k" else V_COARSEST_CODE
    codes = logs.round().clamp(lowest, TOKEN_CODE_LIMIT).to(torch.int8)
    codes[:, 0] = 0
    return codes
