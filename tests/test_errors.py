"""Bad input gets a clear error naming the value and what is allowed."""

import pytest

from kvstrata import LLM, EngineConfig, KvstrataError, SamplingParams
from kvstrata.config import parse_memory_size


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature must be in [0.0"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0.0}, "top_p must be in (0.0, 1.0]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"seed": True}, "seed"),
        ({"seed": 2**64}, "seed must be at most"),
        ({"logprobs": 50}, "logprobs must be at most 20"),
        ({"stop": [""]}, "stop must be"),
        ({"stop_token_ids": [-3]}, "stop_token_ids entry"),
    ],
)
def test_invalid_sampling_parameters(kwargs, words):
    with pytest.raises(KvstrataError) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"scheduler": "fifo"}, "scheduler 'fifo' is not one of sarathi, prefill-first, static"),
        ({"device": "tpu"}, "device 'tpu'"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer, got 0"),
        ({"int4_group_size": -16}, "int4_group_size must be a positive integer, got -16"),
        ({"kv_cache_memory": "lots"}, "memory size 'lots' is not understood"),
    ],
)
def test_invalid_engine_options(kwargs, words):
    with pytest.raises(KvstrataError) as err:
        EngineConfig(**kwargs)
    assert words in str(err.value)


def test_memory_sizes():
    assert parse_memory_size("2GiB") == 2 * 2**30
    assert parse_memory_size("512 MiB") == 512 * 2**20
    assert parse_memory_size("1.5GB") == 1_500_000_000
    assert parse_memory_size(4096) == 4096
    assert parse_memory_size("1TiB") == 2**40 and parse_memory_size("2TB") == 2 * 10**12
    with pytest.raises(KvstrataError, match="'512M' is not understood; .* KiB, MiB, GiB, TiB"):
        parse_memory_size("512M")  # the unit would be a guess: megabytes or mebibytes


def test_missing_or_wrong_model_path(tmp_path):
    with pytest.raises(KvstrataError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(KvstrataError, match="has no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(KvstrataError, match="is not a .gguf file"):
        LLM(str(tmp_path / "weights.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(KvstrataError, match="not a readable GGUF file"):
        LLM(str(tmp_path / "broken.gguf"))


def test_corrupt_weights(tmp_path, tiny_llama):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(KvstrataError, match="cannot read weights"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes())
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(KvstrataError, match="cannot read the tokenizer"):
        LLM(str(tmp_path))


def test_impossible_kv_budget_names_the_minimum(tiny_llama):
    # One token costs 2 (K,V) * 3 layers * 2 heads * 16 dims * 4 bytes = 768 bytes; 512 tokens need 384 KiB.
    with pytest.raises(KvstrataError) as err:
        LLM(str(tiny_llama), kv_cache_memory="100KiB")
    assert "give at least 393216 bytes" in str(err.value) and "max_model_len 512" in str(err.value)
    LLM(str(tiny_llama), kv_cache_memory=393216)  # exactly the minimum works


def test_prompt_longer_than_the_context(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=64)
    with pytest.raises(KvstrataError, match="the prompt has 64 tokens; the context allows at most 63"):
        llm.generate([[5] * 64])
    with pytest.raises(KvstrataError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(KvstrataError, match=r"token-id prompt must be a list of integers in \[0, 320\)"):
        llm.generate([[5, 999]])
    with pytest.raises(KvstrataError, match="exceeds the model's context of 512"):
        LLM(str(tiny_llama), max_model_len=4096)


def test_generation_stops_at_the_context_end(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=32)
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
