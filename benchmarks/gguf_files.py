"""GGUF files laid out as llama.cpp's converter writes them, for the figures and tests of architectures no model
of which ships with the project (nothing is downloaded): Llama (q and k rows reordered for llama.cpp's RoPE, Llama
3.1's frequency scaling as a factor per frequency), Qwen2 (q/k/v biases), Qwen3 (per-head norms, the head width
as `key_length`) and Phi-3 (q/k/v in one product, gate and up in another, its sliding window, LongRoPE's
factors, Phi-4-mini's RoPE over part of each head).

    .venv/bin/python -m benchmarks.gguf_files --out /tmp/qwen3-0.6b-random.gguf

writes a model of Qwen3-0.6B's shape (28 layers, 16 query and 8 KV heads of 128, 151,936 tokens) with random
weights, its embeddings and products as Q8_0 blocks as Qwen's own GGUF files of that size ship, and a byte-level
tokenizer of the first 4,096 tokens trained on Emma (the rest of the vocabulary unused, as Qwen pads its own), for
`kvstrata bench decode --model FILE` (the decode speed of the architecture's layers; its text means nothing).
`--shape phi3-mini` writes Phi-3-mini-4k's shape instead (32 layers of 32 heads of 96, each its own KV head,
32,064 tokens, a sliding window of 2,047), its q/k/v and gate/up fused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvstrata.data import EMMA
from kvstrata.model.gguf_convert import (
    ARCHITECTURE_LAYER_TENSORS,
    GGUF_SAMPLING,
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    LONG_ROPE_FACTORS,
    ROPE_FACTORS,
)

# Hugging Face's names -> llama.cpp's: the converter's maps turned around (a layer's tensor after "model.layers.N."
# and "blk.N."; the RoPE factors under the key the converter takes them out as)
LAYER_NAMES = {hf: gguf for tensors in (LAYER_TENSORS, *ARCHITECTURE_LAYER_TENSORS.values())
               for gguf, hf in tensors.items()}
GLOBAL_NAMES = {hf: gguf for gguf, hf in GLOBAL_TENSORS.items()}
SAMPLING_KEYS = {hf: gguf for gguf, hf in GGUF_SAMPLING.items()}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # ChatML, as Qwen's
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_0_6B = {  # Qwen3-0.6B's config.json, the fields a GGUF file carries
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
}

PHI3_MINI = {  # Phi-3-mini-4k-instruct's config.json, the fields a GGUF file carries
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 96, "vocab_size": 32064,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "sliding_window": 2047,
}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "phi3-mini": PHI3_MINI}


def byte_level_tokenizer(vocab_size: int, text: str) -> Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer (Qwen's kind) of `vocab_size` tokens trained on `text`, with Qwen's
    chat special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


@dataclass(frozen=True)
class RawBlocks:
    """A tensor already in GGUF blocks of `kind`: the gguf package writes K-quant blocks but cannot make them."""

    kind: str
    data: np.ndarray  # [rows, row bytes] uint8


# K-quant super-blocks of 256 values: their bytes, and where their float16 scales lie (d and dmin; d)
K_QUANT_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}
# roughly llama.cpp's "Q4_K_M" mix: Q6_K for v, the down products, the embeddings and the head, Q4_K elsewhere
Q4_K_M_SIX_BIT = ("self_attn.v_proj.weight", "mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight")


def random_k_blocks(kind: str, rows: int, columns: int, gen: np.random.Generator) -> RawBlocks:
    """Random rows of Q4_K or Q6_K blocks: any bytes are valid blocks once their float16 scales are finite, set here
    so that the values come near a trained model's (|w| up to about 0.03)."""
    block_bytes, scale_places = K_QUANT_BLOCKS[kind]
    data = gen.integers(0, 256, size=(rows, columns // 256 * block_bytes), dtype=np.uint8)
    blocks = data.reshape(-1, block_bytes)
    largest_code_product = 63 * 15 if kind == "Q4_K" else 127 * 32  # scale x code at their largest
    scale = np.full(len(blocks), 0.03 / largest_code_product, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for place in scale_places:
        blocks[:, place : place + 2] = scale
    return RawBlocks(kind, data)


def as_q4_k_m(state: dict[str, torch.Tensor], gen: np.random.Generator) -> dict:
    """`state` with its embeddings and products replaced by random K-quant blocks of their shapes, in the mix of a
    "Q4_K_M" file (values random, not `state`'s)."""
    return {name: random_k_blocks("Q6_K" if name.endswith(Q4_K_M_SIX_BIT) else "Q4_K", *tensor.shape, gen)
            if tensor.dim() == 2 else tensor for name, tensor in state.items()}


def _llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A llama model's q or k rows in llama.cpp's order: each head's two halves interleaved, for its RoPE kernel."""
    rows, columns = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def _rope_factors(config: dict) -> torch.Tensor | None:
    """Llama 3.1's scaling (config's rope_scaling) as llama.cpp ships it: what divides each plain RoPE frequency."""
    from kvstrata.model.config import ModelConfig
    from kvstrata.model.rotary import rope_inverse_frequencies

    model = ModelConfig.from_hf_dict(config)
    if model.rope_scaling is None:
        return None
    plain = rope_inverse_frequencies(dataclasses.replace(model, rope_scaling=None))
    return plain / rope_inverse_frequencies(model)


def write_gguf(config: dict, state: dict[str, torch.Tensor], tokenizer: Tokenizer, path: Path,
               product_type: str = "Q8_0", types: dict[str, str] | None = None,
               sampling: dict[str, float] | None = None) -> Path:
    """`state` (Hugging Face's tensor names) of a model of `config` (its config.json's fields) as a GGUF file: the
    embeddings and products in `product_type` blocks (or as `types` names them by llama.cpp's name within a layer,
    e.g. {"attn_v.weight": "Q5_0"}, as a "Q4_K_M" file mixes them), the norms and biases float32; `tokenizer`'s
    vocabulary and merges, the vocabulary padded with unused tokens up to the model's, a ChatML chat template, and
    the `sampling` settings of a generation_config.json (transformers' names) under llama.cpp's keys."""
    import gguf
    from gguf.quants import quantize

    arch = config["model_type"]
    state = dict(state)
    if arch == "llama":
        for name, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
            for key in [k for k in state if k.endswith(f"self_attn.{name}.weight")]:
                state[key] = _llama_cpp_rows(state[key], heads)
        factors = _rope_factors(config)
        if factors is not None:
            state[ROPE_FACTORS] = factors
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    if arch == "phi3" and config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":  # as llama.cpp writes Phi-3.5's: factors as tensors, the rest as keys
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
        for tensor_name, setting in LONG_ROPE_FACTORS.items():
            state[GLOBAL_TENSORS[tensor_name]] = torch.tensor(rope[setting])
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    unused = config["vocab_size"] - len(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    writer.add_token_list(vocab + [f"<|unused_{i}|>" for i in range(unused)])
    writer.add_token_types([gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                            for token in vocab] + [gguf.TokenType.UNUSED] * unused)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in merges])
    writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    writer.add_bos_token_id(tokenizer.token_to_id("<|endoftext|>"))
    writer.add_pad_token_id(tokenizer.token_to_id("<|endoftext|>"))  # else transformers takes Phi-3's 32,000
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in (sampling or {}).items():
        (writer.add_int32 if name == "top_k" else writer.add_float32)(SAMPLING_KEYS[name], value)
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            layer, short = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[short]}"
        else:
            gguf_name = GLOBAL_NAMES[name]
        if isinstance(tensor, RawBlocks):
            writer.add_tensor(gguf_name, tensor.data, raw_dtype=gguf.GGMLQuantizationType[tensor.kind])
            continue
        values = tensor.float().numpy()
        quant = gguf.GGMLQuantizationType[(types or {}).get(gguf_name.split(".", 2)[-1], product_type)]
        if values.ndim == 2:
            writer.add_tensor(gguf_name, quantize(values, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a Qwen3 or Phi-3 model of `config` (norms near 1, products of a trained model's scale;
    Phi-3's q/k/v and gate/up fused, without Qwen3's head norms)."""
    gen = np.random.default_rng(seed)
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inner = config["head_dim"], config["intermediate_size"]

    def normal(*shape, scale=0.02):
        return torch.from_numpy(gen.standard_normal(shape, dtype=np.float32) * scale)

    state = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
             "model.norm.weight": torch.ones(hidden)}
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = normal(config["vocab_size"], hidden)
    phi3 = config["model_type"] == "phi3"
    shapes = {"self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv_heads * head_dim,
              hidden), "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
              "self_attn.o_proj.weight": (hidden, heads * head_dim), "mlp.gate_proj.weight": (inner, hidden),
              "mlp.up_proj.weight": (inner, hidden), "mlp.down_proj.weight": (hidden, inner)}
    norms = {"input_layernorm": hidden, "post_attention_layernorm": hidden}
    if not phi3:
        norms.update({"self_attn.q_norm": head_dim, "self_attn.k_norm": head_dim})
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        products = {name: normal(*shape) for name, shape in shapes.items()}
        if phi3:
            products["self_attn.qkv_proj.weight"] = torch.cat([products.pop(f"self_attn.{p}_proj.weight")
                                                               for p in "qkv"])
            products["mlp.gate_up_proj.weight"] = torch.cat([products.pop(f"mlp.{p}_proj.weight")
                                                             for p in ("gate", "up")])
        state.update({prefix + name: weight for name, weight in products.items()})
        for norm, size in norms.items():
            state[f"{prefix}{norm}.weight"] = 1.0 + normal(size, scale=0.1)
    return state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    parser.add_argument("--product-type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_1", "Q4_K_M"],
                        help="the embeddings' and products' blocks; Q4_K_M: random Q4_K and Q6_K blocks in that mix")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES), help="the model's architecture and size")
    args = parser.parse_args(argv)
    config = SHAPES[args.shape]
    tokenizer = byte_level_tokenizer(4096, EMMA.read_text())
    state = random_state(config)
    if args.product_type == "Q4_K_M":
        state = as_q4_k_m(state, np.random.default_rng(1))
    write_gguf(config, state, tokenizer, args.out, "Q8_0" if args.product_type == "Q4_K_M" else args.product_type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
