"""Model discovery and the converted-weights cache."""

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.model import loader
from kvstrata.model.config import ModelConfig


@pytest.mark.real_model
def test_default_model_converts_once_then_loads_from_cache(monkeypatch):
    path = loader.default_model_path()
    assert path.suffix == ".gguf" and "SmolLM2" in path.name
    first = loader.converted_checkpoint(path)
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    loaded = loader.load_model(None, torch.device("cpu"), torch.float32, "fp32")
    assert loaded.checkpoint_dir == first
    assert loaded.config.num_layers == 30 and loaded.config.num_kv_heads == 3 and loaded.config.head_dim == 64
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight  # tied, stored once


def test_bfloat16_weights_and_cache_generate(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB")
    assert all(p.dtype == torch.bfloat16 for p in llm.engine.loaded.model.parameters())
    assert llm.engine.kv_cache.k.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


def test_generation_config_adds_end_tokens(tiny_llama, tmp_path):
    """An instruct model's turn may end with a token only generation_config.json names: generation stops there."""
    import json
    import shutil

    prompt = [5, 6, 7]
    free = LLM(str(tiny_llama), kv_cache_memory="8MiB").generate([prompt], SamplingParams(max_tokens=6, temperature=0))
    assert free[0].finish_reason == "length"  # config.json's end token (2) does not come
    first = free[0].token_ids[0]
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "checkpoint")
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, first]}))
    assert ModelConfig.from_checkpoint(checkpoint).eos_token_id == [2, first]
    out = LLM(str(checkpoint), kv_cache_memory="8MiB").generate([prompt], SamplingParams(max_tokens=6, temperature=0))
    assert out[0].token_ids == [first] and out[0].finish_reason == "stop"
    (checkpoint / "generation_config.json").write_text("[2]")
    with pytest.raises(KvstrataError, match="generation_config.json is not a JSON object"):
        ModelConfig.from_checkpoint(checkpoint)
