"""What InfiniGen fetches for one layer's decodes, laid out per KV head (`FetchPlan`).

Each KV head's rows hold its chosen tokens of every sequence one after another, each sequence's ascending and
followed by the step's own token (its K/V is written into that row at attention). The heads' rows are padded to
the longest head's only, not every (head, sequence) to the longest one's: the union of a KV head's query heads'
choices varies a lot between sequences and heads, and padding each to the widest would gather, copy and attend
over rows nobody chose. Attention reads each
sequence's run of rows by its offsets (kv/kernels/fetched_attention.cpp; on the torch path, `attend_over_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.kv.offload.speculation import Selection
from kvstrata.kv.reference_attention import NO_KEY, attend_per_kv_head


@dataclass
class FetchPlan:
    positions: torch.Tensor  # long [kv_heads, R]: each row's token position; NO_KEY after a head's last row
    slots: torch.Tensor  # long [kv_heads, R]: where each row lies in the host pool (padding rows: a real slot)
    offsets: torch.Tensor  # long [kv_heads, n + 1]: sequence s owns rows offsets[g, s] .. offsets[g, s + 1] - 1
    per_query_head: torch.Tensor  # long [n]: tokens each query head of a sequence chose

    def runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """long [kv_heads, n] each: the first row of each sequence's run and how many rows it has."""
        return self.offsets[:, :-1], self.offsets.diff(dim=-1)

    @property
    def own_rows(self) -> torch.Tensor:
        """long [kv_heads, n]: the row of each sequence's own token (the last of its rows)."""
        return self.offsets[:, 1:] - 1

    def chosen_rows(self) -> torch.Tensor:
        """bool [kv_heads, R]: rows of tokens that were chosen (not padding, not the step's own token)."""
        chosen = self.positions >= 0
        chosen[torch.arange(chosen.shape[0], device=chosen.device)[:, None], self.own_rows] = False
        return chosen

    def sequence_of_rows(self) -> torch.Tensor:
        """long [kv_heads, R]: the sequence each row belongs to; n for padding rows."""
        rows = torch.arange(self.positions.shape[1], device=self.positions.device)
        return torch.searchsorted(self.offsets[:, 1:].contiguous(), rows.expand(self.positions.shape).contiguous(),
                                  right=True)

    def chosen_mask(self, width: int) -> torch.Tensor:
        """float [kv_heads, n, width]: 1 at the positions each KV head fetched for each sequence (diagnostics)."""
        kv_heads, n = self.offsets.shape[0], self.offsets.shape[1] - 1
        chosen = self.chosen_rows()
        heads = torch.arange(kv_heads, device=chosen.device)[:, None].expand_as(chosen)
        mask = torch.zeros(kv_heads, n, width, device=chosen.device)
        mask[heads[chosen], self.sequence_of_rows()[chosen], self.positions[chosen]] = 1.0
        return mask


def attend_over_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FetchPlan) -> torch.Tensor:
    """The torch path of attention over fetched rows: q [n, heads, D] over k, v [kv_heads, R, D] laid out by `plan`.
    Each sequence's run of rows is taken out as its own padded row of keys, so that no sequence's values (a NaN from
    a corrupt cache among them) enter another's output, even with weight 0."""
    starts, lengths = plan.runs()
    steps = torch.arange(int(lengths.max()), device=k.device)
    valid = steps < lengths[..., None]  # [kv_heads, n, W]
    index = (starts[..., None] + torch.minimum(steps, lengths[..., None] - 1)).flatten(1)
    kv_heads, n, width = valid.shape
    runs = [x.gather(1, index[..., None].expand(-1, -1, x.shape[-1])).view(kv_heads, n, width, -1) for x in (k, v)]
    return attend_per_kv_head(q[:, None], *runs, valid[:, :, None]).flatten(0, 1)


def plan_from_selection(selection: Selection, slots: torch.Tensor, positions: torch.Tensor,
                        q_positions: torch.Tensor) -> FetchPlan:
    """The torch path's plan: `selection` over keys with slots and positions [n, Tk], the step's tokens at
    q_positions [n]."""
    kv_heads = selection.columns.shape[0]
    chosen_positions = positions[None].expand(kv_heads, -1, -1).gather(-1, selection.columns)
    chosen_positions = chosen_positions.masked_fill(~selection.valid, NO_KEY)
    chosen_slots = slots[None].expand(kv_heads, -1, -1).gather(-1, selection.columns)
    # the own token's row: its K/V is written at attention, so any real slot serves (each sequence's first)
    all_positions = torch.cat((chosen_positions, q_positions[None, :, None].expand(kv_heads, -1, 1)), dim=-1)
    all_slots = torch.cat((chosen_slots, slots[None, :, :1].expand(kv_heads, -1, 1)), dim=-1)
    valid = all_positions >= 0  # [G, n, K + 1]
    offsets = torch.nn.functional.pad(valid.sum(-1).cumsum(-1), (1, 0))
    rows = int(offsets[:, -1].max())
    # each head's valid entries first, in order; the invalid ones after them hold NO_KEY and a real slot
    order = torch.argsort((~valid).flatten(1).to(torch.uint8), dim=-1, stable=True)[:, :rows]
    return FetchPlan(all_positions.flatten(1).gather(1, order), all_slots.flatten(1).gather(1, order), offsets,
                     selection.per_query_head)
