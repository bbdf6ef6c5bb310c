"""tool_choice "auto" with --tool-call-parser mistral: what follows [TOOL_CALLS] (a JSON list of calls, or one
name[ARGS]{...} per call) becomes OpenAI's tool_calls with the 9-character ids Mistral's chat templates take back;
the text before it is the content; an output whose calls do not parse stays text."""

import pytest

from kvstrata.server.mistral_tool_calls import MistralToolCalls
from tests.test_hermes_tool_calls import calls_of, streamed

PARSER = MistralToolCalls(frozenset({"get_weather", "get_time"}))
WEATHER = ("get_weather", {"city": "Bath", "unit": "celsius"})
LISTED = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Bath", "unit": "celsius"}}, '
          '{"name": "get_time"}]')
NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Bath", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}'


@pytest.mark.parametrize("text", [LISTED, NAMED])
def test_calls_become_tool_calls_with_ids_mistral_s_templates_take(text):
    message, finish = PARSER.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert calls_of(message) == [WEATHER, ("get_time", {})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() and c["id"].isascii() for c in message["tool_calls"])


def test_the_text_before_the_calls_is_their_content_and_a_written_id_is_kept():
    message, _ = PARSER.message('Let me look.\n[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}', "stop")
    assert message["content"] == "Let me look." and calls_of(message) == [("get_time", {"zone": "UTC"})]
    assert message["tool_calls"][0]["id"] == "a1b2c3d4e"
    one, _ = MistralToolCalls(PARSER.functions, parallel=False).message(NAMED, "stop")
    assert calls_of(one) == [WEATHER]


@pytest.mark.parametrize("text", [
    "Sunny in Bath.",
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Ba',  # cut short
    '[TOOL_CALLS] [{"name": "get_date", "arguments": {}}]',  # a function the request does not define
    '[TOOL_CALLS] [{"name": "get_time", "arguments": "now"}]',  # arguments not an object
    "[TOOL_CALLS] []",
    '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather',  # a second call without its arguments
    '[TOOL_CALLS] [{"name": "get_time"}] and more',  # text after the list
    '[TOOL_CALLS] [{"name": {"get_time": 1}, "arguments": {}}]',  # a name that is no string
])
def test_an_output_whose_calls_do_not_parse_stays_text(text):
    assert PARSER.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_text_streams_until_the_tag_may_begin_and_the_calls_come_whole_at_the_end():
    text = f"Checking [brackets]. {NAMED}"
    deltas = streamed(text, [10, 11, 3, len(text) - 24], "stop", PARSER)
    assert "".join(d.get("content") or "" for d in deltas) == "Checking [brackets]."
    assert calls_of(deltas[-1]) == [WEATHER, ("get_time", {})] and deltas[-1]["finish_reason"] == "tool_calls"


def test_calls_tool_choice_forces_get_mistral_s_ids_too(tiny_llama):
    """A named or "required" call is read back by the same template as the model's own calls."""
    from kvstrata.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.server.options import ServerOptions
    from kvstrata.server.protocol import ChatCompletionRequest
    from kvstrata.server.request_prep import RequestPreparer
    from tests.test_tool_calls import TOOLS

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB"))
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": TOOLS, "tool_choice": "required"})
    for parser, id_length in (("mistral", 9), ("hermes", 29)):
        forced = RequestPreparer(engine, ServerOptions(tool_call_parser=parser)).tool_calls(body)
        message, _ = forced.message('[{"name": "get_time", "parameters": {}}]', "stop")
        assert len(message["tool_calls"][0]["id"]) == id_length
