"""GGUF files of Qwen2, Qwen3 and Phi-3 (llama.cpp's layout: q and k rows as they are, Qwen2's q/k/v biases, Qwen3's
per-head norms and a head width apart from hidden / heads, Phi-3's fused products, sliding window and LongRoPE,
Phi-4-mini's RoPE over part of each head) and of Llama 3.1 (its RoPE scaling as a factor per frequency) convert
into checkpoints that compute what transformers computes on the same weights, with the file's tokenizer and chat
template; what the converter cannot read is refused by name."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from benchmarks.gguf_files import write_gguf
from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.model import block_linear
from kvstrata.model.loader import converted_checkpoint
from tests.helpers import hf_greedy, hf_logits, prefill_in_chunks
from tests.tiny_models import (
    byte_level_tokenizer,
    save_tiny_checkpoint,
    save_tiny_gguf,
    tiny_llama_config,
    tiny_phi3_config,
    tiny_phi35_config,
)


def round_trip(model, kind=GGMLQuantizationType.Q8_0) -> None:
    """The embeddings' and products' weights as the GGUF file holds them (`kind` blocks), read back to float."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), kind), kind)))


@pytest.fixture(scope="module")
def tiny_llama31(tmp_path_factory):
    """A tiny Llama with Llama 3.1's RoPE scaling, strong enough at its 512 positions to change the logits."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    return save_tiny_checkpoint(tiny_llama_config(rope_scaling=scaling), tmp_path_factory.mktemp("llama31"), seed=8)


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen3", "tiny_phi3", "tiny_llama31"])
def test_a_gguf_file_computes_what_transformers_computes(name, request, tmp_path):
    checkpoint = request.getfixturevalue(name)
    path = save_tiny_gguf(checkpoint, tmp_path / f"{name}.gguf")
    config = json.loads((converted_checkpoint(path) / "config.json").read_text())
    assert config["kvstrata_requantized_gguf_types"] == []
    assert config["model_type"] == ("llama" if name == "tiny_llama31" else name.removeprefix("tiny_"))
    assert ("kvstrata_rope_freq_factors" in config) == (name == "tiny_llama31")
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    round_trip(reference)
    llm = LLM(str(path), kv_cache_memory="8MiB", weights="fp32")
    ids = list(range(3, 100))
    ours, _ = prefill_in_chunks(llm.engine, ids, chunk=40)
    assert torch.allclose(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)
    out = llm.generate([ids[:20]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(reference, ids[:20], 12)



def test_a_file_of_types_without_a_kernel_runs_on_q8_0_blocks(tiny_qwen3, tmp_path):
    """Q5_0 products (as a Q5_K file's) are quantized again as Q8_0: the engine runs them on its 8-bit block kernels,
    within that rounding of the file's own values."""
    state = load_file(str(tiny_qwen3 / "model.safetensors"))
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    path = write_gguf(config, state, byte_level_tokenizer(), tmp_path / "q5.gguf", product_type="Q5_0")
    llm = LLM(str(path), kv_cache_memory="8MiB")
    assert json.loads((converted_checkpoint(path) / "config.json").read_text())[
        "kvstrata_requantized_gguf_types"] == ["Q5_0"]
    kind = "int8 blocks" if block_linear.kernel() else "int8 as two int4 planes"  # with the kernels or without
    assert llm.engine.loaded.weights_summary() == {kind: 9}  # 2 layers x (q/k/v, o, gate/up, down), the head
    ids = list(range(3, 60))
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3))
    unquantized = hf_logits(reference, ids)
    round_trip(reference, GGMLQuantizationType.Q5_0)
    file_values = hf_logits(reference, ids)
    ours, _ = prefill_in_chunks(LLM(str(path), kv_cache_memory="8MiB", weights="fp32").engine, ids, chunk=len(ids))
    # the file's own rounding (Q5_0's) moves the logits several times more than the engine's second one (Q8_0's)
    assert (ours - file_values).abs().mean() < (file_values - unquantized).abs().mean() / 3


