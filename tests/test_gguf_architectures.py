"""Qwen2 and Qwen3 GGUF files (llama.cpp's layout: q and k rows as they are, Qwen2's q/k/v biases, Qwen3's per-head
norms and a head width apart from hidden / heads) convert into checkpoints that compute what transformers computes
on the same weights, with the file's tokenizer and chat template."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.model.loader import converted_checkpoint
from tests.helpers import hf_greedy, hf_logits, prefill_in_chunks
from tests.tiny_models import byte_level_tokenizer, save_tiny_gguf


def q8_0_round_trip(model) -> None:
    """The embeddings' and products' weights as the GGUF file holds them (Q8_0 blocks), read back to float."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                raw = quantize(param.numpy(), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)))


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen3"])
def test_a_qwen_gguf_file_computes_what_transformers_computes(name, request, tmp_path):
    checkpoint = request.getfixturevalue(name)
    path = save_tiny_gguf(checkpoint, tmp_path / f"{name}.gguf")
    config = json.loads((converted_checkpoint(path) / "config.json").read_text())
    assert config["model_type"] == name.removeprefix("tiny_") and config["kvstrata_dequantized_gguf_types"] == []
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    q8_0_round_trip(reference)
    llm = LLM(str(path), kv_cache_memory="8MiB", weights="fp32")
    ids = list(range(3, 100))
    ours, _ = prefill_in_chunks(llm.engine, ids, chunk=40)
    assert torch.allclose(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)
    out = llm.generate([ids[:20]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(reference, ids[:20], 12)


def test_the_file_s_tokenizer_and_chat_template_come_with_it(tiny_qwen3, tmp_path):
    llm = LLM(str(save_tiny_gguf(tiny_qwen3, tmp_path / "qwen3.gguf")), kv_cache_memory="8MiB")
    text = "Emma Woodhouse, handsome, clever, and rich"
    assert llm.tokenizer.encode(text) == byte_level_tokenizer().encode(text).ids
    assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    im_end = llm.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in llm.engine.outputs.eos_token_ids
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_an_architecture_the_converter_does_not_know_is_refused_by_name(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(KvstrataError, match="architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"):
        LLM(str(tmp_path / "phi.gguf"), kv_cache_memory="8MiB")
