"""From a validated request body to checked prompt token ids and sampling parameters.

Tokenizing and rendering a chat template take time in proportion to the text, so they run in a worker
thread (the tokenizer releases the GIL while it encodes); a cheap character count on the event loop first
turns away text that cannot fit the context whatever its tokens.
"""

from __future__ import annotations

import dataclasses
import functools

from kvstrata.engine.beam_search import BeamSearch
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import MAX_SEED, SamplingParams
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.server.auto_tool_calls import AutoToolCalls
from kvstrata.server.options import ServerOptions
from kvstrata.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    opens_assistant_turn,
)
from kvstrata.server.reasoning import ReasoningParser
from kvstrata.server.tool_call_parsers import PARSERS
from kvstrata.server.tool_calls import ToolCalls

Body = CompletionRequest | ChatCompletionRequest


class RequestPreparer:
    def __init__(self, engine: LLMEngine, options: ServerOptions):
        self.engine = engine
        self.options = options
        tokenizer = engine.tokenizer
        # More characters than this cannot fit the context, however they tokenize.
        self.max_chars = None if tokenizer is None else engine.max_model_len * tokenizer.max_chars_per_token
        # the tokenizer with a request's own chat template, for the last templates asked for (each compiled once)
        self._with_template = tokenizer and functools.lru_cache(maxsize=16)(tokenizer.with_chat_template)

    def precheck(self, body: Body) -> None:
        """On the event loop: refuse tool_choice auto where no parser reads the model's calls, and what is certainly
        too long without tokenizing it (unless it is to be cut)."""
        chat = isinstance(body, ChatCompletionRequest)
        if chat and body.model_chooses_tools and not self.options.enable_auto_tool_choice:
            raise ParameterError("tool_choice", "auto (the default where tools are given) lets the model answer in "
                                                "text or call the tools in its own format; this server parses none "
                                                "(start it with --enable-auto-tool-choice --tool-call-parser and "
                                                f"the model's format: {', '.join(PARSERS)}), so give "
                                                "\"required\", a named function or \"none\"")
        if not body.use_beam_search and (body.length_penalty != 1 or body.early_stopping is not False):
            name = "length_penalty" if body.length_penalty != 1 else "early_stopping"
            raise ParameterError(name, f"{name} applies to beam search only; give use_beam_search true with it")
        if body.truncate_prompt_tokens is not None:
            return
        if chat:
            self.check_text_length("messages", "the messages text", sum(len(m.text) for m in body.messages))
            return
        for number, prompt in enumerate(body.prompts):
            what = "the prompt" if len(body.prompts) == 1 else f"prompt {number} of the batch"
            if isinstance(prompt, list):
                if len(prompt) >= self.engine.max_model_len:
                    raise ParameterError("prompt", self.engine.too_long_for_the_context(len(prompt), what=what))
            else:
                self.check_text_length("prompt", f"{what} text", len(prompt))

    def tool_calls(self, body: Body) -> ToolCalls | AutoToolCalls | None:
        """How a chat's outputs become tool calls: held to the calls tool_choice asks for, or parsed from the text
        where the model chooses (tool_choice auto, which precheck lets through only with a parser)."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        parser = PARSERS.get(self.options.tool_call_parser)
        if body.model_chooses_tools:
            return parser(frozenset(tool.function.name for tool in body.tools), body.parallel_tool_calls)
        forced = body.tool_calling
        if forced is not None and parser is not None:  # the ids the model's template takes back
            forced = dataclasses.replace(forced, new_call_id=parser.new_call_id)
        return forced

    def reasoning(self, body: Body) -> ReasoningParser | None:
        """How a chat's thinking is told from its answer, where the server has a reasoning parser and nothing
        constrains the output (a constraint holds it from its first token, so it holds no thinking)."""
        if self.options.reasoning_parser is None or not isinstance(body, ChatCompletionRequest):
            return None
        return None if body.constraint_field is not None else ReasoningParser(self.options.reasoning_parser)

    @functools.cached_property
    def _call_tags_are_special(self) -> bool:
        """Whether the model's tokenizer makes a tag of the parser's format a special token (Hermes 2 Pro's makes
        <tool_call> one, Qwen's do not), which the output text leaves out unless asked."""
        tags = PARSERS[self.options.tool_call_parser].special_tags
        return any(tag in self.engine.tokenizer.special_token_texts for tag in tags)

    def check_text_length(self, param: str, what: str, chars: int) -> None:
        """Refuse a text certainly too long for the context, before tokenizing it."""
        if self.max_chars is not None and chars > self.max_chars:
            raise ParameterError(param, f"{what} has {chars} characters, more than {self.max_chars} "
                                        f"({self.engine.max_model_len} tokens of at most "
                                        f"{self.engine.tokenizer.max_chars_per_token} characters) can fit the context")

    def prepare(self, body: Body, lora_name: str | None = None) -> list[tuple[list[int], SamplingParams]]:
        """In a worker thread: the token ids and sampling parameters of each of the request's choices (`n` per
        prompt; choice p * n + i is prompt p's sample i), on LoRA adapter `lora_name` (None: the base model)."""
        prompts = [None] if isinstance(body, ChatCompletionRequest) else body.prompts
        limit = self.options.max_waiting
        if len(prompts) * body.n > limit:  # its choices could never be admitted together
            if len(prompts) == 1:
                raise ParameterError("n", f"n {body.n} exceeds this server's --max-waiting of {limit}")
            raise ParameterError("prompt", f"{len(prompts)} prompts x n {body.n} = {len(prompts) * body.n} choices "
                                           f"exceed this server's --max-waiting of {limit}")
        requests = []
        for number, prompt in enumerate(prompts):
            where = "" if len(prompts) == 1 else f"prompt {number} of the batch: "
            token_ids = self._token_ids(body, prompt, where)
            params = dataclasses.replace(self._sampling_params(body, len(token_ids), where), lora_name=lora_name)
            requests += [(token_ids, choice) for choice in choices(params, body.n)]
        return requests

    def beam_searches(self, body: Body, requests: list[tuple[list[int], SamplingParams]]) -> list[BeamSearch]:
        """use_beam_search: a search per prompt, `n` beams wide, from `prepare`'s choices (`n` per prompt)."""
        eos = self.engine.outputs.eos_token_ids
        try:
            return [BeamSearch(token_ids, body.beam_search_params(params), eos)
                    for token_ids, params in requests[:: body.n]]
        except ParameterError as exc:  # the width is this API's n
            raise ParameterError("n" if exc.param == "beam_width" else exc.param, str(exc)) from None

    def _token_ids(self, body: Body, prompt: str | list[int] | None, where: str) -> list[int]:
        chat = isinstance(body, ChatCompletionRequest)
        try:
            if chat:
                token_ids = self._chat_tokens(body)
            else:
                token_ids = self.engine.tokenize(prompt)
            if body.truncate_prompt_tokens is not None:
                token_ids = token_ids[-body.truncate_prompt_tokens :]
            self.engine.check_prompt_length(token_ids)
        except ParameterError:
            raise
        except KvstrataError as exc:
            raise ParameterError("messages" if chat else "prompt", where + str(exc)) from exc
        return token_ids

    def _sampling_params(self, body: Body, prompt_tokens: int, where: str) -> SamplingParams:
        chat = isinstance(body, ChatCompletionRequest)
        asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        field = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
        limit = self.options.max_tokens_limit
        room = self.engine.max_model_len - prompt_tokens
        if not chat and "max_tokens" not in body.model_fields_set:
            asked = min(asked, limit or asked, room)  # the API's default of 16 bows to the limit and the context
        if asked == 0:  # OpenAI's legacy idiom for scoring a prompt: the engine generates one token, not shown
            if not body.echo:
                raise ParameterError("max_tokens", f"{where}max_tokens 0 generates nothing; it is taken only with "
                                                   "echo, which returns the prompt (and its logprobs)")
            asked = 1
        if asked is not None and limit is not None and asked > limit:
            raise ParameterError(field, f"{field} {asked} exceeds this server's --max-tokens-limit of {limit}")
        if asked is not None and asked > room:
            raise ParameterError(field, f"{where}{field} {asked} does not fit the context: the prompt has "
                                        f"{prompt_tokens} tokens of max_model_len {self.engine.max_model_len}, so at "
                                        f"most {room} can follow it")
        max_tokens = asked or min(room, limit or room)
        if body.min_tokens > max_tokens:
            raise ParameterError("min_tokens", f"{where}min_tokens {body.min_tokens} exceeds the request's "
                                               f"max_tokens of {max_tokens}")
        logprobs = body.requested_logprobs if chat else body.logprobs
        params = body.sampling_params(max_tokens, logprobs, self.engine.sampling_defaults)
        if chat and body.model_chooses_tools and self._call_tags_are_special:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the parser reads the calls' tags
        try:
            self.engine.check_sampling(params)
        except ParameterError as exc:
            if exc.param != "structured_output":
                raise
            raise ParameterError(body.constraint_field, f"{body.constraint_field}: {exc}") from None
        return params

    def _chat_tokens(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise KvstrataError("this model has no tokenizer, so it cannot take chat messages")
        if body.chat_template is not None:
            if not self.options.trust_request_chat_template:
                raise ParameterError("chat_template", "this server renders chats with its own template; it takes "
                                                      "a request's only where it was started with "
                                                      "--trust-request-chat-template")
            try:
                tokenizer = self._with_template(body.chat_template)
            except KvstrataError as exc:
                raise ParameterError("chat_template", str(exc)) from exc
        return tokenizer.encode_chat([m.plain() for m in body.messages], opens_assistant_turn(body),
                                     special_tokens_in_content=self.options.special_tokens_in_chat,
                                     continue_final_message=body.continue_final_message, tools=body.plain_tools,
                                     template_kwargs=body.chat_template_kwargs)

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        """In a worker thread: /tokenize's token ids, those the completions or chat endpoint would make."""
        if (body.prompt is None) == (body.messages is None):
            raise ParameterError("prompt", "give exactly one of prompt and messages")
        field = "prompt" if body.messages is None else "messages"
        try:
            if body.messages is not None:
                return self._chat_tokens(body)
            if self.engine.tokenizer is None:
                raise KvstrataError("this model has no tokenizer")
            return self.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ParameterError:
            raise
        except KvstrataError as exc:
            raise ParameterError(field, str(exc)) from exc

    def detokenize(self, body: DetokenizeRequest) -> str:
        """In a worker thread: /detokenize's text."""
        vocab = self.engine.model_config.vocab_size
        outside = next((i for i, token in enumerate(body.tokens) if token >= vocab), None)
        if outside is not None:
            raise ParameterError(f"tokens.{outside}", f"token {body.tokens[outside]} is outside the vocabulary of "
                                                      f"{vocab} tokens")
        if self.engine.tokenizer is None:
            raise ParameterError("tokens", "this model has no tokenizer")
        return self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of `n` samples of one prompt. With a seed, sample i draws from seed + i (as vLLM does), so
    the choices differ and a request with the same seed gets the same choices again."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1)) for index in range(n)]
