"""Offline API: `LLM().generate(prompts, params)` and a streaming iterator over one request."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm import tqdm

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    """An engine for offline use. Keyword arguments are `EngineConfig` fields (model, device, ...)."""

    def __init__(self, model: str | None = None, **options):
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_per_prompt(params, len(prompts))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        return self._run_to_completion(ids, use_tqdm)

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Like `generate`, for chat conversations (lists of {"role", "content"}) under the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.chat_prompt(c) for c in conversations], params, use_tqdm)

    def chat_prompt(self, messages: Messages) -> list[int]:
        if self.tokenizer is None:
            raise KvstrataError("this model has no tokenizer, so it cannot take chat messages")
        return self.tokenizer.encode_chat(messages)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gets new tokens; the last one has finished=True."""
        request_id = self.engine.add_request(prompt, params)
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort(request_id)  # a consumer that stops early frees the request's blocks

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generating") as bar:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r] for r in request_ids]

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if len(params) != count:
            raise KvstrataError(f"got {len(params)} sampling params for {count} prompts; give one or one per prompt")
        return list(params)
