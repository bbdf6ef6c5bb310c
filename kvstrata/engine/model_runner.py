"""Runs one scheduled step: packs the tokens of many sequences into one flat batch and calls the model."""

from __future__ import annotations

import torch

from kvstrata.engine.sequence import Sequence
from kvstrata.kv.attention_batch import AttentionBatch, ScheduledTokens, build_attention_batch
from kvstrata.kv.policy import KVPolicy


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVPolicy, block_size: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device

    def pack(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], torch.Tensor, AttentionBatch]:
        """Order the work (decodes first), and build the token ids and attention metadata."""
        ordered = [w for w in scheduled if w[1] == 1] + [w for w in scheduled if w[1] != 1]
        token_ids: list[int] = []
        entries = []
        for seq, num_tokens in ordered:
            start = seq.num_computed_tokens
            token_ids.extend(seq.token_ids[start : start + num_tokens])
            entries.append(ScheduledTokens(seq.seq_id, start, num_tokens, seq.block_table))
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return ordered, input_ids, build_attention_batch(entries, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Run the step; return the sequences that reached the end of their known tokens and
        their next-token logits [n, vocab] in fp32 (the others were mid-prompt)."""
        ordered, input_ids, batch = self.pack(scheduled)
        hidden = self.model(input_ids, batch.positions, self.kv, batch)
        to_sample, rows = [], []
        for (seq, num_tokens), piece in zip(ordered, batch.sequences):
            if seq.num_computed_tokens + num_tokens == seq.num_tokens:
                to_sample.append(seq)
                rows.append(piece.rows.stop - 1)
        logits = self.model.compute_logits(hidden[rows]).float()
        return to_sample, logits
