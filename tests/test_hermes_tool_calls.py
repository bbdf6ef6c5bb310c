"""tool_choice "auto" with --tool-call-parser hermes: the model's <tool_call> blocks become OpenAI's tool_calls, the
text beside them its content; an output whose calls do not parse stays text; streamed text never shows a tag."""

import json

import httpx
import openai
import pytest

from kvstrata.engine.outputs import RequestMetrics, RequestOutput
from kvstrata.errors import KvstrataError
from kvstrata.server.auto_tool_calls import AutoToolCalls
from kvstrata.server.hermes_tool_calls import HermesToolCalls
from kvstrata.server.options import ServerOptions
from kvstrata.server.responses import ResponseBuilder
from tests.server_harness import running_server
from tests.test_tool_calls import TOOLS

PARSER = HermesToolCalls(frozenset({"get_weather", "get_time"}))
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath", "unit": "celsius"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_without_parallel_calls_the_first_call_alone_is_kept():
    message, finish = HermesToolCalls(PARSER.functions, parallel=False).message(f"{TIME_CALL}\n{WEATHER_CALL}", "stop")
    assert finish == "tool_calls" and calls_of(message) == [("get_time", {})]


@pytest.mark.parametrize("pieces", [["Hello\n", TIME_CALL], ["\n\n", TIME_CALL], ["Hi ", "there\n\n", TIME_CALL, "\n"],
                                    [" Hi", " there", "!"]])
def test_streamed_content_is_the_whole_message_s(pieces):
    builder = ResponseBuilder(True, "m", None, 1, tool_calls=PARSER)
    text, streamed_content = "", ""
    for number, piece in enumerate(pieces):
        text += piece
        chunk = builder.chunk(0, output(text, piece, "stop" if number == len(pieces) - 1 else None))
        streamed_content += (chunk or {"choices": [{"delta": {}}]})["choices"][0]["delta"].get("content") or ""
    assert streamed_content == (PARSER.message(text, "stop")[0]["content"] or "")


def test_calls_after_text_become_tool_calls_and_the_text_their_content():
    message, finish = PARSER.message(f"Let me look.\n{WEATHER_CALL}\n{TIME_CALL}", "stop")
    assert finish == "tool_calls" and message["content"] == "Let me look."
    assert calls_of(message) == [("get_weather", {"city": "Bath", "unit": "celsius"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    message, _ = PARSER.message(WEATHER_CALL, "stop")
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_a_last_call_left_open_counts_only_where_the_model_ended_there():
    unclosed = WEATHER_CALL.removesuffix("</tool_call>")
    assert calls_of(PARSER.message(unclosed, "stop")[0]) == [("get_weather", {"city": "Bath", "unit": "celsius"})]
    assert PARSER.message(unclosed, "length") == ({"role": "assistant", "content": unclosed}, "length")


@pytest.mark.parametrize("text", [
    "The weather is fine.",  # no call
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Ba</tool_call>',  # JSON cut short
    '<tool_call>{"name": "get_date", "arguments": {}}</tool_call>',  # a function the request does not define
    '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',  # arguments not an object
    f"{WEATHER_CALL}<tool_call>[1, 2]</tool_call>",  # one of two does not parse: none is made up
    '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',  # a name that is no string
    '<tool_call>{"name": "get_time", "arguments": {"at": NaN}}</tool_call>',  # no JSON for NaN
    '<tool_call>{"name": "get_time", "arguments": {"at": "\\ud800"}}</tool_call>',  # a lone surrogate: no UTF-8
])
def test_an_output_whose_calls_do_not_parse_stays_text(text):
    assert PARSER.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


def output(text: str, new_text: str, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1], text, finish_reason is not None, finish_reason, 0,
                         RequestMetrics(0.0, None, None, 0, 0), new_text=new_text)


def streamed(text: str, pieces: list[int], finish_reason: str, parser: AutoToolCalls = PARSER) -> list[dict]:
    """The deltas of a choice whose text is released in pieces of these lengths, the last one finishing it."""
    builder = ResponseBuilder(True, "m", None, 1, tool_calls=parser)
    deltas, at = [], 0
    for number, size in enumerate(pieces):
        last = number == len(pieces) - 1
        chunk = builder.chunk(0, output(text[: at + size], text[at : at + size], finish_reason if last else None))
        at += size
        if chunk is not None:
            deltas.append({**chunk["choices"][0]["delta"], "finish_reason": chunk["choices"][0]["finish_reason"]})
    return deltas


def test_streamed_text_stops_where_a_call_begins_and_the_calls_come_whole_at_the_end():
    text = f"Let me look. {WEATHER_CALL}"
    deltas = streamed(text, [4, 10, 3, 3, len(text) - 20], "stop")  # pieces split the tag: "<", "too", "l_c"
    shown = "".join(d.get("content") or "" for d in deltas)
    assert shown.strip() == "Let me look." and "<" not in shown
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert calls_of(deltas[-1]) == [("get_weather", {"city": "Bath", "unit": "celsius"})]
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0]


def test_text_that_only_looked_like_a_call_is_streamed_once_it_cannot_be_one():
    text = "If a <to b then <tool_call>{bad json</tool_call> done."
    deltas = streamed(text, [6, 2, 1, len(text) - 9], "stop")
    assert deltas[0] == {"content": "If a", "finish_reason": None}  # " <" held back: "<" may begin a tag
    assert "".join(d.get("content") or "" for d in deltas) == text  # nothing parsed: all of it is text
    assert deltas[-1]["finish_reason"] == "stop"


def test_the_flags_go_together():
    with pytest.raises(KvstrataError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerOptions(enable_auto_tool_choice=True)
    with pytest.raises(KvstrataError, match="--tool-call-parser 'granite' is not known; known: hermes, llama3_json, "
                                            "mistral, pythonic"):
        ServerOptions(tool_call_parser="granite")


def test_auto_is_taken_with_the_parser_and_a_text_answer_is_text(tiny_llama):
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with running_server(str(tiny_llama), server_options=options, kv_cache_memory="8MiB") as (url, _):
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                "max_tokens": 6, "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert reply["finish_reason"] == "length" and reply["message"]["content"]  # the tiny model writes no tags
        assert "tool_calls" not in reply["message"]
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == reply["message"]["content"]
        one = httpx.post(url + "/v1/chat/completions", json={**body, "parallel_tool_calls": False}, timeout=60)
        assert one.status_code == 200  # held to the first call, where the model makes several


@pytest.mark.real_model
def test_a_call_the_model_writes_comes_back_as_a_tool_call_through_openai_s_client():
    """The default model does not write Hermes calls of its own accord, so a regex holds it to one; the parser
    then reads its text as any Hermes model's."""
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with running_server(None, server_options=options, kv_cache_memory="64MiB", max_model_len=1024) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = {"model": "test-model", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
               "tools": TOOLS, "max_tokens": 60, "temperature": 0, "extra_body": {"structured_outputs": {
                   "regex": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]+", '
                            r'"unit": "celsius"\}\}\n</tool_call>'}}}
        answer = client.chat.completions.create(**ask)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks).strip() == "Checking."
        (streamed_call,) = [call for c in chunks if c.delta.tool_calls for call in c.delta.tool_calls]
        assert streamed_call.function.arguments == call.function.arguments and chunks[-1].finish_reason == "tool_calls"


