"""Tiny random-weight checkpoints built from transformers' own config classes, with a small tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvstrata.data import EMMA

VOCAB_SIZE = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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


# llama.cpp's names of a Qwen layer's tensors (GGUF "blk.N." + name), from Hugging Face's ("model.layers.N." + name)
GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}


def byte_level_tokenizer() -> Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer of VOCAB_SIZE tokens, Qwen's kind, with its chat special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([TRAINING_TEXT[:50_000]], trainer)
    return tokenizer


def save_tiny_gguf(checkpoint: Path, path: Path) -> Path:
    """A Qwen2 or Qwen3 `checkpoint`'s weights in a GGUF file as llama.cpp's converter writes them (q and k rows as
    they are; the products as Q8_0 blocks, the rest float32), with a byte-level tokenizer and a chat template in
    its metadata."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    tokenizer = byte_level_tokenizer()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    model = json.loads(tokenizer.to_str())["model"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token.startswith("<|") else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]])
    writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    writer.add_bos_token_id(tokenizer.token_to_id("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        if name.startswith("model.layers."):
            layer, short = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[short]}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        values = tensor.float().numpy()
        if values.ndim == 2 and gguf_name != "token_embd.weight":
            writer.add_tensor(gguf_name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
