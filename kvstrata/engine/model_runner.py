"""Runs one scheduled step: packs the tokens of many sequences into one flat batch and calls the model.

The step's metadata (positions, slots, the groups' block tables and key positions) is built once, with
array operations, on the compute device; every layer reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.engine.block_tables import BlockTables
from kvstrata.engine.draft_verification import verifies
from kvstrata.engine.sampler import token_logprobs
from kvstrata.engine.sequence import Sequence
from kvstrata.kv.attention_batch import AttentionBatch, AttentionGroup, whole_block_keys
from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.slots import token_slots

Work = list[tuple[Sequence, int]]  # (sequence, new tokens) of one step
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are computed at once (a [rows, vocab] float32 each)


@dataclass
class PromptRows:
    """A step's final hidden states of one sequence's prompt tokens, from position `start` on."""

    seq: Sequence
    start: int
    hidden: torch.Tensor  # [tokens, hidden]


@dataclass
class StepResult:
    to_sample: list[Sequence]  # the sequences that reached the end of their known tokens (a row each, or more)
    logits: torch.Tensor  # [rows, vocab] fp32, their next-token logits
    prompt_rows: list[PromptRows]  # of the sequences asking for their prompt's logprobs
    pooled: list[tuple[Sequence, torch.Tensor]]  # pooling sequences whose prompt ended: its last final hidden state


@dataclass
class StepInputs:
    ordered: Work  # decodes first
    input_ids: torch.Tensor  # [T]
    batch: AttentionBatch
    last_rows: list[int]  # packed row of each sequence's last new token


class ModelRunner:
    def __init__(self, model: torch.nn.Module, policy: AttentionPolicy, block_size: int, device: torch.device,
                 max_blocks_per_seq: int, max_num_seqs: int):
        self.model = model
        self.policy = policy
        self.block_size = block_size
        self.device = device
        self.block_tables = BlockTables(max_blocks_per_seq, max_num_seqs)

    def prepare(self, work: Work) -> StepInputs:
        """Order the work (decodes first) and build the token ids and attention metadata. A sequence verifying
        drafts is one decode per token, each reading the cached keys up to its own position."""
        decodes = [_decodes(*w) for w in work]
        ordered = [w for w, d in zip(work, decodes) if d] + [w for w, d in zip(work, decodes) if not d]
        if getattr(self.model, "lora", None) is not None:  # decodes on one adapter side by side: one span of rows
            ordered[: sum(decodes)] = sorted(ordered[: sum(decodes)], key=lambda w: _adapter_name(w[0]))
        num_decode_seqs = sum(decodes)
        seq_rows = self.block_tables.rows_for([seq for seq, _ in ordered])
        rows, starts, counts, token_ids = [], [], [], []
        for i, (seq, n) in enumerate(ordered):
            start = seq.num_computed_tokens
            if i < num_decode_seqs:
                rows += [seq_rows[i]] * n
                starts += range(start, start + n)
                counts += [1] * n
                token_ids += [seq.token_ids[start], *seq.draft_token_ids[: n - 1]]
            else:
                rows.append(seq_rows[i])
                starts.append(start)
                counts.append(n)
                token_ids += seq.token_ids[start : start + n]
        rows, starts, counts = (np.array(a, dtype=np.int64) for a in (rows, starts, counts))
        ends = counts.cumsum()
        firsts = ends - counts
        # position of packed token t = its entry's start + its index within the entry's new tokens
        positions = np.repeat(starts - firsts, counts) + np.arange(ends[-1])
        to_device = lambda a: torch.from_numpy(a).to(self.device)
        positions_t, rows_t = to_device(positions), to_device(rows)
        tables = self.block_tables.tensor(self.device)
        # from the host arrays: numpy's calls cost less than torch's, which a small decode step is made of
        slot_mapping = to_device(token_slots(self.block_tables.table, np.repeat(rows, counts), positions,
                                             self.block_size))
        context_lens = to_device(starts + counts)
        num_decodes = len(counts) - (len(ordered) - num_decode_seqs)  # one-token entries
        groups = []
        if num_decodes:
            widest = -(-int((starts[:num_decodes] + 1).max()) // self.block_size)
            group_tables = tables[rows_t[:num_decodes], :widest]
            groups.append(AttentionGroup(slice(0, num_decodes), positions_t[:num_decodes, None],
                                         context_lens[:num_decodes],
                                         whole_block_keys(group_tables, context_lens[:num_decodes], self.block_size)))
        for i in range(num_decodes, len(counts)):
            blocks = -(-int(starts[i] + counts[i]) // self.block_size)
            rows_i = slice(int(firsts[i]), int(ends[i]))
            groups.append(AttentionGroup(rows_i, positions_t[None, rows_i], context_lens[i : i + 1],
                                         whole_block_keys(tables[rows[i] : rows[i] + 1, :blocks],
                                                          context_lens[i : i + 1], self.block_size),
                                         chunk_start=int(starts[i])))
        batch = AttentionBatch(positions_t, slot_mapping, groups, self.block_size)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        last_rows = (np.cumsum([n for _, n in ordered]) - 1).tolist()
        return StepInputs(ordered, input_ids, batch, last_rows)

    @torch.inference_mode()
    def forward(self, work: Work) -> tuple[StepInputs, torch.Tensor]:
        """The step's final hidden states [T, hidden], with the inputs they came from."""
        inputs = self.prepare(work)
        lora = getattr(self.model, "lora", None)
        if lora is not None:
            lora.begin_step([(seq.lora, num_tokens) for seq, num_tokens in inputs.ordered])
        self.policy.begin_step(inputs.batch)
        try:
            hidden = self.model(inputs.input_ids, inputs.batch.positions, self.policy, inputs.batch)
        finally:
            self.policy.end_step()
            if lora is not None:
                lora.end_step()
        return inputs, hidden

    @torch.inference_mode()
    def execute(self, work: Work) -> StepResult:
        """Run the step; return the sequences that reached the end of their known tokens and
        their next-token logits [n, vocab] in fp32 (the others were mid-prompt), the prompt rows of the
        sequences that ask for their prompt's logprobs (`record_prompt_logprobs` turns them into logprobs), and the
        last hidden state of those that pool (embed their prompt, which the step ended). A sequence verifying
        drafts has a row for its last token and one for each draft, in order, its entry in the sequences repeated
        for each."""
        inputs, hidden = self.forward(work)
        to_sample, rows, prompt_rows, pooled = [], [], [], []
        for (seq, num_tokens), last_row in zip(inputs.ordered, inputs.last_rows):
            if seq.num_computed_tokens + num_tokens == seq.num_tokens:
                if seq.params.pooling is not None:
                    pooled.append((seq, hidden[last_row]))
                else:
                    to_sample.append(seq)
                    rows.append(last_row)
            elif verifies(seq, num_tokens):
                to_sample += [seq] * num_tokens
                rows += range(last_row - num_tokens + 1, last_row + 1)
            if seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_rows.append(PromptRows(seq, seq.num_computed_tokens,
                                              hidden[last_row - num_tokens + 1 : last_row + 1]))
        logits = self.model.compute_logits(hidden[rows]).float()
        return StepResult(to_sample, logits, prompt_rows, pooled)

    @torch.inference_mode()
    def record_prompt_logprobs(self, rows: PromptRows) -> None:
        """Extend the sequence's `prompt_logprobs` over the prompt tokens its rows predict. A prompt computed
        again after a preemption keeps what it had."""
        seq, start = rows.seq, rows.start
        if start == 0 and not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # nothing predicts the first token
        end = min(start + len(rows.hidden), seq.num_prompt_tokens - 1)  # the row of position q - 1 predicts token q
        for first in range(max(len(seq.prompt_logprobs) - 1, start), end, PROMPT_LOGPROB_ROWS):
            last = min(first + PROMPT_LOGPROB_ROWS, end)  # a bounded [rows, vocab] at a time
            log_dist = self.model.compute_logits(rows.hidden[first - start : last - start]).float().log_softmax(-1)
            seq.prompt_logprobs += token_logprobs(log_dist, seq.token_ids[first + 1 : last + 1],
                                                  seq.params.prompt_logprobs)


def _adapter_name(seq: Sequence) -> str:
    return "" if seq.lora is None else seq.lora.name


def _decodes(seq: Sequence, num_tokens: int) -> bool:
    """Whether `seq`'s step is decoding: one token, or one and its drafts."""
    return num_tokens == 1 or verifies(seq, num_tokens)
