"""tool_choice "auto" with --tool-call-parser llama3_json: an output that is JSON calls, as Llama 3.x writes them,
becomes OpenAI's tool_calls; any other output, or calls that do not parse, stays text, streamed as it comes."""

import json

import openai
import pytest

from kvstrata.server.llama3_json_tool_calls import Llama3JsonToolCalls
from kvstrata.server.options import ServerOptions
from tests.server_harness import running_server
from tests.test_hermes_tool_calls import calls_of, streamed
from tests.test_tool_calls import TOOLS

PARSER = Llama3JsonToolCalls(frozenset({"get_weather", "get_time"}))
WEATHER_CALL = '{"name": "get_weather", "parameters": {"city": "Bath", "unit": "celsius"}}'
TIME_CALL = '{"name": "get_time", "arguments": {}}'
WEATHER = ("get_weather", {"city": "Bath", "unit": "celsius"})


@pytest.mark.parametrize("text, calls", [
    (WEATHER_CALL, [WEATHER]),
    (f"<|python_tag|>{WEATHER_CALL}", [WEATHER]),  # the tag, where special tokens stay in the text
    (f"\n {WEATHER_CALL}\n", [WEATHER]),
    (f"{WEATHER_CALL}; {TIME_CALL}", [WEATHER, ("get_time", {})]),
    ('{"name": "get_time"}', [("get_time", {})]),  # a function without arguments
])
def test_json_calls_become_tool_calls(text, calls):
    message, finish = PARSER.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None and calls_of(message) == calls


def test_without_parallel_calls_the_first_call_alone_is_kept():
    message, _ = Llama3JsonToolCalls(PARSER.functions, parallel=False).message(f"{TIME_CALL};{WEATHER_CALL}", "stop")
    assert calls_of(message) == [("get_time", {})]


@pytest.mark.parametrize("text", [
    "The weather in Bath is fine.",  # an answer in text
    f"Let me look. {WEATHER_CALL}",  # calls begin the output or there are none
    '{"answer": 42}',  # JSON, but no call
    WEATHER_CALL[:-3],  # cut short
    '{"name": "get_date", "parameters": {}}',  # a function the request does not define
    '{"name": "get_time", "parameters": "now"}',  # arguments not an object
    f"{WEATHER_CALL} That is all.",  # text after the calls
    f"{WEATHER_CALL}; [1]",  # one of two does not parse: none is made up
    '<|python_tag|>brave_search.call(query="Bath weather")',  # a built-in tool's call
    '{"name": ["get_time"], "parameters": {}}',  # a name that is no string
    '{"name": "get_time", "parameters": {"at": Infinity}}',  # no JSON for it
])
def test_an_output_that_is_not_calls_stays_text(text):
    assert PARSER.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_text_streams_as_it_comes_and_calls_come_whole_at_the_end():
    text = "Rain, mostly."
    deltas = streamed(text, [4, 3, len(text) - 7], "stop", PARSER)
    assert [d.get("content") for d in deltas] == ["Rain", ", m", "ostly."] and deltas[-1]["finish_reason"] == "stop"
    text = f"\n{WEATHER_CALL}"
    deltas = streamed(text, [1, 1, 10, len(text) - 12], "stop", PARSER)
    assert [d for d in deltas if d.get("content")] == []
    assert calls_of(deltas[-1]) == [WEATHER] and deltas[-1]["finish_reason"] == "tool_calls"


def test_what_began_as_the_tag_or_a_call_but_is_neither_is_sent_whole():
    for text, first in (("<|py no tag", 3), ('{"answer": 42} is JSON', 5)):
        deltas = streamed(text, [first, len(text) - first], "stop", PARSER)
        assert deltas[0] == {"content": text, "finish_reason": "stop"}


@pytest.mark.real_model
def test_a_call_the_model_writes_comes_back_as_a_tool_call_through_openai_s_client():
    """The default model does not write Llama 3's calls of its own accord, so a regex holds it to one; the parser
    then reads its text as a Llama 3 model's."""
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    with running_server(None, server_options=options, kv_cache_memory="64MiB", max_model_len=1024) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = {"model": "test-model", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
               "tools": TOOLS, "max_tokens": 60, "temperature": 0, "extra_body": {"structured_outputs": {
                   "regex": r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]+", "unit": "celsius"\}\}'}}}
        choice = client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert not "".join(c.delta.content or "" for c in chunks)
        (streamed_call,) = [call for c in chunks if c.delta.tool_calls for call in c.delta.tool_calls]
        assert streamed_call.function.arguments == call.function.arguments and chunks[-1].finish_reason == "tool_calls"
