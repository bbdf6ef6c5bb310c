"""Score tokens the way generation reads them: through the engine's KV cache.

A context is prefilled (in chunks of the engine's chunk size), then the following tokens are fed
teacher-forced, `tokens_per_step` at a time (1 = pure decode mode). Each scored token's logits come
from attention over keys and values read back from the cache, so a KV policy's loss shows up here.
"""

from __future__ import annotations

import torch

from kvstrata.engine.direct_forward import forward_tokens
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError
from kvstrata.kv.preloaded import PreloadedKV


class CacheScorer:
    def __init__(self, engine: LLMEngine):
        if engine.has_unfinished_requests():
            raise KvstrataError("the scorer needs an engine with no requests in flight")
        self.engine = engine

    def _forward(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        logits = forward_tokens(self.engine, seq, num_tokens)
        # as the engine's steps do: past a sliding window a window to score holds about the window, not its length
        self.engine.kv_manager.release_behind_window(seq)
        return logits

    @torch.inference_mode()
    def next_token_logits(
        self, token_ids: list[int], context_len: int, tokens_per_step: int = 1, preloaded: list[PreloadedKV] = ()
    ) -> torch.Tensor:
        """Logits [len(token_ids) - context_len, vocab]: row i predicts token_ids[context_len + i].

        `preloaded` KV (a decoded saved context) is placed in the cache instead of prefilling its range.
        """
        if not 0 < context_len < len(token_ids):
            raise KvstrataError(f"context_len must be in [1, {len(token_ids) - 1}], got {context_len}")
        if len(token_ids) > self.engine.max_model_len:
            raise KvstrataError(f"a window of {len(token_ids)} tokens exceeds max_model_len {self.engine.max_model_len}")
        seq = Sequence(seq_id=-1, request_id="eval", prompt=None, prompt_token_ids=list(token_ids),
                       params=SamplingParams())
        # The context's last token is always run: its logits predict the first scored token.
        seq.preloaded = [s for s in (p.clipped(context_len - 1) for p in preloaded) if s is not None]
        rows = []
        try:
            if not self.engine.kv_manager.place_preloaded(seq):
                raise KvstrataError("the KV cache budget is too small for this evaluation window")
            chunk = self.engine.config.chunk_size
            while seq.num_computed_tokens < context_len:
                logits = self._forward(seq, min(chunk, context_len - seq.num_computed_tokens))
            rows.append(logits[-1:])
            while seq.num_computed_tokens < len(token_ids) - 1:
                step = min(tokens_per_step, len(token_ids) - 1 - seq.num_computed_tokens)
                rows.append(self._forward(seq, step))
        finally:
            self.engine.kv_manager.free(seq)
        return torch.cat(rows)
