"""The one exact attention function every attention policy calls on the K/V it decided to use.

Keys carry explicit positions: a policy may hand over every cached token, a subset, a per-layer
subset or padded rows, and the mask follows from the positions alone (position -1: no key).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NO_KEY = -1  # the position of a padding row among the keys
# A prompt chunk of fewer queries attends in one masked call (prompt_chunk_in_two_calls): below it the second call
# and the merge cost about what the skipped half of the chunk's own block saves, and either form may win; from it
# the two calls won in every case measured (BENCHMARKS.md, "Long prompts: time to first token").
CHUNK_SPLIT_FROM_QUERIES = 256


def causal_mask(q_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[n, Tq, Tk] bool: a query at position p sees the keys at positions <= p (and never a padding row).

    q_positions [n, Tq], key_positions [n, Tk]. Policies that attend over the same keys in every layer
    build this once per step and pass it to `attend`.
    """
    return (key_positions[:, None, :] <= q_positions[:, :, None]) & (key_positions[:, None, :] != NO_KEY)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention of q [n, Tq, heads, D] over k, v [n, Tk, kv_heads, D] where `mask`
    [n, Tq, Tk] allows. Grouped-query attention: heads must be a multiple of kv_heads. Every query must
    see at least one key. Returns [n, Tq, heads, D]."""
    if q.shape[1] == 1:
        return _single_query(q, k, v, mask)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _single_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Decode attention as two batched products over [kv_heads, n] (no copy of K or V when storage hands them
    over heads-outermost); with one query per sequence, torch's CPU flash kernel spends most of its time on
    set-up (measured: benchmarks/profile_decode.py)."""
    return attend_per_kv_head(q, k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3), mask[None])


def attend_per_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       with_weights: bool = False):
    """Attention of q [n, Tq, heads, D] where each KV head reads keys of its own: k, v [kv_heads, n, Tk, D] (row j
    of head h is that head's j-th key) and mask [kv_heads or 1, n, Tq, Tk]. Returns [n, Tq, heads, D], and with
    `with_weights` also the softmax weights [kv_heads, n, Tq, group, Tk] (H2O accumulates them)."""
    n, num_q, heads, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    # the query heads that share one KV head side by side: [kv_heads, n, Tq * group, D]
    q = q.view(n, num_q, kv_heads, group, dim).permute(2, 0, 1, 3, 4).reshape(kv_heads, n, num_q * group, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * dim**-0.5  # [kv_heads, n, Tq * group, Tk]
    if num_q > 1:
        mask = mask[:, :, :, None, :].expand(-1, -1, -1, group, -1).reshape(mask.shape[0], n, num_q * group, -1)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.matmul(weights, v).view(kv_heads, n, num_q, group, dim).permute(1, 2, 0, 3, 4)
    out = out.reshape(n, num_q, heads, dim)
    return (out, weights.view(kv_heads, n, num_q, group, -1)) if with_weights else out


def prompt_chunk_in_two_calls(q: torch.Tensor) -> bool:
    """Whether a prompt chunk of queries q [1, Tq, heads, D] attends quicker by `attend_prompt_chunk` than by `attend`
    with its mask: on the CPU, from CHUNK_SPLIT_FROM_QUERIES queries."""
    return q.device.type == "cpu" and q.shape[1] >= CHUNK_SPLIT_FROM_QUERIES


def attend_prompt_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """`attend` for a prompt chunk over its whole context, on the CPU: q [1, Tq, heads, D] at positions start ..
    start + Tq - 1, key j of k, v [1, Tk, kv_heads, D] at position j (rows from start + Tq on: padding). With a mask,
    torch's CPU flash kernel computes every (query, key) pair and then masks half of the chunk's own block away;
    here the keys before the chunk (every query sees them) and the chunk's own keys (causal from its first row,
    which the kernel skips block by block) are two unmasked calls, merged by their log-sum-exps."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, D], as the kernel reads them
    end = start + q.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's CPU kernel, with its log-sum-exp
    own, own_lse = flash(q, k[:, :, start:end], v[:, :, start:end], is_causal=True)
    if start == 0:
        return own.transpose(1, 2)
    before, before_lse = flash(q, k[:, :, :start], v[:, :, :start])
    lse = torch.logaddexp(own_lse, before_lse)
    out = own * (own_lse - lse).exp().unsqueeze(-1).to(own.dtype)
    out += before * (before_lse - lse).exp().unsqueeze(-1).to(before.dtype)
    return out.transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                     key_positions: torch.Tensor) -> torch.Tensor:
    """`attend` with the mask made from the queries' and keys' positions ([n, Tq] and [n, Tk])."""
    return attend(q, k, v, causal_mask(q_positions, key_positions))
