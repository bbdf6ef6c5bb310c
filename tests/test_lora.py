"""LoRA adapters (--enable-lora, --lora-modules): an adapter's request gives what PEFT gives with that adapter,
whatever else shares its steps; adapters' KV blocks are kept apart; bad adapter files and names are refused naming
what is wrong; the server serves each adapter as a model."""

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvstrata import LLM, BeamSearchParams, LoRARequest, SamplingParams
from kvstrata.bench.lora_adapters import write_random_adapter
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.model.config import ModelConfig
from kvstrata.model.lora import CONFIG_FILE, PICKLED_WEIGHT_FILE, WEIGHT_FILE
from kvstrata.server.options import ServerOptions
from tests.helpers import ask_alone, hf_greedy, hf_logits
from tests.peft_adapters import peft_reference, save_peft_adapter
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 40, 75)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Two adapters of the tiny Llama saved by PEFT: one on every projection (rank 8), one on q, v, gate and down
    (rank 4, 2 for down through rank_pattern, rsLoRA's scaling)."""
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    root = tmp_path_factory.mktemp("adapters")
    return {"all": save_peft_adapter(base, root / "all", seed=1, r=8, lora_alpha=16),
            "some": save_peft_adapter(base, root / "some", seed=2, r=4, lora_alpha=8, use_rslora=True,
                                      rank_pattern={"down_proj": 2},
                                      target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])}


@pytest.fixture(scope="module")
def llm(tiny_llama, adapters):
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, lora_modules=modules)


