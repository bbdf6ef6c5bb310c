"""Time hand-built batches on the engine's runner: any mix of prefill chunks and decodes.

Sequences are brought to a state (so many tokens in the cache) once; a timed step runs and is
then undone by resetting the counters (its cache writes land in the same slots with the same
values when repeated), so one composition can be timed many times.
"""

from __future__ import annotations

import torch

from kvstrata.bench.stats import median_seconds
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError


class StepTimer:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.sequences: list[Sequence] = []

    def sequence(self, token_ids: list[int], cached: int) -> Sequence:
        """A sequence of `token_ids` whose first `cached` tokens are already in the KV cache."""
        seq = Sequence(seq_id=-(len(self.sequences) + 1), request_id=f"timer-{len(self.sequences)}", prompt=None,
                       prompt_token_ids=list(token_ids), params=SamplingParams())
        if not self.engine.kv_manager.grow(seq, len(token_ids)):
            raise KvstrataError("the KV cache budget is too small for this timing experiment")
        self.sequences.append(seq)
        if cached:
            self._run([(seq, cached)])
        seq.num_computed_tokens = cached
        return seq

    @torch.inference_mode()
    def _run(self, work: list[tuple[Sequence, int]]) -> None:
        inputs, hidden = self.engine.runner.forward(work)
        self.engine.runner.model.compute_logits(hidden[inputs.last_rows])
        if hidden.is_cuda:  # a step is done when its logits are (an engine step reads them to sample)
            torch.cuda.synchronize()

    def time(self, work: list[tuple[Sequence, int]], repeats: int = 5) -> float:
        """Median seconds of one step running `work` (sequence, new tokens) from the sequences' states."""
        return median_seconds(lambda: self._run(work), repeats)

    def release(self) -> None:
        for seq in self.sequences:
            self.engine.kv_manager.free(seq)
        self.sequences = []
