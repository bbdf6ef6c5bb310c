"""vLLM's --generation-config auto: the sampling settings a request leaves unset take the values the model's
generation config recommends (a checkpoint's generation_config.json, a GGUF file's general.sampling keys); what a
request sets is its own; `vllm` keeps OpenAI's defaults."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from benchmarks.gguf_files import write_gguf
from kvstrata import LLM
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.model.loader import converted_checkpoint
from kvstrata.server.options import ServerOptions
from kvstrata.server.protocol import ChatCompletionRequest
from kvstrata.server.request_prep import RequestPreparer
from tests.tiny_models import byte_level_tokenizer

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def with_generation_config(tiny_llama, directory, generation: dict):
    model = shutil.copytree(tiny_llama, directory)
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


def sampled(engine: LLMEngine, **fields):
    """The sampling settings the server makes of a chat request with these fields."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, **fields})
    params = RequestPreparer(engine, ServerOptions()).prepare(body)[0][1]
    return {name: getattr(params, name) for name in (*RECOMMENDED, "min_p")}


def test_a_request_s_unset_settings_take_the_model_s_recommended_values(tiny_llama, tmp_path):
    model = with_generation_config(tiny_llama, tmp_path / "model", {"eos_token_id": 2, **RECOMMENDED,
                                                                    "do_sample": True})
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_memory="8MiB"))
    assert engine.sampling_defaults == RECOMMENDED
    assert sampled(engine) == {**RECOMMENDED, "min_p": 0.0}
    # what the request sets is its own: temperature 0 is greedy, top_k -1 is off
    assert sampled(engine, temperature=0, top_k=-1, min_p=0.1) == {**RECOMMENDED, "temperature": 0.0, "top_k": 0,
                                                                   "min_p": 0.1}
    offline = LLM(str(model), kv_cache_memory="8MiB").engine.default_sampling_params()
    assert (offline.temperature, offline.top_k) == (0.6, 20)  # LLM.generate without parameters
    openai_s = LLMEngine(EngineConfig(model=str(model), kv_cache_memory="8MiB", generation_config="vllm"))
    assert sampled(openai_s) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                                 "min_p": 0.0}


def test_a_gguf_file_s_sampling_keys_are_its_recommended_values(tiny_qwen3, tmp_path):
    state = load_file(str(tiny_qwen3 / "model.safetensors"))
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    path = write_gguf(config, state, byte_level_tokenizer(), tmp_path / "sampling.gguf", sampling=RECOMMENDED)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="8MiB"))
    assert engine.sampling_defaults == pytest.approx(RECOMMENDED)  # float32 in the file
    assert json.loads((converted_checkpoint(path) / "generation_config.json").read_text()).keys() == RECOMMENDED.keys()


def test_settings_that_cannot_be_used_are_refused_by_name(tiny_llama, tmp_path):
    unusable = with_generation_config(tiny_llama, tmp_path / "unusable", {"top_p": 0})
    with pytest.raises(KvstrataError, match="recommends sampling settings that cannot be used .*top_p must be in "
                                            ".*--generation-config vllm ignores them"):
        LLMEngine(EngineConfig(model=str(unusable), kv_cache_memory="8MiB"))
    ignored = LLMEngine(EngineConfig(model=str(unusable), kv_cache_memory="8MiB", generation_config="vllm"))
    assert ignored.sampling_defaults == {}
    off = with_generation_config(tiny_llama, tmp_path / "off", {"top_k": -1, "top_p": 0.9})  # -1: no top-k
    assert LLMEngine(EngineConfig(model=str(off), kv_cache_memory="8MiB")).sampling_defaults == {"top_k": 0,
                                                                                               "top_p": 0.9}
    malformed = with_generation_config(tiny_llama, tmp_path / "malformed", {"temperature": "hot"})
    with pytest.raises(KvstrataError, match="generation_config.json: temperature must be a number, got 'hot'"):
        LLMEngine(EngineConfig(model=str(malformed), kv_cache_memory="8MiB"))