def peft_model(tiny_llama, adapter_dir=None):
    """transformers on the tiny Llama, with the adapter in `adapter_dir` as PEFT runs it."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    return model if adapter_dir is None else peft_reference(model, adapter_dir)


def test_prefill_logits_equal_peft(llm, tiny_llama, adapters):
    prompt = PROMPTS[2]
    for name, directory in adapters.items():
        params = SamplingParams(max_tokens=1, prompt_logprobs=3, lora_name=name)
        ours = [p.logprob for p in llm.generate([prompt], params)[0].prompt_logprobs[1:]]
        log_probs = hf_logits(peft_model(tiny_llama, directory), prompt).log_softmax(-1)
        reference = [log_probs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert torch.allclose(torch.tensor(ours), torch.tensor(reference), atol=1e-4), name


@pytest.mark.parametrize("lora_dtype", ["float64", "float32"])
def test_adapters_and_the_base_model_in_one_batch_give_each_its_own_greedy_output(tiny_llama, adapters, lora_dtype):
    """Every prompt on the base model and on each adapter, all nine requests scheduled together."""
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, lora_modules=modules, lora_dtype=lora_dtype)
    names = [None, *adapters]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, lora_name=name)
              for name in names for _ in PROMPTS]
    outputs = llm.generate([p for _ in names for p in PROMPTS], params)
    for index, name in enumerate(names):
        model = peft_model(tiny_llama, adapters.get(name))
        for prompt, output in zip(PROMPTS, outputs[index * len(PROMPTS) :]):
            assert output.token_ids == hf_greedy(model, prompt, 24), (name, prompt[:3])
    base, on_all = outputs[: len(PROMPTS)], outputs[len(PROMPTS) : 2 * len(PROMPTS)]
    assert any(a.token_ids != b.token_ids for a, b in zip(base, on_all))  # the adapter changes the output


def test_an_adapters_prefix_blocks_are_not_shared_with_other_adapters_or_the_base_model(llm):
    prompt = PROMPTS[2]
    llm.engine.reset_prefix_cache()
    first = llm.generate([prompt], GREEDY)[0]
    on_adapter = llm.generate([prompt], SamplingParams(**{**vars(GREEDY), "lora_name": "all"}))[0]
    again = llm.generate([prompt], SamplingParams(**{**vars(GREEDY), "lora_name": "all"}))[0]
    other = llm.generate([prompt], SamplingParams(**{**vars(GREEDY), "lora_name": "some"}))[0]
    assert first.num_cached_tokens == 0
    assert on_adapter.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens > 0 and again.token_ids == on_adapter.token_ids


def test_requests_on_one_adapter_sent_together_compute_their_shared_prompt_once(llm):
    llm.engine.reset_prefix_cache()
    params = SamplingParams(**{**vars(GREEDY), "lora_name": "all"})
    alone = llm.generate([PROMPTS[2]], params)[0].token_ids
    llm.engine.reset_prefix_cache()
    together = llm.generate([PROMPTS[2]] * 3, params)
    assert [o.token_ids for o in together] == [alone] * 3
    assert sum(o.num_cached_tokens for o in together) > 0


def test_preempted_requests_on_adapters_keep_their_outputs(tiny_llama, adapters, llm):
    params = [SamplingParams(**{**vars(GREEDY), "lora_name": name}) for name in ("all", "some", None) * 2]
    prompts = [*PROMPTS, *PROMPTS]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    bytes_per_block = 16 * 2 * 3 * 2 * 16 * 4  # tokens * (K,V) * layers * kv heads * head dim * fp32
    cramped = LLM(str(tiny_llama), kv_cache_memory=10 * bytes_per_block, max_model_len=128, chunk_size=32,
                  lora_modules=",".join(f"{name}={path}" for name, path in adapters.items()))
    outputs = cramped.generate(prompts, params)
    assert sum(s.num_preempted for s in cramped.engine.step_stats) > 0
    assert [o.token_ids for o in outputs] == expected


def test_full_offload_serves_adapters(tiny_llama, adapters, llm):
    offloaded = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, kv_offload="full",
                    lora_modules=f"all={adapters['all']}")
    params = SamplingParams(**{**vars(GREEDY), "lora_name": "all"})
    assert ([o.token_ids for o in offloaded.generate(PROMPTS, params)]
            == [o.token_ids for o in llm.generate(PROMPTS, params)])


def test_a_request_on_an_adapter_takes_no_saved_context(llm, tmp_path):
    path = tmp_path / "context.kv"
    llm.save_context(PROMPTS[2], path, levels=["near-lossless"])
    with pytest.raises(KvstrataError, match="computed without LoRA adapter 'all'"):
        llm.generate([PROMPTS[0]], SamplingParams(lora_name="all"), context=path)


def test_an_adapter_s_chunks_in_the_kv_store_serve_only_that_adapter_in_its_dtype(tiny_llama, adapters, llm, tmp_path):
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    prompt = PROMPTS[2]  # 75 tokens: two chunks of 32 before its last token
    expected = {name: llm.generate([prompt], SamplingParams(**{**vars(GREEDY), "lora_name": name}))[0].token_ids
                for name in (None, *adapters)}

    def ask(engine, name):
        """The request's output and the prompt tokens the store gave it, with nothing in the device pool."""
        return ask_alone(engine, prompt, SamplingParams(**{**vars(GREEDY), "lora_name": name}))

    def make(dtype="float64"):
        return LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256,
                                      lora_modules=modules, lora_dtype=dtype, kv_store_chunk_tokens=32,
                                      kv_store=f"disk:{tmp_path}/kv:64MiB"))

    writer = make()
    assert ask(writer, "all") == (expected["all"], 0)  # computed, then written to the disk tier
    assert ask(writer, "all") == (expected["all"], 64)  # read back on the same adapter
    assert ask(writer, "some") == (expected["some"], 0)  # another adapter computes it
    assert ask(writer, None) == (expected[None], 0)  # and so does the base model
    assert ask(make(), "all") == (expected["all"], 64)  # an engine started later finds it on disk
    assert ask(make("float32"), "all")[1] == 0  # KV rounded otherwise is not taken


