"""Structured output: outputs held to a regex, a list of choices, a grammar or a JSON schema, whatever the weights
(random ones here, so only the constraint can make the text valid), beside unconstrained requests that stay as
they were; bad constraints refused before anything runs."""

import json
import re

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstrata import LLM, SamplingParams, StructuredOutput
from kvstrata.engine.grammar_matcher import GrammarCompiler, _TokensInContext, allowed_tokens
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.model.tokenizer import Tokenizer
from tests.helpers import hf_logits
from tests.server_harness import running_server

CODE = r"[0-9]{3}-[a-z]{2,6}"
# the tiny tokenizer has no braces: its grammars use words
LARK = 'start: item ("," item)*\nitem: "tea" | "milk" | NUMBER\nNUMBER: /[0-9]+/'
GBNF = 'root ::= "yes" | "no" | "perhaps"'


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", chunk_size=32)


def sampled(seed: int, constraint: StructuredOutput, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_output=constraint)


@pytest.mark.parametrize("constraint, valid", [
    (StructuredOutput(regex=CODE), lambda text: re.fullmatch(CODE, text)),
    (StructuredOutput(choice=["yes", "no", "not at all"]), lambda text: text in ("yes", "no", "not at all")),
    (StructuredOutput(grammar=LARK), lambda text: re.fullmatch(r"(tea|milk|[0-9]+)(,(tea|milk|[0-9]+))*", text)),
    (StructuredOutput(grammar=GBNF), lambda text: text in ("yes", "no", "perhaps")),
], ids=["regex", "choice", "lark", "gbnf"])
def test_sampled_outputs_of_random_weights_hold_to_the_constraint(llm, constraint, valid):
    outputs = llm.generate(["Emma was"] * 6, [sampled(seed, constraint) for seed in range(6)])
    for output in outputs:
        assert output.finish_reason in ("stop", "length")
        if output.finish_reason == "stop":
            assert valid(output.text), output.text
    assert sum(o.finish_reason == "stop" for o in outputs) >= 3  # most end where the constraint is complete


def test_a_complete_constraint_ends_the_output_at_once(llm):
    out = llm.generate(["Emma was"], SamplingParams(max_tokens=30, temperature=0.0,
                                                    structured_output=StructuredOutput(choice=["yes", "no"])))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    # the choice's tokens, no EOS step after them
    assert llm.engine.tokenizer.eos_token_id not in out.token_ids
    assert llm.engine.tokenizer.decode(out.token_ids) == out.text