def test_text_held_back_for_a_stop_string_is_not_taken_for_streamed_text():
    builder = ResponseBuilder(True, "m", None, 1, tool_calls=PARSER)
    first = builder.chunk(0, output("Sunny to", "Sunny "))  # " to" held back: a stop string may begin there
    second = builder.chunk(0, output("Sunny today", "today", "stop"))
    assert [c["choices"][0]["delta"] for c in (first, second)] == [{"content": "Sunny"}, {"content": " today"}]


def test_where_the_tokenizer_makes_the_tags_special_tokens_they_stay_in_the_text(tiny_llama):
    from kvstrata.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.server.protocol import ChatCompletionRequest
    from kvstrata.server.request_prep import RequestPreparer

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB"))
    preparer = RequestPreparer(engine, ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auto, plain = (ChatCompletionRequest.model_validate({**body, **extra}) for extra in ({"tools": TOOLS}, {}))
    assert preparer.prepare(auto)[0][1].skip_special_tokens  # the tiny tokenizer's tags are plain text
    engine.tokenizer.special_token_texts = engine.tokenizer.special_token_texts | {"<tool_call>"}  # as Hermes 2 Pro's
    preparer = RequestPreparer(engine, preparer.options)
    assert not preparer.prepare(auto)[0][1].skip_special_tokens
    assert preparer.prepare(plain)[0][1].skip_special_tokens


def test_text_sent_at_the_end_joins_the_text_streamed_before_it():
    """The last chunk carries the text before the call that was not streamed yet (held back for a stop string, say):
    it joins what was streamed as the whole message's content reads."""
    builder = ResponseBuilder(True, "m", None, 1, tool_calls=PARSER)
    text = f"Hello world {TIME_CALL}"
    deltas = [builder.chunk(0, output("Hello", "Hello")), builder.chunk(0, output(text, text[5:], "stop"))]
    streamed_content = "".join(c["choices"][0]["delta"].get("content") or "" for c in deltas)
    assert streamed_content == PARSER.message(text, "stop")[0]["content"] == "Hello world"
