"""vLLM's cache_salt: cached KV (the prefix cache's, the KV store's) is shared only between requests giving the same
string, so one tenant cannot tell from its time to first token what another asked (kv/block_hash.py tenant_salt)."""

import httpx
import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.cluster.routing import prompt_blocks
from kvstrata.config import EngineConfig
from kvstrata.engine.beam_search import BeamSearchParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import ParameterError
from kvstrata.server.responses_protocol import ResponsesRequest
from tests.helpers import ask_alone
from tests.server_harness import running_server

PROMPT = [3 + (11 * i) % 240 for i in range(75)]  # 4 blocks of 16 and 2 store chunks of 32 before its last token
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def ask(engine: LLMEngine, salt: str | None, forget: bool = False, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    """The request's output and its prompt tokens not computed; `forget`: with nothing in the device pool, so that
    only the KV store may give them."""
    return ask_alone(engine, prompt, SamplingParams(**{**vars(GREEDY), "cache_salt": salt}), forget)


def test_cached_kv_is_shared_only_between_requests_with_the_same_salt(tiny_llama, tmp_path):
    other = PROMPT[::-1]
    expected, other_expected = (o.token_ids for o in LLM(str(tiny_llama), kv_cache_memory="8MiB").generate(
        [PROMPT, other], GREEDY))
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256,
                                    kv_store_chunk_tokens=32, kv_store=f"disk:{tmp_path}/kv:64MiB"))
    # the prefix cache, both ways
    assert ask(engine, "alice") == (expected, 0)
    assert ask(engine, None) == (expected, 0)
    assert ask(engine, "alice") == (expected, 64)
    assert ask(engine, "bob") == (expected, 0)
    assert ask(engine, None) == (expected, 64)
    # the KV store below it, where each of them was written in its own chain
    assert ask(engine, "alice", forget=True) == (expected, 64)
    assert ask(engine, "carol", forget=True) == (expected, 0)
    assert ask(engine, None, forget=True) == (expected, 64)
    assert ask(engine, "alice ", forget=True) == (expected, 0)  # another string is another tenant
    # a prompt only a tenant asked is found by that tenant alone, unsalted requests included
    assert ask(engine, "alice", forget=True, prompt=other) == (other_expected, 0)
    assert ask(engine, None, forget=True, prompt=other) == (other_expected, 0)
    assert ask(engine, "alice", forget=True, prompt=other) == (other_expected, 64)


def test_a_cache_salt_must_be_a_non_empty_string():
    for wrong in ("", 7, b"alice"):
        with pytest.raises(ParameterError, match="cache_salt must be a non-empty string") as error:
            SamplingParams(cache_salt=wrong)
        assert error.value.param == "cache_salt"
    with pytest.raises(ParameterError, match="cache_salt"):
        BeamSearchParams(beam_width=2, cache_salt="")


def test_beam_search_and_embeddings_take_a_cache_salt(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256)
    plain = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4))[0]
    salted = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4, cache_salt="alice"))[0]
    assert [b.token_ids for b in salted.sequences] == [b.token_ids for b in plain.sequences]
    embedded = llm.embed([PROMPT], cache_salt="alice")[0]
    assert embedded.num_cached_tokens == 64  # the salted search's blocks
    assert llm.embed([PROMPT], cache_salt="bob")[0].num_cached_tokens == 0
    assert embedded.embedding.allclose(llm.embed([PROMPT])[0].embedding)


def test_the_cluster_routes_a_salted_prompt_by_its_salted_blocks():
    assert prompt_blocks(PROMPT, 16, "alice") == prompt_blocks(PROMPT, 16, "alice")
    assert prompt_blocks(PROMPT, 16, "alice") != prompt_blocks(PROMPT, 16)
    assert prompt_blocks(PROMPT[:5], 16, "alice") != prompt_blocks(PROMPT[:5], 16, "bob")


def test_the_server_takes_vllm_s_cache_salt_field(tiny_llama):
    completion = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
    with running_server(str(tiny_llama), "m", kv_cache_memory="8MiB", max_model_len=256) as (url, _):
        def cached(path: str, body: dict) -> int:
            response = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("completions", completion) == 0
        assert cached("completions", {**completion, "cache_salt": "alice"}) == 0
        assert cached("completions", {**completion, "cache_salt": "alice"}) == 64
        assert cached("completions", completion) == 64
        chat = {"model": "m", "messages": [{"role": "user", "content": "Hello " * 40}], "max_tokens": 2}
        assert cached("chat/completions", {**chat, "cache_salt": "bob"}) == 0
        assert cached("chat/completions", {**chat, "cache_salt": "bob"}) > 0
        for path, body in (("responses", {"model": "m", "input": "Hello", "max_output_tokens": 2}),
                           ("embeddings", {"model": "m", "input": "Hello"}),
                           ("score", {"model": "m", "text_1": "Hello", "text_2": "Hi"}),
                           ("completions", {**completion, "use_beam_search": True, "n": 2})):
            response = httpx.post(f"{url}/v1/{path}", json={**body, "cache_salt": "bob"}, timeout=60)
            assert response.status_code == 200, (path, response.text)
            wrong = httpx.post(f"{url}/v1/{path}", json={**body, "cache_salt": ""}, timeout=60)
            assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "cache_salt", (path, wrong.text)


def test_a_responses_request_keeps_its_cache_salt():
    assert ResponsesRequest(model="m", input="hi", cache_salt="alice").chat_request().cache_salt == "alice"