def test_an_adapter_unloaded_while_a_request_runs_on_it_serves_that_request_to_its_end(tiny_llama, adapters, llm):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256,
                                    lora_modules=f"all={adapters['all']}"))
    params = SamplingParams(**{**vars(GREEDY), "lora_name": "all"})
    request = engine.add_request(PROMPTS[1], params)
    for _ in range(3):
        engine.step()
    engine.unload_lora("all")
    with pytest.raises(ParameterError, match="'all' is not loaded \\(loaded: none\\)"):
        engine.add_request(PROMPTS[0], params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert finished[request] == llm.generate([PROMPTS[1]], params)[0].token_ids


def test_lora_request_loads_the_adapter_as_vllm_takes_it(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, enable_lora=True)
    request = LoRARequest("mine", 1, str(adapters["some"]))
    outputs = llm.generate(PROMPTS[:2], GREEDY, lora_request=[request, None])
    assert outputs[0].token_ids == hf_greedy(peft_model(tiny_llama, adapters["some"]), PROMPTS[0], 24)
    assert outputs[1].token_ids == hf_greedy(peft_model(tiny_llama), PROMPTS[1], 24)
    streamed = list(llm.stream(PROMPTS[0], GREEDY, lora_request=request))[-1]
    assert streamed.token_ids == outputs[0].token_ids
    with pytest.raises(KvstrataError, match="already loaded from"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("mine", 2, str(adapters["all"])))


def test_beam_search_scores_beams_on_the_adapter(llm, tiny_llama, adapters):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    on_adapter = llm.beam_search(PROMPTS[1], params, lora_request=LoRARequest("all", 1, str(adapters["all"])))[0]
    with torch.inference_mode():
        reference = peft_model(tiny_llama, adapters["all"]).generate(
            torch.tensor([PROMPTS[1]]), num_beams=3, num_return_sequences=3, max_new_tokens=6, do_sample=False,
            early_stopping=False, pad_token_id=0, eos_token_id=None)
    assert [list(beam.token_ids) for beam in on_adapter.sequences] == [row[len(PROMPTS[1]):].tolist()
                                                                      for row in reference]


def test_speculative_decoding_on_an_adapter_keeps_its_greedy_output(tiny_llama, adapters, llm):
    speculating = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, num_speculative_tokens=3,
                      lora_modules=f"all={adapters['all']}")
    params = SamplingParams(**{**vars(GREEDY), "lora_name": "all"})
    repeating = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    assert ([o.token_ids for o in speculating.generate([*PROMPTS, repeating], params)]
            == [o.token_ids for o in llm.generate([*PROMPTS, repeating], params)])


@pytest.mark.usefixtures("block_products_alike_for_any_rows")
def test_block_weights_give_a_request_on_an_adapter_its_output_whatever_shares_its_steps(tiny_gguf_style, tmp_path):
    """On GGUF blocks a step without adapter rows runs the compiled whole-model decode and one with them the
    layers as modules, whose int8 activations would turn a float32 product's rounding (which moves with the rows
    it is computed with) into other greedy tokens: with float64 products (the default) each request's output is the
    same alone, beside base requests, and among five others on its adapter. (The block products stay on the int8
    dot products for every number of rows, as on a CPU with AVX-512 VNNI.)"""
    adapter = write_random_adapter(tmp_path / "a", ModelConfig.from_checkpoint(tiny_gguf_style), rank=8, seed=3,
                                   std=0.2)
    llm = LLM(str(tiny_gguf_style), kv_cache_memory="8MiB", max_model_len=256, lora_modules=f"a={adapter}")
    on_adapter = SamplingParams(**{**vars(GREEDY), "lora_name": "a"})
    prompts = [*PROMPTS, *[torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                           for n in (12, 33, 50)]]
    alone = [llm.generate([p], on_adapter)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, on_adapter)] == alone
    beside_base = llm.generate([prompts[0], prompts[0]], [GREEDY, on_adapter])
    on_base = llm.generate(prompts[0], GREEDY)[0].token_ids
    assert beside_base[1].token_ids == alone[0] != beside_base[0].token_ids == on_base


def test_unknown_or_disabled_adapters_are_refused_by_name(llm, tiny_llama):
    with pytest.raises(ParameterError, match="'nope' is not loaded \\(loaded: all, some\\)"):
        llm.generate(PROMPTS[0], SamplingParams(lora_name="nope"))
    plain = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB"))
    with pytest.raises(ParameterError, match="not enabled"):
        plain.add_request(PROMPTS[0], SamplingParams(lora_name="all"))
    with pytest.raises(KvstrataError, match="not enabled"):
        plain.load_lora("x", "/nowhere")