def test_greedy_constrained_output_is_transformers_likeliest_allowed_token_each_step(llm, tiny_llama):
    """Each token is the argmax of transformers' logits (same weights) over what the constraint allows then."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    constraint = StructuredOutput(regex=CODE)
    out = llm.generate(["Mr. Knightley"], SamplingParams(max_tokens=12, temperature=0.0,
                                                         structured_output=constraint))[0]
    assert re.fullmatch(CODE, out.text) and out.finish_reason == "stop"
    matcher = llm.engine.grammars.matcher(constraint)
    prompt = llm.engine.tokenize("Mr. Knightley")
    for step, token in enumerate(out.token_ids):
        logits = hf_logits(hf, prompt + out.token_ids[:step])[-1]
        allowed = torch.from_numpy(allowed_tokens(matcher, logits.shape[-1]))
        assert int(logits.masked_fill(~allowed, float("-inf")).argmax()) == token
        assert matcher.consume_token(token)


def test_unconstrained_requests_in_the_same_steps_are_unchanged(llm):
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["Emma was", "Harriet said"], plain)
    mixed = llm.generate(["Emma was", "Harriet said", "Emma was"],
                         [plain, plain, sampled(3, StructuredOutput(regex=CODE))])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert re.fullmatch(CODE, mixed[2].text) or mixed[2].finish_reason == "length"


def test_the_eos_that_ends_a_complete_constraint_is_not_text_even_when_eos_is_ignored(llm):
    """ "[0-9]{1,3}" may end after one digit: its EOS ends it (finish "stop"), and is never shown as text."""
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True, skip_special_tokens=False,
                             structured_output=StructuredOutput(regex="[0-9]{1,3}")) for seed in range(8)]
    outputs = llm.generate(["Emma was"] * 8, params)
    assert all(o.finish_reason == "stop" and re.fullmatch("[0-9]{1,3}", o.text) for o in outputs), outputs
    eos = llm.engine.tokenizer.eos_token_id
    assert any(o.token_ids[-1] == eos for o in outputs)  # some ended by EOS, as the constraint allowed


def test_a_seeded_constrained_request_samples_the_same_output_again(llm):
    params = [sampled(7, StructuredOutput(grammar=LARK)), sampled(8, StructuredOutput(grammar=LARK))]
    first, second = (llm.generate(["Emma was"] * 2, params) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_each_of_n_samples_follows_its_own_matcher(llm):
    engine = llm.engine
    constraint = StructuredOutput(choice=["tea", "milk", "a little tea with milk"])
    for seed in range(4):
        engine.add_request("Emma was", sampled(seed, constraint), request_id=f"n{seed}")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert {o.text for o in finished.values()} <= {"tea", "milk", "a little tea with milk"}


def test_a_constraint_the_tokenizer_cannot_begin_is_refused_before_it_runs(llm):
    """The tiny tokenizer has no token holding "{": a JSON object cannot begin."""
    message = "the structured output's json_object cannot begin: no token of this tokenizer holds byte 0x7b"
    with pytest.raises(ParameterError, match=message):
        llm.engine.add_request("Emma was", SamplingParams(structured_output=StructuredOutput(json_object=True)))
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_the_tokenizer_cannot_go_on_with_fails_its_request_alone(llm):
    """ "a" or "b", then "{" (a byte no tiny token holds): it can begin, then not go on. The request beside it goes
    on."""
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stuck = SamplingParams(max_tokens=8, structured_output=StructuredOutput(regex="(a|b)[{]"))
    alone = llm.generate(["Emma was"], plain)[0]
    failed, beside = llm.generate(["Harriet said", "Emma was"], [stuck, plain])
    assert failed.finish_reason == "error" and "structured output cannot go on" in failed.error
    assert "0x7b" in failed.error  # the byte of "{"
    assert llm.engine.tokenizer.decode(failed.token_ids) in ("a", "b")
    assert beside.token_ids == alone.token_ids


@pytest.mark.parametrize("options, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON object"),
    ({"regex": ""}, "non-empty string"),
    ({"json_object": 1}, "true or false"),
    ({"regex": "a+", "any_whitespace": False}, "applies to JSON"),
    ({"json_object": True, "any_whitespace": None}, "true or false"),
])
def test_bad_constraints_are_refused_when_built(options, message):
    with pytest.raises(KvstrataError, match=message):
        StructuredOutput(**options)


@pytest.mark.parametrize("options, message", [
    ({"min_tokens": 2}, "min_tokens cannot be combined"),
    ({"allowed_token_ids": [5]}, "allowed_token_ids cannot be combined"),
])
def test_options_that_could_leave_no_token_allowed_are_refused(options, message):
    with pytest.raises(KvstrataError, match=message):
        SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="a+"), **options)


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutput(regex="[0-9"), "regex is not valid"),
    (StructuredOutput(regex="("), r"regex is not valid: .*regex parse error: unclosed group$"),  # the reason kept
    (StructuredOutput(grammar="root ::= root"), "grammar cannot begin: no token can begin or extend it"),
    (StructuredOutput(grammar="start: undefined_rule"), "grammar is not valid"),
    (StructuredOutput(grammar="root ::= ("), "grammar cannot be read"),
    (StructuredOutput(json={"type": "object", "properties": {"a": {"type": "no such type"}}}), "json is not valid"),
])
def test_a_constraint_that_does_not_compile_fails_its_request_before_it_runs(llm, constraint, message):
    engine = llm.engine
    with pytest.raises(ParameterError, match=message) as error:
        engine.add_request("Emma was", SamplingParams(max_tokens=4, structured_output=constraint))
    assert error.value.param == "structured_output"
    assert not engine.has_unfinished_requests()


def test_text_is_encoded_into_tokens_of_exactly_its_bytes(tiny_llama):
    """The encoder llguidance calls for text it must force, for tokenizers it does not read itself."""
    tokenizer = Tokenizer.from_directory(tiny_llama)
    tokens = _TokensInContext(tokenizer, tokenizer.eos_token_id)
    encoded = tokens("Emma was here")
    assert b"".join(tokens.tokens[t] for t in encoded) == b"Emma was here"
    with pytest.raises(ValueError, match="no token of this tokenizer holds byte 0x7b"):
        tokens("a{")


def test_the_tokenizers_tokens_are_read_as_the_detokenizer_renders_them(tiny_llama):
    """The tiny tokenizer's Metaspace decoder is one llguidance does not read: its tokens are decoded in context."""
    tokenizer = Tokenizer.from_directory(tiny_llama)
    compiler = GrammarCompiler(tokenizer, 320, {tokenizer.eos_token_id})
    matcher = compiler.matcher(StructuredOutput(regex=" so"))
    spaced_so = tokenizer.encode("a so", add_special_tokens=False)[-1]  # "▁so": a space, then "so"
    assert tokenizer.decode([spaced_so], skip_special_tokens=False).strip() == "so"
    assert matcher.consume_token(spaced_so) and matcher.is_stopped()


