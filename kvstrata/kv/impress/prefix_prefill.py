"""A request's new tokens prefilled over a stored prefix of which each layer reads only what it needs (IMPRESS §3,
papers/impress.md): in every layer, the selector scores the prefix from what it has read so far (the probe keys,
or every key for keys-only H2O), the prefix source then reads the chosen tokens' K and V (with `attend` "read",
those of every token of the stored chunks holding them), and the new tokens attend over those plus themselves.
The model runs layer after layer, so each layer's choice sees the queries that the layers before it produced
from their own chosen tokens.

What the prefill leaves is what the paged cache receives: K and V of the prefix (zeros where a layer did not read
a token) and of the new tokens, and per layer the prefix tokens it did not read (`PreloadedKV.unread`), which
no later step attends to (kv/impress/unread_tokens.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.impress.prefix_selection import PrefixSelector
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.kv.reference_attention import causal_attention


class StoredPrefix(Protocol):
    """A prefix of `num_tokens` tokens whose K/V are read on demand, layer by layer."""

    num_tokens: int

    def scoring_keys(self, layer: int) -> torch.Tensor:
        """What the selector scores with in `layer`: the probe KV heads' keys, or every key [n, heads, D]."""

    def read_units(self, layer: int) -> torch.Tensor:
        """The unit (stored chunk) each prefix token is read in, in `layer` [n]."""

    def chosen_kv(self, layer: int, chosen: torch.Tensor, important: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [chosen.sum(), kv_heads, D] of the tokens `chosen` (a mask [n]) in `layer`, in order;
        `important` (a mask [n]; default: all of `chosen`) is what the layer's rule chose of them, for the
        store's use counts."""


class _PerLayer:
    """One of the prefix's per-layer reads, indexed by layer, as `PrefixSelector` asks for them."""

    def __init__(self, read):
        self.read = read

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.read(layer)


class PrefillOverChosenPrefix(AttentionPolicy):
    """New tokens at positions n, n+1, ... of one sequence, over a prefix of n tokens read per layer as `method`
    ("impress" or "h2o-keys") chooses, from the first `selection_rows` new tokens; `attend`: every token of the
    chunks read ("read") or only the chosen ones ("chosen")."""

    def __init__(self, prefix: StoredPrefix, method: str, ratio: float, rule: str, attend: str, num_layers: int,
                 kv_shape: tuple[int, int], num_new: int, selection_rows: int):
        super().__init__(storage=None)
        self.prefix = prefix
        self.selector = PrefixSelector(_PerLayer(prefix.scoring_keys), method, ratio, selection_rows, rule=rule,
                                       read_units=_PerLayer(prefix.read_units), attend=attend)
        n = prefix.num_tokens
        self.k = torch.zeros(num_layers, n + num_new, *kv_shape)
        self.v = torch.zeros_like(self.k)
        self.unread = torch.ones(num_layers, n + num_new, dtype=torch.bool)
        self.unread[:, n:] = False

    def begin_step(self, batch) -> None:
        pass

    def end_step(self) -> None:
        pass

    def attention(self, layer, q, k_new, v_new, batch):
        n = self.prefix.num_tokens
        chosen = self.selector(layer, q, k_new).cpu()
        k, v = self.prefix.chosen_kv(layer, chosen, self.selector.decisions[layer].important)
        positions = chosen.nonzero()[:, 0]
        self.k[layer, positions], self.v[layer, positions] = k, v
        self.k[layer, n:], self.v[layer, n:] = k_new.float().cpu(), v_new.float().cpu()
        self.unread[layer, positions] = False
        device, dtype = q.device, q.dtype
        key_positions = torch.cat((positions, torch.arange(n, n + q.shape[0]))).to(device)
        keys = torch.cat((k.to(device, dtype), k_new))
        values = torch.cat((v.to(device, dtype), v_new))
        q_positions = torch.arange(n, n + q.shape[0], device=device)[None]
        return causal_attention(q[None], keys[None], values[None], q_positions, key_positions[None])[0]

    def preloaded(self) -> PreloadedKV:
        """The prefix and new tokens' K/V for the paged cache, with what each layer left unread."""
        return PreloadedKV(0, self.k, self.v, unread=self.unread)
