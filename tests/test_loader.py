"""Model discovery and the converted-weights cache."""

import pytest
import torch

from kvstrata.model import loader


@pytest.mark.real_model
def test_default_model_converts_once_then_loads_from_cache(monkeypatch):
    path = loader.default_model_path()
    assert path.suffix == ".gguf" and "SmolLM2" in path.name
    first = loader.converted_checkpoint(path)
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    loaded = loader.load_model(None, torch.device("cpu"), torch.float32)
    assert loaded.checkpoint_dir == first
    assert loaded.config.num_layers == 30 and loaded.config.num_kv_heads == 3 and loaded.config.head_dim == 64
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight  # tied, stored once


def test_dtype_option_casts_weights(tiny_llama):
    loaded = loader.load_model(str(tiny_llama), torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
