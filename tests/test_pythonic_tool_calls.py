"""tool_choice "auto" with --tool-call-parser pythonic: an output that is a Python list of calls, as Llama 3.2 and
Llama 4 write them, becomes OpenAI's tool_calls with JSON arguments; any other output stays text."""

import json

import openai
import pytest

from kvstrata.server.options import ServerOptions
from kvstrata.server.pythonic_tool_calls import PythonicToolCalls
from tests.server_harness import running_server
from tests.test_hermes_tool_calls import calls_of, streamed
from tests.test_tool_calls import TOOLS

PARSER = PythonicToolCalls(frozenset({"get_weather", "get_time"}))
WEATHER = ("get_weather", {"city": "Bath", "unit": "celsius"})


@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="Bath", unit="celsius")]', [WEATHER]),
    ("\n[get_weather(city='Bath', unit='celsius'), get_time()]\n", [WEATHER, ("get_time", {})]),
    ('<|python_start|>[get_weather(city="Bath", unit="celsius")]<|python_end|>', [WEATHER]),  # Llama 4's tags
    ("[get_time(zones=('UTC', 'CET'), at={'hour': 9, 'exact': True, 'tz': None}, fraction=-0.5)]",
     [("get_time", {"zones": ["UTC", "CET"], "at": {"hour": 9, "exact": True, "tz": None}, "fraction": -0.5})]),
])
def test_python_calls_become_tool_calls_with_json_arguments(text, calls):
    message, finish = PARSER.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None and calls_of(message) == calls


def test_without_parallel_calls_the_first_call_alone_is_kept():
    message, _ = PythonicToolCalls(PARSER.functions, parallel=False).message("[get_time(), get_time(a=1)]", "stop")
    assert calls_of(message) == [("get_time", {})]


@pytest.mark.parametrize("text", [
    "The weather in Bath is fine.",
    "[1, 2, 3]",  # a list, but not of calls
    "[]",
    '[get_weather(city="Bath"',  # cut short
    '[get_date(day="Monday")]',  # a function the request does not define
    '[get_weather("Bath")]',  # an argument without its name
    "[get_weather(city=town)]",  # not a literal
    "[get_weather(**{'city': 'Bath'})]",
    "[get_time(at={1, 2})]",  # a set: no JSON for it
    "[get_time(x=1e999)]",  # infinite: no JSON for it
    "[get_time(x=1, x=2)]",  # an argument given twice
    '[get_time()] and that is all',  # text after the calls
    "import os; os.remove('x')",
])
def test_an_output_that_is_not_a_list_of_calls_stays_text(text):
    assert PARSER.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_text_streams_as_it_comes_and_calls_come_whole_at_the_end():
    deltas = streamed("Bath is sunny.", [3, 11], "stop", PythonicToolCalls(PARSER.functions))
    assert [d.get("content") for d in deltas] == ["Bat", "h is sunny."]
    text = "<|python_start|>[get_time()]<|python_end|>"
    deltas = streamed(text, [2, 10, len(text) - 12], "stop", PARSER)
    assert not any(d.get("content") for d in deltas) and calls_of(deltas[-1]) == [("get_time", {})]


@pytest.mark.real_model
def test_a_call_the_model_writes_comes_back_as_a_tool_call_through_openai_s_client():
    """The default model does not write Python calls of its own accord, so a regex holds it to one."""
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    with running_server(None, server_options=options, kv_cache_memory="64MiB", max_model_len=1024) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        choice = client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
            max_tokens=40, temperature=0, extra_body={"structured_outputs": {
                "regex": r'\[get_weather\(city="[A-Z][a-z]+", unit="celsius"\)\]'}}).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