@pytest.mark.parametrize("options, message", [
    ({"lora_modules": "a"}, "'a' is not NAME=PATH"),
    ({"lora_modules": "a=/x,a=/y"}, "names an adapter twice"),
    ({"enable_lora": True, "lora_dtype": "float16"}, "lora_dtype 'float16' is not one of float64, float32"),
    ({"enable_lora": True, "compile": True}, "LoRA adapters need no compile"),
    ({"enable_lora": True, "kv_offload": "infinigen"}, "kv_offload none, full or h2o"),
])
def test_engine_options_that_cannot_run_adapters_are_refused(options, message):
    with pytest.raises(KvstrataError, match=message):
        EngineConfig(**options)


def test_opt_models_refuse_adapters(tiny_opt):
    with pytest.raises(KvstrataError, match="not 'opt'"):
        LLMEngine(EngineConfig(model=str(tiny_opt), kv_cache_memory="8MiB", enable_lora=True))


def _broken(source, directory, tensors=None, settings=None):
    directory.mkdir()
    weights = load_file(str(source / WEIGHT_FILE))
    save_file(tensors(weights) if tensors else weights, str(directory / WEIGHT_FILE))
    config = json.loads((source / CONFIG_FILE).read_text())
    (directory / CONFIG_FILE).write_text(json.dumps(settings(config) if settings else config))
    return directory


def _first_a(weights):
    return next(name for name in weights if name.endswith("lora_A.weight"))


def _first_b(weights):
    return _first_a(weights).replace("lora_A", "lora_B")


@pytest.mark.parametrize("breakage, message", [
    (lambda d: (d / CONFIG_FILE).unlink(), f"no {CONFIG_FILE}"),
    (lambda d: (d / WEIGHT_FILE).write_bytes(b"not safetensors"), "its weights are not readable"),
    (lambda d: (d / CONFIG_FILE).write_text("{"), "not readable JSON"),
    (lambda d: ((d / WEIGHT_FILE).unlink(), (d / PICKLED_WEIGHT_FILE).write_bytes(b"garbage")),
     "its weights are not readable"),
])
def test_missing_or_corrupt_adapter_files_are_refused(llm, adapters, tmp_path, breakage, message):
    broken = _broken(adapters["all"], tmp_path / "broken")
    breakage(broken)
    with pytest.raises(KvstrataError, match=message):
        llm.engine.load_lora("broken", str(broken))
    assert "broken" not in llm.engine.lora.adapters


def test_a_path_that_cannot_be_a_directory_is_refused(llm, tmp_path):
    with pytest.raises(KvstrataError, match="cannot be read: embedded null byte"):
        llm.engine.load_lora("nul", "/tmp/a\x00b")
    with pytest.raises(KvstrataError, match="not readable \\(OSError"):  # a name longer than the file system takes
        llm.engine.load_lora("long", str(tmp_path / ("x" * 300)))


def test_a_pickle_of_anything_but_named_dense_tensors_is_refused(llm, adapters, tmp_path):
    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / CONFIG_FILE).write_text((adapters["some"] / CONFIG_FILE).read_text())
    torch.save({0: torch.zeros(2, 2)}, directory / PICKLED_WEIGHT_FILE)
    with pytest.raises(KvstrataError, match="not hold a dict of names to dense tensors"):
        llm.engine.load_lora("pickled", str(directory))


def test_a_name_comes_back_only_for_the_weights_it_stood_for(tiny_llama, adapters):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", enable_lora=True))
    engine.load_lora("x", str(adapters["all"]))
    engine.unload_lora("x")
    with pytest.raises(KvstrataError, match="'x' stood for other weights before"):
        engine.load_lora("x", str(adapters["some"]))
    assert engine.load_lora("x", str(adapters["all"])).name == "x"


def test_engines_on_the_same_weights_share_their_lora_layers(tiny_llama, adapters):
    """A calibration twin or a benchmark's second engine is built on the first one's weights."""
    first = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB",
                                   lora_modules=f"all={adapters['all']}"))
    second = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", num_speculative_tokens=2,
                                    lora_modules=f"some={adapters['some']}"), first.loaded)
    assert second.lora is first.lora and set(second.lora.adapters) == {"all", "some"}
    with pytest.raises(KvstrataError, match="with lora_dtype float64, not float32"):
        LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", enable_lora=True,
                               lora_dtype="float32"), first.loaded)


