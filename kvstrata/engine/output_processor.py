"""After a token is sampled: detokenize it, apply stop conditions, and build the request's output."""

from __future__ import annotations

from kvstrata.engine.detokenizer import IncrementalDetokenizer
from kvstrata.engine.outputs import RequestMetrics, RequestOutput
from kvstrata.engine.sequence import Sequence, TokenLogprobs
from kvstrata.model.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._released_text: dict[int, int] = {}  # characters of output text already streamed
        self._released_tokens: dict[int, int] = {}

    def append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None, now: float) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        seq.token_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:  # nothing ends it yet (the sampler bans the ending tokens)
            self._append_text(seq, token_id, find_stops=False)
        elif (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif token_id in self.eos_token_ids and seq.constraint_complete:
            seq.finish_reason = "stop"  # the EOS its structured output allowed once complete: ends it even ignored
        elif self._append_text(seq, token_id):
            return  # a stop string ended the text
        if seq.finish_reason is None and seq.constraint_complete:
            seq.finish_reason = "stop"  # its structured output is whole: nothing may follow it
        elif seq.finish_reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
        detok = self._detokenizers.get(seq.seq_id)
        if seq.finish_reason is not None and detok is not None:
            seq.output_text += detok.flush()  # bytes of a character that will never be completed

    def _append_text(self, seq: Sequence, token_id: int, find_stops: bool = True) -> bool:
        """Extend the output text; True when it now holds a stop string (cut off there), if `find_stops`."""
        if self.tokenizer is None:
            return False
        detok = self._detokenizers.get(seq.seq_id)
        if detok is None:
            detok = self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                                            seq.params.skip_special_tokens)
        new_text = detok.add(token_id)
        if not new_text:
            return False
        searched_from = max(0, len(seq.output_text) - max((len(s) for s in seq.params.stop), default=0))
        seq.output_text += new_text
        for stop in seq.params.stop if find_stops else ():
            at = seq.output_text.find(stop, searched_from)
            if at != -1:  # the stop string itself is returned only if asked for
                seq.output_text = seq.output_text[: at + len(stop) if seq.params.include_stop_str_in_output else at]
                seq.finish_reason = "stop"
                return True
        return False

    def build_output(self, seq: Sequence) -> RequestOutput:
        """The request's state now; `new_text` holds what was not released before.

        While a stop string could still be completing, its possible start is held back.
        """
        finished = seq.finish_reason is not None
        hold = 0 if finished else max((len(s) - 1 for s in seq.params.stop), default=0)
        releasable = max(len(seq.output_text) - hold, self._released_text.get(seq.seq_id, 0))
        new_text = seq.output_text[self._released_text.get(seq.seq_id, 0) : releasable]
        num_output = seq.num_output_tokens
        new_tokens = seq.token_ids[seq.num_prompt_tokens + self._released_tokens.get(seq.seq_id, 0) :]
        self._released_text[seq.seq_id] = releasable
        self._released_tokens[seq.seq_id] = num_output
        if finished:
            self.forget(seq)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_reused_prompt_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_token_time=seq.first_token_time,
                finish_time=seq.finish_time,
                num_output_tokens=num_output,
                num_preemptions=seq.num_preemptions,
            ),
            new_text=new_text,
            new_token_ids=new_tokens,
            all_token_ids=seq.token_ids,
            all_logprobs=seq.output_logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            error=seq.error,
            error_caused_by_input=seq.error_caused_by_input,
            embedding=seq.embedding,
        )

    def forget(self, seq: Sequence) -> None:
        for table in (self._detokenizers, self._released_text, self._released_tokens):
            table.pop(seq.seq_id, None)
