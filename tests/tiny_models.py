"""Tiny random-weight checkpoints built from transformers' own config classes, with a small tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchmarks.gguf_files import CHAT_TEMPLATE  # ChatML
from kvstrata.data import EMMA

VOCAB_SIZE = 320
TRAINING_TEXT = EMMA.read_text()[:200_000]


def write_tokenizer(directory: Path) -> None:
    """A SentencePiece-style BPE tokenizer of VOCAB_SIZE tokens (every token decodes to whole
    characters) with the special tokens chat needs."""
    tokenizer = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        limit_alphabet=100,
        initial_alphabet=list("0123456789"),  # pass keys in the needle evaluation are digits
        show_progress=False,
    )
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    settings = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 5000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    return LlamaConfig(**{**settings, **overrides})


def tiny_opt_config(**overrides):
    from transformers import OPTConfig

    settings = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "max_position_embeddings": 512, "word_embed_proj_dim": 64,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    return OPTConfig(**{**settings, **overrides})


def tiny_qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )


def tiny_qwen3_config():
    """Qwen3's per-head query and key norms, with a head width apart from hidden / heads as Qwen3's models have."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )


def tiny_phi3_config(**overrides):
    """Phi-3's fused q/k/v and gate/up products, every query head its own KV head, and a head width of 24, which
    is not a power of two (Phi-3-mini's is 96)."""
    from transformers import Phi3Config

    settings = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
    }
    return Phi3Config(**{**settings, **overrides})


def tiny_phi35_config():
    """Phi-3.5's LongRoPE: frequency factors for contexts up to 64 pretrained positions and others past them, to 512
    (an attention factor of sqrt(1 + ln 8 / ln 64))."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i / 4 for i in range(12)],
            "short_factor": [1.0 + i / 20 for i in range(12)]}
    return tiny_phi3_config(original_max_position_embeddings=64, rope_parameters=rope)


def tiny_phi4_mini_config():
    """Phi-4-mini's RoPE over part of each head (here half: 12 of 24 channels, 3/4 in the model), beside LongRoPE's
    factors (one per frequency turned) and grouped-query attention."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "long_factor": [1.0 + i / 2 for i in range(6)], "short_factor": [1.0 + i / 10 for i in range(6)]}
    return tiny_phi3_config(num_key_value_heads=2, original_max_position_embeddings=64, rope_parameters=rope)


def save_tiny_checkpoint(config, directory: Path, seed: int = 0) -> Path:
    """Random weights (scaled up so logits are far from ties) saved as a Hugging Face checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
            elif "bias" in name:
                param.normal_(0.0, 0.02)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    write_tokenizer(directory)
    return directory


def gguf_quantized(weight: torch.Tensor, type_name: str):
    """(GGUF's raw blocks, kvstrata's reading of them) of `weight` quantized by the gguf package."""
    import gguf
    from gguf.quants import quantize

    from kvstrata.model.group_quantized import from_gguf_blocks

    raw = quantize(weight.numpy(), gguf.GGMLQuantizationType[type_name])
    return raw, from_gguf_blocks(raw, type_name)


def save_gguf_style_copy(source: Path, directory: Path) -> Path:
    """`source`'s checkpoint with its linear layers as Q4_1 blocks and its embeddings and head as Q8_0, as a GGUF
    checkpoint converts."""
    import shutil

    from safetensors.torch import load_file

    from kvstrata.model.quantized_checkpoint import save_checkpoint_tensors

    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, directory / file.name)
    state = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if tensor.dim() == 2:
            kind = "Q8_0" if "embed" in name or "lm_head" in name else "Q4_1"
            state[name] = gguf_quantized(tensor, kind)[1]
        else:
            state[name] = tensor
    save_checkpoint_tensors(state, directory / "model.safetensors")
    return directory


def save_tiny_gguf(checkpoint: Path, path: Path) -> Path:
    """A Llama, Qwen2 or Qwen3 `checkpoint`'s weights in a GGUF file as llama.cpp's converter writes them (the
    embeddings and products as Q8_0 blocks), with a byte-level tokenizer of VOCAB_SIZE tokens and a chat template
    in its metadata."""
    from safetensors.torch import load_file

    from benchmarks.gguf_files import write_gguf

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(str(checkpoint / "model.safetensors"))
    return write_gguf(config, state, byte_level_tokenizer(), path)


def byte_level_tokenizer():
    """The tiny GGUF files' tokenizer: byte-level BPE, Qwen's kind, of VOCAB_SIZE tokens."""
    from benchmarks.gguf_files import byte_level_tokenizer

    return byte_level_tokenizer(VOCAB_SIZE, TRAINING_TEXT[:50_000])
