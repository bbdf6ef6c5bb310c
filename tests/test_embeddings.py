"""Embeddings (LLM.embed, POST /v1/embeddings): the last token's final hidden state, as transformers computes it,
whether the prompt is chunked, shares its steps with generation or reads its prefix from the prefix cache."""

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from kvstrata import LLM, PoolingParams, SamplingParams
from kvstrata.errors import KvstrataError, ParameterError
from tests.server_harness import running_server

PROMPTS = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 9, 70)]


def reference(path, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden state of the prompt's last token (after the model's last norm)."""
    with torch.no_grad():
        return AutoModel.from_pretrained(str(path))(torch.tensor([prompt])).last_hidden_state[0, -1]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, chunk_size=32)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_an_embedding_is_the_last_token_s_final_hidden_state(model, request):
    path = request.getfixturevalue(model)
    llm = LLM(str(path), kv_cache_memory="8MiB", max_model_len=256, chunk_size=32)  # the 70-token prompt: 3 chunks
    outputs = llm.embed(PROMPTS)
    raw = llm.embed(PROMPTS, PoolingParams(normalize=False))
    for prompt, output, plain in zip(PROMPTS, outputs, raw):
        assert plain.embedding.untyped_storage().nbytes() == 4 * len(plain.embedding)  # its own, not the step's
        expected = reference(path, prompt)
        assert torch.allclose(plain.embedding, expected, atol=1e-4)
        assert torch.allclose(output.embedding, F.normalize(expected, dim=0), atol=1e-5)
        assert output.finished and output.finish_reason == "stop" and output.token_ids == []


def test_dimensions_keep_the_first_values_then_normalize(llm, tiny_llama):
    [output] = llm.embed(PROMPTS[2:], PoolingParams(dimensions=5))
    assert torch.allclose(output.embedding, F.normalize(reference(tiny_llama, PROMPTS[2])[:5], dim=0), atol=1e-5)


def test_an_embedding_of_a_cached_prefix_equals_computing_it(llm):
    llm.engine.reset_prefix_cache()
    first = llm.embed(PROMPTS[2:])[0]
    again = llm.embed(PROMPTS[2:])[0]  # its full blocks come from the prefix cache: only the last token is computed
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    assert torch.allclose(first.embedding, again.embedding, atol=1e-6)
    generated = llm.generate(PROMPTS[2:] + [PROMPTS[2] + [7]], SamplingParams(max_tokens=2))
    assert generated[1].num_cached_tokens == 64  # and so do generations after it


def test_embeddings_and_generations_share_steps_and_keep_their_results(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    embeddings = [o.embedding for o in llm.embed(PROMPTS)]
    engine = llm.engine
    engine.reset_prefix_cache()
    ids = [engine.add_request(prompt, greedy) for prompt in PROMPTS]
    ids += [engine.add_request(prompt, SamplingParams(max_tokens=1, pooling=PoolingParams())) for prompt in PROMPTS]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finished[i].token_ids for i in ids[:3]] == alone
    for request_id, embedding in zip(ids[3:], embeddings):
        assert torch.allclose(finished[request_id].embedding, embedding, atol=1e-5)


def test_a_prompt_to_embed_may_fill_the_context(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=32)
    prompt = PROMPTS[2][:32]
    assert torch.allclose(llm.embed([prompt])[0].embedding, F.normalize(reference(tiny_llama, prompt), dim=0),
                          atol=1e-5)
    with pytest.raises(KvstrataError, match="the context allows at most 31"):
        llm.generate([prompt])
    with pytest.raises(KvstrataError, match="allows at most 32 \\(max_model_len 32\\)"):
        llm.embed([PROMPTS[2][:33]])


def test_what_an_embedding_cannot_be_is_refused_by_name(llm):
    for make, param in ((lambda: PoolingParams(dimensions=0), "dimensions"),
                        (lambda: PoolingParams(normalize="yes"), "normalize"),
                        (lambda: llm.embed(PROMPTS[:1], PoolingParams(dimensions=65)), "dimensions")):
        with pytest.raises(ParameterError) as error:
            make()
        assert error.value.param == param
    with pytest.raises(KvstrataError, match="embeds its prompt generates nothing"):
        SamplingParams(pooling=PoolingParams(), prompt_logprobs=1)
    with pytest.raises(KvstrataError, match="2 pooling params for 3 prompts; give one PoolingParams"):
        llm.embed(PROMPTS, [PoolingParams()] * 2)


def test_the_server_answers_openai_s_embeddings_request(tiny_llama, llm):
    texts = ["Emma Woodhouse, handsome, clever, and rich", "with a comfortable home and happy disposition"]
    expected = llm.embed([*texts, PROMPTS[2]])
    with running_server(str(tiny_llama), "m", kv_cache_memory="8MiB", max_model_len=256) as (url, _):
        def post(body):
            return httpx.post(f"{url}/v1/embeddings", json={"model": "m", **body}, timeout=60)

        answer = post({"input": texts}).json()  # a batch: an embedding each, in order
        assert answer["object"] == "list" and answer["model"] == "m"
        assert [d["index"] for d in answer["data"]] == [0, 1]
        for data, output in zip(answer["data"], expected):
            assert np.allclose(data["embedding"], output.embedding.numpy(), atol=1e-5)
        tokens = sum(len(output.prompt_token_ids) for output in expected[:2])
        assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        by_ids = post({"input": [PROMPTS[2]]}).json()["data"][0]["embedding"]  # token ids, in a batch of one
        assert np.allclose(by_ids, expected[2].embedding.numpy(), atol=1e-5)
        text = texts[0]
        packed = post({"input": text, "encoding_format": "base64", "dimensions": 8}).json()["data"][0]["embedding"]
        values = np.frombuffer(base64.b64decode(packed), dtype="<f4")
        assert values.shape == (8,) and np.isclose(np.linalg.norm(values), 1, atol=1e-5)
        for body, status, param in (({"input": ""}, 400, "input"), ({"input": [], "dimensions": 4}, 400, "input"),
                                    ({"input": text, "dimensions": 65}, 400, "dimensions"),
                                    ({"input": [10**6]}, 400, "input"), ({"input": text, "priority": 1}, 400,
                                                                          "priority"),
                                    ({"input": text, "encoding_format": "int8"}, 400, "encoding_format"),
                                    ({"input": text, "model": "other"}, 404, "model")):
            reply = post(body)
            assert (reply.status_code, reply.json()["error"]["param"]) == (status, param), body
        metrics = httpx.get(f"{url}/metrics").text  # embedding requests count their prompts, as vLLM counts them
        counted = next(line for line in metrics.splitlines() if line.startswith("kvstrata:prompt_tokens_total"))
        assert float(counted.split()[-1]) >= tokens + len(PROMPTS[2])
        schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
        lengths = {name: schema[name]["properties"][field]["anyOf"][1]["maxItems"]
                   for name, field in (("EmbeddingRequest", "input"), ("CompletionRequest", "prompt"))}
        assert lengths == {"EmbeddingRequest": 256, "CompletionRequest": 255}  # an input to embed may fill it


def test_an_embedding_reads_its_prefix_from_the_kv_store(tiny_llama, llm, tmp_path):
    store = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, kv_store=f"disk:{tmp_path}/kv:64MiB",
                kv_store_chunk_tokens=32)
    first = store.embed(PROMPTS[2:])[0]
    store.engine.kv_store.flush()
    store.engine.reset_prefix_cache()
    again = store.embed(PROMPTS[2:])[0]  # its two chunks before the last token come from the disk tier
    assert store.engine.kv_store.stats.loaded_tokens == 64 and again.num_cached_tokens == 64
    assert torch.allclose(first.embedding, again.embedding, atol=1e-5)
    assert torch.allclose(again.embedding, llm.embed(PROMPTS[2:])[0].embedding, atol=1e-5)


def test_score_and_rerank_are_the_cosines_of_the_embeddings(tiny_llama, llm):
    query, documents = "Who lives at Hartfield?", ["Emma lives at Hartfield.", "Box Hill", "Mr. Knightley's Donwell"]
    vectors = [o.embedding for o in llm.embed([query, *documents])]
    cosines = [float(vectors[0] @ v) for v in vectors[1:]]
    with running_server(str(tiny_llama), "m", kv_cache_memory="8MiB", max_model_len=256) as (url, _):
        def post(path, body):
            return httpx.post(f"{url}{path}", json={"model": "m", **body}, timeout=60)

        for path in ("/score", "/v1/score"):
            answer = post(path, {"text_1": query, "text_2": documents}).json()
            assert [d["index"] for d in answer["data"]] == [0, 1, 2]
            assert np.allclose([d["score"] for d in answer["data"]], cosines, atol=1e-5)
        pairwise = post("/score", {"text_1": [query, documents[1]], "text_2": [documents[0], documents[2]]}).json()
        assert np.isclose(pairwise["data"][1]["score"], float(vectors[2] @ vectors[3]), atol=1e-5)
        best_first = sorted(range(3), key=lambda i: -cosines[i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            results = post(path, {"query": query, "documents": documents, "top_n": 2}).json()["results"]
            assert [r["index"] for r in results] == best_first[:2]
            assert results[0]["document"] == {"text": documents[best_first[0]]}
            assert np.isclose(results[0]["relevance_score"], cosines[best_first[0]], atol=1e-5)
        every = post("/rerank", {"query": query, "documents": documents, "top_n": -1}).json()["results"]
        assert [r["index"] for r in every] == best_first  # 0 or less: all, as vLLM takes it
        for path, body, param in (("/score", {"text_1": [query] * 2, "text_2": documents}, "text_1"),
                                  ("/score", {"text_1": query, "text_2": [documents[0], ""]}, "text_2.1"),
                                  ("/rerank", {"query": query, "documents": []}, "documents"),
                                  ("/rerank", {"query": query, "documents": [documents[0], "word " * 300]},
                                   "documents.1"),
                                  ("/rerank", {"query": query, "documents": documents * 682}, "documents"),
                                  ("/rerank", {"query": "Highbury " * 10_000, "documents": documents}, "query")):
            reply = post(path, body)
            assert (reply.status_code, reply.json()["error"]["param"]) == (400, param), body