def test_mixed_block_kinds_of_one_fused_product_stay_on_block_kernels(tiny_qwen3, tmp_path):
    """A "Q4_K_M" file's v is 6-bit beside its 4-bit q and k: the fused q/k/v runs as Q8_0 blocks, not as float32,
    and the compiled decode loop still takes the model."""
    state = load_file(str(tiny_qwen3 / "model.safetensors"))
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    path = write_gguf(config, state, byte_level_tokenizer(), tmp_path / "mixed.gguf", product_type="Q4_1",
                      types={"attn_v.weight": "Q5_0"})
    loaded = LLM(str(path), kv_cache_memory="8MiB").engine.loaded
    assert loaded.weight_kinds["layers.0.self_attn.qkv_proj"] == ("int8 blocks" if block_linear.kernel() else
                                                                 "int8 as two int4 planes")
    assert "float32" not in loaded.weights_summary()
    assert (loaded.model.native_decode is not None) == (block_linear.kernel() is not None)


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_phi3"])
def test_transformers_reads_the_written_file_as_the_engine_does(name, request, tmp_path):
    """An independent reading of llama.cpp's layout: transformers' own GGUF loader (it cannot read a Qwen3 head
    width apart from hidden / heads, so Qwen2; and Phi-3's fused products) gives the engine's logits on the file the
    tests write."""
    path = save_tiny_gguf(request.getfixturevalue(name), tmp_path / f"{name}.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    ids = list(range(3, 60))
    ours, _ = prefill_in_chunks(LLM(str(path), kv_cache_memory="8MiB", weights="fp32").engine, ids, chunk=len(ids))
    assert torch.allclose(ours, hf_logits(theirs, ids), atol=1e-4, rtol=0)


def test_the_file_s_tokenizer_and_chat_template_come_with_it(tiny_qwen3, tmp_path):
    llm = LLM(str(save_tiny_gguf(tiny_qwen3, tmp_path / "qwen3.gguf")), kv_cache_memory="8MiB")
    text = "Emma Woodhouse, handsome, clever, and rich"
    assert llm.tokenizer.encode(text) == byte_level_tokenizer().encode(text).ids
    assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    ends = [llm.tokenizer.encode(text, add_special_tokens=False) for text in ("<|im_end|>", "<|endoftext|>")]
    assert all(len(end) == 1 for end in ends)  # the file's eos field names the first; llama.cpp ends at both
    assert llm.engine.loaded.config.eos_token_ids == [ends[0][0], ends[1][0]]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def a_gguf_file(path, arch: str, tokens: tuple[str, ...] = (), **metadata):
    """A GGUF file of `arch` holding one tensor, the vocabulary `tokens` and `metadata` (GGUF key: a string or an
    unsigned integer)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if tokens:
        writer.add_token_list(list(tokens))
    for key, value in metadata.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_string)(key, value)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_generation_ends_at_the_file_s_end_tokens_and_the_turn_ends_llama_cpp_knows(tmp_path):
    """At the tokens the eos, eot and eom fields name, and at the turn ends llama.cpp knows by their text (a Llama 3.1
    file's eos is <|eot_id|>, and its model ends a built-in tool's call with <|eom_id|>)."""
    import gguf

    from kvstrata.model.gguf_convert import end_of_generation_ids

    tokens = ("<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "a", "<|stop|>")
    path = a_gguf_file(tmp_path / "ends.gguf", "llama", tokens, **{"tokenizer.ggml.eos_token_id": 3,
                                                                   "tokenizer.ggml.eom_token_id": 5})
    assert end_of_generation_ids(gguf.GGUFReader(str(path))) == [3, 5, 1, 2]


def test_a_phi3_file_s_sliding_window_is_read_as_transformers_reads_it(tmp_path):
    """Phi-3-mini-4k's config names a window of 2,047 tokens, and llama.cpp's converter writes it into the file:
    past it, each query reads only its window's keys (tests/test_sliding_window.py), as transformers does."""
    checkpoint = save_tiny_checkpoint(tiny_phi3_config(sliding_window=16), tmp_path / "phi3", seed=9)
    path = save_tiny_gguf(checkpoint, tmp_path / "phi3.gguf")
    config = json.loads((converted_checkpoint(path) / "config.json").read_text())
    assert (config["sliding_window"], config["use_sliding_window"]) == (16, True)
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    round_trip(reference)
    llm = LLM(str(path), kv_cache_memory="8MiB", weights="fp32")
    assert llm.engine.max_model_len == 512
    ids = list(range(3, 63))
    ours, _ = prefill_in_chunks(llm.engine, ids, chunk=20)
    assert torch.allclose(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)
    out = llm.generate([ids[:30]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(reference, ids[:30], 12)


@pytest.mark.parametrize("name", ["tiny_phi35", "tiny_phi4_mini"])
@pytest.mark.parametrize("max_model_len, tokens", [(None, 100), (64, 50)])
def test_long_rope_takes_the_factors_of_the_context_served(name, max_model_len, tokens, request, tmp_path):
    """Served past the 64 pretrained positions (the model's 512 by default), LongRoPE's long factors, as transformers
    takes them for a forward past 64 tokens; served up to them, the short ones; the attention factor either way; and
    with Phi-4-mini's RoPE over half of each head. Through the checkpoint and through its GGUF file (the factors
    and the channels turned as llama.cpp writes them)."""
    checkpoint = request.getfixturevalue(name)
    ids = list(range(3, 3 + tokens))
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    llm = LLM(str(checkpoint), kv_cache_memory="8MiB", max_model_len=max_model_len)
    ours, _ = prefill_in_chunks(llm.engine, ids, chunk=40)
    assert torch.allclose(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)
    other = LLM(str(checkpoint), kv_cache_memory="8MiB", max_model_len=100 if max_model_len else 64)
    assert not torch.allclose(ours[:50], prefill_in_chunks(other.engine, ids[:50], chunk=40)[0], atol=1e-2)
    path = save_tiny_gguf(checkpoint, tmp_path / f"{name}.gguf")
    round_trip(reference)
    from_file = LLM(str(path), kv_cache_memory="8MiB", max_model_len=max_model_len, weights="fp32")
    if max_model_len is not None:  # transformers' short factors: a forward within the pretrained positions
        out = from_file.generate([ids[:20]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == hf_greedy(reference, ids[:20], 12)  # decoded through the cache
    assert torch.allclose(prefill_in_chunks(from_file.engine, ids, chunk=40)[0], hf_logits(reference, ids), atol=1e-4,
                          rtol=0)


def test_a_model_loaded_for_another_context_s_factors_is_refused(tiny_phi35):
    from kvstrata.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.model.loader import load_model

    long = load_model(str(tiny_phi35), torch.device("cpu"), torch.float32)
    short = load_model(str(tiny_phi35), torch.device("cpu"), torch.float32, context_len=64)
    assert long.fingerprint != short.fingerprint  # KV of one never stands for the other's (prefix cache, KV store)
    with pytest.raises(KvstrataError, match="max_model_len 64 takes LongRoPE's short factors .* load it with "
                                            "context_len 64"):
        LLMEngine(EngineConfig(model=str(tiny_phi35), kv_cache_memory="8MiB", max_model_len=64), loaded=long)


def test_a_window_of_zero_is_none(tmp_path):
    """llama.cpp writes a Phi-3 file's sliding window as 0 where the model has none (Phi-4)."""
    import gguf

    from kvstrata.model.gguf_convert import gguf_config

    shape = {"phi3.embedding_length": 64, "phi3.attention.head_count": 4}
    for window, capped in ((0, False), (2047, True)):
        path = a_gguf_file(tmp_path / f"window{window}.gguf", "phi3", ("a", "b"), **shape,
                           **{"phi3.attention.sliding_window": window})
        config = gguf_config(gguf.GGUFReader(str(path)), has_output_weight=True)
        assert ("sliding_window" in config) == capped, window


def test_what_the_converter_cannot_read_is_refused_by_name(tmp_path):
    with pytest.raises(KvstrataError, match="architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3, "
                                            "phi3"):
        LLM(str(a_gguf_file(tmp_path / "gemma.gguf", "gemma2")), kv_cache_memory="8MiB")
    yarn = a_gguf_file(tmp_path / "yarn.gguf", "qwen3", **{"qwen3.rope.scaling.type": "yarn"})
    with pytest.raises(KvstrataError, match="GGUF rope scaling 'yarn' .* is not supported"):
        LLM(str(yarn), kv_cache_memory="8MiB")


def test_a_file_cut_short_is_refused_with_its_size(tiny_qwen3, tmp_path):
    whole = save_tiny_gguf(tiny_qwen3, tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(KvstrataError, match=f"not a readable GGUF file \\({len(whole) // 2} bytes; a file cut short"):
        LLM(str(cut), kv_cache_memory="8MiB")


def test_frequency_factors_of_the_wrong_count_are_refused():
    from kvstrata.model.config import ModelConfig

    raw = {**tiny_llama_config().to_dict(), "kvstrata_rope_freq_factors": [1.0, 2.0]}
    with pytest.raises(KvstrataError, match="kvstrata_rope_freq_factors must be 8 positive numbers"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("change, message", [
    ({"short_factor": [1.0] * 5}, "LongRoPE's short_factor must be 12 positive numbers"),
    ({"long_factor": [1.0] * 11 + [0.0]}, "LongRoPE's long_factor must be 12 positive numbers"),
    ({"original_max_position_embeddings": None}, "original_max_position_embeddings None must be a positive integer"),
])
def test_malformed_long_rope_settings_are_refused_by_name(change, message):
    from kvstrata.model.config import ModelConfig

    raw = tiny_phi35_config().to_dict()
    raw.pop("original_max_position_embeddings")
    raw["rope_parameters"] = {**raw["rope_parameters"], **change}
    with pytest.raises(KvstrataError, match=message):
        ModelConfig.from_hf_dict(raw)


def test_a_rope_over_an_odd_number_of_channels_is_refused():
    """RoPE turns channels in pairs: a share of a head's 24 channels that turns 3 of them is refused."""
    from kvstrata.model.config import ModelConfig

    raw = tiny_phi3_config().to_dict()
    raw["rope_parameters"] = {**raw["rope_parameters"], "partial_rotary_factor": 0.125}
    with pytest.raises(KvstrataError, match="partial_rotary_factor 0.125 turns 3 of a head's 24 channels"):
        ModelConfig.from_hf_dict(raw)
