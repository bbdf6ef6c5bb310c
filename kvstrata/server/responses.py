"""OpenAI response bodies and server-sent-event chunks built from engine outputs."""

from __future__ import annotations

import json
import time
import uuid

from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.sequence import TokenLogprobs
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.server.auto_tool_calls import AutoToolCalls
from kvstrata.server.reasoning import ReasoningParser, Split
from kvstrata.server.tool_calls import ToolCalls


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def usage(outputs: list[RequestOutput], samples_per_prompt: int, completions_shown: bool = True) -> dict:
    """Each prompt counted once (its `n` choices share it; its first choice's reused KV, OpenAI's cached tokens),
    every choice's completion (none when only the prompts are shown: echo with max_tokens 0)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::samples_per_prompt])
    cached = sum(o.num_cached_tokens for o in outputs[::samples_per_prompt])
    completion = sum(len(o.token_ids) for o in outputs) if completions_shown else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ResponseBuilder:
    """Shapes one request's outputs for one endpoint: a choice per prompt and sample (`samples_per_prompt`, the
    request's `n`). With `echo_texts` (completions' echo), each choice's text and logprobs begin with its prompt's:
    one text per prompt, as the request gave it, or None where its token ids are to be decoded (a prompt of token
    ids, or one cut to its last tokens). With `prompt_only` (echo with max_tokens 0, which scores a prompt), the
    choice is its prompt alone: the one token the engine generated is not shown. With `tool_calls`, a chat's outputs
    are handed back as tool calls (or, where the model chose, as text); with `reasoning`, a chat's thinking apart
    from its answer; with `prompt_logprobs`, vLLM's field of that name is filled."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer, samples_per_prompt: int,
                 echo_texts: list[str | None] | None = None, prompt_only: bool = False,
                 tool_calls: ToolCalls | AutoToolCalls | None = None, prompt_logprobs: bool = False,
                 reasoning: ReasoningParser | None = None, include_reasoning: bool = True):
        self.chat = chat
        self.reasoning = reasoning  # a chat's thinking told from its answer (reasoning.py)
        self.include_reasoning = include_reasoning  # and handed back as reasoning_content, or dropped
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: each prompt token's logprob, rank and alternatives
        self.tool_calls = tool_calls  # chat outputs handed back as tool calls (tool_calls.py)
        self.samples_per_prompt = samples_per_prompt
        self.model = model
        self.tokenizer = tokenizer
        self.echo_texts = echo_texts
        self.echo = echo_texts is not None
        self.prompt_only = prompt_only
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._sent_logprobs: dict[int, int] = {}  # choice index -> logprobs already streamed
        self._echoed: set[int] = set()  # choices whose prompt was streamed
        self._calls_opened: set[int] = set()  # choices whose tool call's id and name were streamed
        self._released_chars: dict[int, int] = {}  # choice index -> characters of its text streamed (parsed chat's)
        self._splits: dict[int, Split] = {}  # choice index -> that text's thinking and answer so far

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_text(self, index: int, output: RequestOutput) -> str:
        text = self.echo_texts[index // self.samples_per_prompt]
        return text if text is not None else self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)

    def _prompt_logprobs(self, output: RequestOutput) -> dict | None:
        """The prompt's part of an echoed choice's logprobs: its first token has none (nothing predicts it)."""
        if output.prompt_logprobs is None:
            return None
        first = output.prompt_token_ids[0]
        rest = self._logprobs([e for e in output.prompt_logprobs if e is not None])
        return {"tokens": [self._token_text(first), *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]]}

    def _vllm_prompt_logprobs(self, output: RequestOutput) -> list[dict | None]:
        """vLLM's form: per prompt token, None for the first, then {token id: {logprob, rank, decoded_token}} of
        the token itself and its alternatives (ranked 1, 2, ... in their order)."""
        result: list[dict | None] = [None]
        for entry in output.prompt_logprobs[1:]:
            ranked = {token: (logprob, rank) for rank, (token, logprob) in enumerate(entry.top.items(), start=1)}
            ranked[entry.token_id] = (entry.logprob, entry.rank)
            result.append({str(token): {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token)}
                           for token, (logprob, rank) in ranked.items()})
        return result

    def _logprobs(self, entries: list[TokenLogprobs], before: dict | None = None) -> dict:
        """Entries in the endpoint's form; a completion's after `before` (an echoed prompt's, in that form)."""
        if self.chat:
            return {"content": [
                {
                    "token": self._token_text(e.token_id),
                    "logprob": e.logprob,
                    "bytes": list(self._token_text(e.token_id).encode()),
                    "top_logprobs": [
                        {"token": self._token_text(t), "logprob": lp, "bytes": list(self._token_text(t).encode())}
                        for t, lp in e.top.items()
                    ],
                }
                for e in entries
            ]}
        before = before or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        return {
            "tokens": before["tokens"] + [self._token_text(e.token_id) for e in entries],
            "token_logprobs": before["token_logprobs"] + [e.logprob for e in entries],
            "top_logprobs": before["top_logprobs"] + [self._top_with_token(e) for e in entries],
        }

    def _top_with_token(self, entry: TokenLogprobs) -> dict[str, float]:
        """A completion token's alternatives and, as OpenAI's legacy format always has it, the token itself (so up
        to logprobs + 1 entries)."""
        top = {self._token_text(t): lp for t, lp in entry.top.items()}
        top.setdefault(self._token_text(entry.token_id), entry.logprob)
        return top

    def _new_logprobs(self, index: int, output: RequestOutput, echoing: bool) -> dict | None:
        if output.logprobs is None:
            return None
        entries = [] if self.prompt_only else output.logprobs[self._sent_logprobs.get(index, 0) :]
        self._sent_logprobs[index] = len(output.logprobs)
        return self._logprobs(entries, self._prompt_logprobs(output) if echoing else None)

    def _echoed_text(self, index: int, output: RequestOutput, text: str, echoing: bool) -> str:
        """A completion's `text` (all of it, or what is new) after its prompt's where it is echoed now."""
        return (self._prompt_text(index, output) if echoing else "") + ("" if self.prompt_only else text)

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, outputs: list[RequestOutput]) -> dict:
        """The whole non-streaming response: one choice per output, in their order."""
        choices = []
        for index, output in enumerate(outputs):
            finish_reason = output.finish_reason
            if self.chat:
                message, finish_reason = self._chat_message(output)
                choice = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": self._echoed_text(index, output, output.text, self.echo)}
            before = self._prompt_logprobs(output) if self.echo else None
            entries = [] if self.prompt_only else output.logprobs
            choice["logprobs"] = None if output.logprobs is None else self._logprobs(entries, before)
            choice["finish_reason"] = finish_reason
            if self.prompt_logprobs and not self.chat:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(output)
            choices.append(choice)
        response = {**self._envelope(choices, chunk=False), "usage": self._usage(outputs)}
        if self.prompt_logprobs and self.chat:  # vLLM's chat: once, for the prompt the choices share
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(outputs[0])
        return response

    def first_chunks(self, num_choices: int) -> list[dict]:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return []
        # OpenAI's: no content where tool calls follow (the model may still answer in text where it chooses)
        content = "" if self.tool_calls is None or isinstance(self.tool_calls, AutoToolCalls) else None
        return [self._envelope([{"index": index, "delta": {"role": "assistant", "content": content},
                                 "logprobs": None, "finish_reason": None}], chunk=True) for index in range(num_choices)]

    def chunk(self, index: int, output: RequestOutput) -> dict | None:
        """The streaming chunk for this output of choice `index`; None when it adds nothing."""
        echoing = self.echo and index not in self._echoed  # the choice's first chunk carries its prompt
        self._echoed.add(index)
        logprobs = self._new_logprobs(index, output, echoing)
        if not output.new_text and logprobs is None and not output.finished and not echoing:
            return None
        finish_reason = output.finish_reason if output.finished else None
        if self.chat:
            delta, finish_reason = self._chat_delta(index, output, finish_reason)
            if not delta and finish_reason is None and logprobs is None:
                return None  # calls that come whole at the end, or text that may begin a tag
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": self._echoed_text(index, output, output.new_text, echoing)}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return self._envelope([choice], chunk=True)

    def _chat_message(self, output: RequestOutput) -> tuple[dict, str | None]:
        """A finished chat output's message and finish reason: its thinking apart, its answer as text or calls."""
        reasoning, text = None, output.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.message_fields(output.text)
        if self.tool_calls is not None:
            message, finish_reason = self.tool_calls.message(text, output.finish_reason)
        else:
            message, finish_reason = {"role": "assistant", "content": text}, output.finish_reason
        if reasoning is not None and self.include_reasoning:
            message["reasoning_content"] = reasoning
        return message, finish_reason

    def _chat_delta(self, index: int, output: RequestOutput, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish reason, from the text released so far: the new part of its thinking,
        and of its answer as text or calls."""
        new_text = output.new_text
        if self.reasoning is None and self.tool_calls is None:
            return ({"content": new_text} if new_text else {}), finish_reason
        # The text released so far: the output's text begins with it (text a stop string holds back comes after).
        released_chars = self._released_chars[index] = self._released_chars.get(index, 0) + len(new_text)
        released = output.text[:released_chars]
        new_reasoning = ""
        if self.reasoning is not None:
            before = self._splits.get(index, Split("", ""))
            split = self._splits[index] = self.reasoning.split(released, finished=finish_reason is not None)
            new_reasoning = split.reasoning[len(before.reasoning) :]
            new_text, released = split.content[len(before.content) :], split.content
        if self.tool_calls is not None:
            delta, finish_reason = self.tool_calls.chunk(new_text, index not in self._calls_opened, released,
                                                         finish_reason)
            if delta.get("tool_calls"):
                self._calls_opened.add(index)
        else:
            delta = {"content": new_text} if new_text else {}
        if new_reasoning and self.include_reasoning:
            delta = {"reasoning_content": new_reasoning, **delta}
        return delta, finish_reason

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self._usage(outputs)}

    def _usage(self, outputs: list[RequestOutput]) -> dict:
        return usage(outputs, self.samples_per_prompt, completions_shown=not self.prompt_only)