@pytest.mark.parametrize("tensors, settings, message", [
    (lambda w: {**w, _first_a(w): w[_first_a(w)][:, :10].contiguous()}, None, "do not fit the model"),
    (lambda w: {k: v for k, v in w.items() if k != _first_a(w)}, None, "has lora_B without lora_A"),
    (lambda w: {**w, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 320)}, None,
     "embed_tokens.lora_A.weight' is not a LoRA update"),
    (lambda w: {k.replace("layers.2.", "layers.9."): v for k, v in w.items()}, None, "is for layer 9"),
    (lambda w: {**w, _first_a(w): w[_first_a(w)] * float("nan")}, None, "not finite"),
    (None, lambda c: {**c, "use_dora": True}, "use_dora"),
    (None, lambda c: {**c, "bias": "all"}, "bias 'all'"),
    (None, lambda c: {**c, "lora_alpha": "big"}, "lora_alpha 'big' is not a number"),
    (None, lambda c: {**c, "use_rslora": "false"}, "use_rslora 'false' is not true or false"),
    (None, lambda c: {**c, "lora_bias": True}, "lora_bias"),
    (lambda w: {**w, _first_a(w).replace(".lora_A.", ".lora_A.default."): w[_first_a(w)].clone()}, None,
     "has two lora_A tensors"),
    (lambda w: {k.replace("mlp.gate_proj", "self_attn.gate_proj"): v for k, v in w.items()}, None,
     "self_attn.gate_proj.lora_A.weight' is not a LoRA update"),
    (lambda w: {**w, _first_a(w): w[_first_a(w)][:0].contiguous(),
                _first_b(w): w[_first_b(w)][:, :0].contiguous()}, None, "r >= 1"),
])
def test_adapters_that_do_not_fit_the_model_are_refused_naming_the_fault(llm, adapters, tmp_path, tensors, settings,
                                                                         message):
    broken = _broken(adapters["all"], tmp_path / "broken", tensors, settings)
    with pytest.raises(KvstrataError, match=message):
        llm.engine.load_lora("broken", str(broken))


def test_an_adapter_saved_as_pytorch_pickle_is_read_as_its_safetensors_twin(llm, adapters, tmp_path):
    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / CONFIG_FILE).write_text((adapters["some"] / CONFIG_FILE).read_text())
    torch.save(load_file(str(adapters["some"] / WEIGHT_FILE)), directory / PICKLED_WEIGHT_FILE)
    llm.engine.load_lora("pickled", str(directory))
    on = {name: SamplingParams(**{**vars(GREEDY), "lora_name": name}) for name in ("pickled", "some")}
    assert llm.generate(PROMPTS[1], on["pickled"])[0].token_ids == llm.generate(PROMPTS[1], on["some"])[0].token_ids
    llm.engine.unload_lora("pickled")


def test_the_server_serves_each_adapter_as_a_model(tiny_llama, adapters):
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    with running_server(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, lora_modules=modules) as (url, _):
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [("test-model", None), ("all", "test-model"),
                                                                 ("some", "test-model")]
        assert httpx.get(f"{url}/v1/models/some").json()["root"] == str(adapters["some"])
        texts = {}
        for model in ("test-model", "all"):
            body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == model
            texts[model] = reply.json()["choices"][0]["text"]
        chat = {"model": "some", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()["model"] == "some"
        unknown = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": "Hi"}, timeout=60)
        assert unknown.status_code == 404 and "'all', 'some'" in unknown.json()["error"]["message"]
    offline = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, lora_modules=modules)
    expected = offline.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                             lora_name="all"))[0].text
    assert texts["all"] == expected != texts["test-model"]


