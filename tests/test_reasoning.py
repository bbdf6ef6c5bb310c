"""--reasoning-parser: a reasoning model's thinking comes back as reasoning_content, apart from its answer (and its
tool calls), whole or streamed, never a tag's letters in either."""

import httpx
import pytest

from kvstrata.engine.outputs import RequestMetrics, RequestOutput
from kvstrata.errors import KvstrataError
from kvstrata.server.hermes_tool_calls import HermesToolCalls
from kvstrata.server.options import ServerOptions
from kvstrata.server.reasoning import ReasoningParser
from kvstrata.server.responses import ResponseBuilder
from tests.server_harness import running_server

QWEN3, R1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
THOUGHT = "<think>\nThe capital is Paris.\n</think>\n\nParis."


@pytest.mark.parametrize("parser, text, fields", [
    (QWEN3, THOUGHT, ("The capital is Paris.", "Paris.")),
    (QWEN3, "Paris.", (None, "Paris.")),  # thinking switched off
    (QWEN3, "<think>\nStill think", ("Still think", "")),  # cut short by max_tokens
    (R1, THOUGHT, ("The capital is Paris.", "Paris.")),
    (R1, "The capital is Paris.\n</think>\n\nParis.", ("The capital is Paris.", "Paris.")),  # opened by the prompt
    (R1, "Still think", ("Still think", "")),
    (R1, "\n<think>x</think>y", ("x", "y")),  # the tag after a line break
    (QWEN3, "\n<think>x</think>y", ("x", "y")),
])
def test_the_thinking_is_told_from_the_answer(parser, text, fields):
    assert parser.message_fields(text) == fields


def output(text: str, new_text: str, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1], text, finish_reason is not None, finish_reason, 0,
                         RequestMetrics(0.0, None, None, 0, 0), new_text=new_text)


def streamed(builder: ResponseBuilder, text: str, size: int, finish_reason: str) -> list[dict]:
    """The deltas of a choice whose text is released `size` characters at a time."""
    deltas = []
    for at in range(0, len(text), size):
        finished = at + size >= len(text)
        chunk = builder.chunk(0, output(text[: at + size], text[at : at + size], finish_reason if finished else None))
        if chunk is not None:
            deltas.append({**chunk["choices"][0]["delta"], "finish_reason": chunk["choices"][0]["finish_reason"]})
    return deltas


def joined(deltas: list[dict], field: str) -> str:
    return "".join(d.get(field) or "" for d in deltas)


@pytest.mark.parametrize("parser", [QWEN3, R1])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_thinking_and_answer_never_show_a_tag(parser, size):
    builder = ResponseBuilder(True, "m", None, 1, reasoning=parser)
    deltas = streamed(builder, THOUGHT, size, "stop")
    assert joined(deltas, "reasoning_content") == "The capital is Paris."
    assert joined(deltas, "content") == "Paris." and deltas[-1]["finish_reason"] == "stop"
    whole = builder.full([output(THOUGHT, "", "stop")])["choices"][0]["message"]
    assert whole == {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital is Paris."}


def test_an_answer_without_thinking_streams_as_text_once_it_cannot_open_a_thought():
    deltas = streamed(ResponseBuilder(True, "m", None, 1, reasoning=QWEN3), "<th>Paris</th>", 2, "stop")
    assert deltas[0]["content"] == "<th>" and joined(deltas, "content") == "<th>Paris</th>"  # "<t" was held
    assert joined(deltas, "reasoning_content") == ""


def test_calls_after_the_thinking_are_parsed_and_the_thinking_kept_apart():
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"<think>\nI need the time.\n</think>\n\n{call}"
    builder = ResponseBuilder(True, "m", None, 1, tool_calls=HermesToolCalls(frozenset({"get_time"})),
                              reasoning=QWEN3)
    message = builder.full([output(text, "", "stop")])["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None
    assert message["message"]["reasoning_content"] == "I need the time."
    assert message["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    deltas = streamed(ResponseBuilder(True, "m", None, 1, tool_calls=HermesToolCalls(frozenset({"get_time"})),
                                      reasoning=QWEN3), text, 5, "stop")
    assert joined(deltas, "reasoning_content") == "I need the time." and joined(deltas, "content") == ""
    assert deltas[-1]["tool_calls"][0]["function"]["name"] == "get_time"


def test_without_include_reasoning_the_thinking_is_dropped():
    builder = ResponseBuilder(True, "m", None, 1, reasoning=QWEN3, include_reasoning=False)
    assert builder.full([output(THOUGHT, "", "stop")])["choices"][0]["message"] == {
        "role": "assistant", "content": "Paris."}
    deltas = streamed(ResponseBuilder(True, "m", None, 1, reasoning=QWEN3, include_reasoning=False), THOUGHT, 4, "stop")
    assert joined(deltas, "reasoning_content") == "" and joined(deltas, "content") == "Paris."


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(KvstrataError, match="--reasoning-parser 'o1' is not known; known: qwen3, deepseek_r1"):
        ServerOptions(reasoning_parser="o1")


def test_the_server_takes_the_parser_and_a_constrained_output_is_all_answer(tiny_llama):
    options = ServerOptions(reasoning_parser="deepseek_r1", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with running_server(str(tiny_llama), server_options=options, kv_cache_memory="8MiB") as (url, _):
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "temperature": 0}
        free = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert free["content"] == "" and free["reasoning_content"]  # no </think>: all of it was thinking
        chosen = httpx.post(url + "/v1/chat/completions", json={**body, "structured_outputs": {"choice": ["yes"]}},
                            timeout=60).json()["choices"][0]["message"]
        assert chosen == {"role": "assistant", "content": "yes"}  # held to the choice: no thinking in it
        dropped = httpx.post(url + "/v1/chat/completions", json={**body, "include_reasoning": False},
                             timeout=60).json()["choices"][0]["message"]
        assert dropped == {"role": "assistant", "content": ""}
