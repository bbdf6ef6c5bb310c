"""What InfiniGen fetches for one layer's decodes, laid out per KV head (`FetchPlan`).

Each KV head's rows hold its chosen tokens of every sequence one after another, each sequence's ascending and
followed by the step's own token (its K/V is written into that row at attention). The heads' rows are padded to
the longest head's only, not every (head, sequence) to the longest one's: the union of a KV head's query heads'
choices varies a lot between sequences and heads, and padding each to the widest would gather, copy and attend
over rows nobody chose. Attention reads each
sequence's run of rows by its offsets (kv/kernels/fetched_attention.cpp; on the torch path, `attend_over_plan`).
A plan is made on the host, which gathers its rows; only its offsets go to a GPU, for the attention there.
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

    @property
    def widest_run(self) -> int:
        return int(self.offsets.diff(dim=-1).max())

    def chosen_rows(self) -> torch.Tensor:
        """bool [kv_heads, R]: rows of tokens that were chosen (not padding, not the step's own token)."""
        chosen = self.positions >= 0
        chosen[torch.arange(chosen.shape[0], device=chosen.device)[:, None], own_rows_of(self.offsets)] = False
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


def runs_of(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """long [kv_heads, n] each: the first row of each sequence's run and how many rows it has (a plan's offsets, on
    any device)."""
    return offsets[:, :-1], offsets.diff(dim=-1)


def own_rows_of(offsets: torch.Tensor) -> torch.Tensor:
    """long [kv_heads, n]: the row of each sequence's own token, the last of its rows."""
    return offsets[:, 1:] - 1


def attend_over_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     widest_run: int) -> torch.Tensor:
    """The torch path of attention over fetched rows: q [n, heads, D] over k, v [kv_heads, R, D] laid out by a plan's
    `offsets` (on q's device; `widest_run` its longest run, known on the host). Each sequence's run of rows is taken
    out as its own padded row of keys, so that no sequence's values (a NaN from a corrupt cache among them) enter
    another's output, even with weight 0."""
    starts, lengths = runs_of(offsets)
    steps = torch.arange(widest_run, device=k.device)
    valid = steps < lengths[..., None]  # [kv_heads, n, W]
    index = (starts[..., None] + torch.minimum(steps, lengths[..., None] - 1)).flatten(1)
    kv_heads, n, width = valid.shape
    runs = [x.gather(1, index[..., None].expand(-1, -1, x.shape[-1])).view(kv_heads, n, width, -1) for x in (k, v)]
    return attend_per_kv_head(q[:, None], *runs, valid[:, :, None]).flatten(0, 1)


def plan_from_selection(selection: Selection, slots: torch.Tensor, positions: torch.Tensor,
                        q_positions: torch.Tensor) -> FetchPlan:
    """The torch path's plan, made on the host: `selection` over keys with slots and positions [n, Tk], the step's
    tokens at q_positions [n] (all on the host)."""
    kv_heads, n, _ = selection.chosen.shape
    # each sequence's own token after its chosen ones: its K/V is written at attention, so any real slot serves
    valid = torch.cat((selection.chosen, torch.ones(kv_heads, n, 1, dtype=torch.bool, device=selection.chosen.device)),
                      dim=-1)
    all_positions = torch.cat((positions, q_positions[:, None]), dim=-1).flatten()
    all_slots = torch.cat((slots, slots[:, :1]), dim=-1).flatten()
    offsets = torch.nn.functional.pad(valid.sum(-1).cumsum(-1), (1, 0))
    per_head_rows = offsets[:, -1]
    # each head's entries in order (sequence, then column); a head's row r is its r-th entry, padding after them
    head, column = valid.flatten(1).nonzero(as_tuple=True)
    row = torch.arange(len(head)) - (per_head_rows.cumsum(0) - per_head_rows)[head]
    plan_positions = torch.full((kv_heads, int(per_head_rows.max())), NO_KEY, dtype=torch.long)
    plan_slots = torch.full_like(plan_positions, int(all_slots[0]))  # padding rows read some real slot
    plan_positions[head, row] = all_positions[column]
    plan_slots[head, row] = all_slots[column]
    return FetchPlan(plan_positions, plan_slots, offsets, selection.per_query_head)