def test_metrics_name_the_adapters_of_running_and_waiting_requests(tiny_llama, adapters):
    from kvstrata.server.metrics import ServerMetrics

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, max_num_seqs=2,
                                    lora_modules=",".join(f"{name}={path}" for name, path in adapters.items())))
    for name in ("some", None, "all"):  # two run, the third waits
        engine.add_request(PROMPTS[0], SamplingParams(**{**vars(GREEDY), "lora_name": name}))
    engine.step()
    metrics = ServerMetrics("m", engine)
    metrics.observe_step(engine)
    assert ('kvstrata:lora_requests_info{max_lora="2",running_lora_adapters="some",waiting_lora_adapters="all"}'
            in metrics.render().decode())
    while engine.has_unfinished_requests():
        engine.step()
    metrics.observe_step(engine)
    page = metrics.render().decode()
    assert 'kvstrata:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in page
    assert page.count("kvstrata:lora_requests_info{") == 1  # the earlier reading is gone
    assert "lora_requests_info" not in ServerMetrics("m", LLMEngine(EngineConfig(
        model=str(tiny_llama), kv_cache_memory="8MiB"))).render().decode()


def test_an_adapter_may_not_take_the_served_models_name(tiny_llama, adapters):
    with pytest.raises(KvstrataError, match="is the served model's name"), \
            running_server(str(tiny_llama), kv_cache_memory="8MiB", lora_modules=f"test-model={adapters['all']}"):
        pass


def test_adapters_loaded_and_unloaded_by_request_where_the_server_allows_it(tiny_llama, adapters, tmp_path):
    options = ServerOptions(allow_runtime_lora_updating=True)
    with running_server(str(tiny_llama), server_options=options, kv_cache_memory="8MiB", max_model_len=256,
                        enable_lora=True) as (url, _):
        def post(path, body):
            return httpx.post(f"{url}{path}", json=body, timeout=60)

        completion = {"model": "late", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert post("/v1/completions", completion).status_code == 404
        loaded = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["all"])})
        assert loaded.status_code == 200 and "'late'" in loaded.text
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["test-model", "late"]
        reply = post("/v1/completions", completion)
        assert reply.status_code == 200 and reply.json()["model"] == "late"
        again = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["some"])})
        assert again.status_code == 400 and "taken" in again.json()["error"]["message"]
        missing = post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(tmp_path / "nowhere")})
        assert missing.status_code == 400 and "no adapter_config.json" in missing.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
        assert post("/v1/completions", completion).status_code == 404
        assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    with running_server(str(tiny_llama), kv_cache_memory="8MiB", enable_lora=True) as (url, _):
        refused = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}, timeout=60)
        assert refused.status_code == 404  # not offered without --allow-runtime-lora-updating
    expected = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, lora_modules=f"all={adapters['all']}")
    assert reply.json()["choices"][0]["text"] == expected.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, lora_name="all"))[0].text


@pytest.mark.parametrize("name", ["tiny_phi3", "tiny_phi35", "tiny_phi4_mini"])
def test_a_phi3_adapter_on_its_fused_projections_gives_what_peft_gives(name, request, tmp_path):
    """Phi-3's checkpoints fuse q/k/v and gate/up, and its adapters target those fused modules: each is one part
    whose update adds to every row of the product. Under LongRoPE (Phi-3.5) the update's query rows carry the
    attention factor, and under a RoPE over part of each head (Phi-4-mini) its q and k rows take the model's channel
    order, as the model's own do (served up to the 64 pretrained positions: the short factors)."""
    checkpoint = request.getfixturevalue(name)
    base = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    adapter = save_peft_adapter(base, tmp_path / "phi3", seed=4, r=4, lora_alpha=8,
                                target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    llm = LLM(str(checkpoint), kv_cache_memory="8MiB", max_model_len=64, lora_modules=f"fused={adapter}")
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=1, prompt_logprobs=3, lora_name="fused")
    ours = [p.logprob for p in llm.generate([prompt], params)[0].prompt_logprobs[1:]]
    log_probs = hf_logits(peft_reference(base, adapter), prompt).log_softmax(-1)
    reference = [log_probs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    base_only = [p.logprob for p in llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
                 .prompt_logprobs[1:]]
    assert torch.allclose(torch.tensor(ours), torch.tensor(reference), atol=1e-4)
    assert not torch.allclose(torch.tensor(ours), torch.tensor(base_only), atol=1e-2)  # the update is felt