@pytest.mark.real_model
def test_the_default_model_answers_in_json_that_fits_the_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "coastal": {"type": "boolean"}},
              "required": ["city", "population", "coastal"], "additionalProperties": False}
    llm = LLM(kv_cache_memory="64MiB", max_model_len=1024)
    prompt = llm.chat_prompt([{"role": "user", "content": "Describe Paris as JSON."}])
    outputs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=80, temperature=0.0,
                                                         structured_output=StructuredOutput(json=schema))]
                           + [SamplingParams(max_tokens=80, temperature=0.8, seed=seed,
                                             structured_output=StructuredOutput(json=schema)) for seed in (1, 2)])
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        answer = json.loads(output.text)
        assert set(answer) == {"city", "population", "coastal"}
        assert isinstance(answer["city"], str) and isinstance(answer["coastal"], bool)
        assert isinstance(answer["population"], int) and not isinstance(answer["population"], bool)
    anything = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=0.0,
                                                     structured_output=StructuredOutput(json_object=True)))[0]
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)
    compact = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=0.0, structured_output=StructuredOutput(
        json=schema, any_whitespace=False)))[0]
    assert set(json.loads(compact.text)) == {"city", "population", "coastal"}
    assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', compact.text))  # none outside strings
    assert re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', outputs[0].text))  # the default allows it


def test_the_server_takes_each_way_of_asking_and_answers_as_offline(tiny_llama, llm):
    """vLLM's guided_* fields and structured_outputs, OpenAI's response_format (json_schema on the real model,
    below): the same constraint gives the offline engine's text."""
    regex = StructuredOutput(regex=CODE)
    expected = llm.generate(["Emma was"], SamplingParams(max_tokens=12, temperature=0.0, structured_output=regex))[0]
    choices = StructuredOutput(choice=["yes", "no"])
    chat_prompt = llm.chat_prompt([{"role": "user", "content": "Is Emma rich?"}])
    expected_chat = llm.generate([chat_prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                               structured_output=choices))[0]
    with running_server(str(tiny_llama), "test-model", kv_cache_memory="8MiB") as (url, _):
        for fields in ({"guided_regex": CODE}, {"structured_outputs": {"regex": CODE}}):
            reply = httpx.post(url + "/v1/completions", json={"model": "test-model", "prompt": "Emma was",
                                                               "max_tokens": 12, "temperature": 0, **fields})
            assert reply.json()["choices"][0]["text"] == expected.text
        streamed = httpx.post(url + "/v1/completions", json={"model": "test-model", "prompt": "Emma was",
                                                              "stream": True, "max_tokens": 12, "temperature": 0,
                                                              "guided_regex": CODE})
        pieces = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(p["choices"][0]["text"] for p in pieces) == expected.text
        for fields in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
            reply = httpx.post(url + "/v1/chat/completions", json={
                "model": "test-model", "messages": [{"role": "user", "content": "Is Emma rich?"}], "max_tokens": 12,
                "temperature": 0, **fields})
            assert reply.json()["choices"][0]["message"]["content"] == expected_chat.text
            assert reply.json()["choices"][0]["finish_reason"] == "stop"
        # a constraint that can begin and then not go on (no tiny token holds "{"): the client's error, a 400
        reply = httpx.post(url + "/v1/completions", json={"model": "test-model", "prompt": "Emma was",
                                                           "max_tokens": 8, "guided_regex": "(a|b)[{]"})
        assert reply.status_code == 400 and "cannot go on" in reply.json()["error"]["message"]
        assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.real_model
def test_the_default_model_answers_openai_s_json_schema_request_over_http():
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["title", "year"], "additionalProperties": False}
    with running_server(None, "test-model", kv_cache_memory="64MiB", max_model_len=1024) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "Name a novel by Jane Austen."}], max_tokens=60,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "novel", "schema": schema}})
        answer = json.loads(reply.choices[0].message.content)
        assert set(answer) == {"title", "year"} and isinstance(answer["year"], int)
        reply = client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "Name a novel by Jane Austen, as JSON."}],
            max_tokens=60, temperature=0, response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
