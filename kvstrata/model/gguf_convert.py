"""Convert a GGUF file into a Hugging Face style checkpoint directory.

Architectures: llama (Llama, Mistral and SmolLM2 ship as it), qwen2, qwen3 and phi3 (Phi-3, Phi-3.5, Phi-4 and
Phi-4-mini: q/k/v and gate/up fused, as its checkpoints keep them; LongRoPE's factors into config.json; a RoPE over
part of each head; a sliding window in the metadata caps the context, as config.json's does). Q4_0, Q4_1, Q8_0
and Q4_K tensors keep their codes and per-group scales (`GroupQuantized`, stored as NAME.codes / NAME.scales /
NAME.offsets); the other quantized types (Q6_K and Q5_K beside Q4_K in a "Q4_K_M" file, Q5_0, the IQ types,
...), for which the block kernels have no reader, are dequantized by the `gguf` package and quantized again as Q8_0, 8-bit codes
per 32 values, finer than any of them (the error added is about half a Q8_0 step, a 254th of the group's largest
magnitude), and named in config.json (`kvstrata_requantized_gguf_types`); every `--weights` then reads those
values. Tensors are renamed; llama.cpp stores a llama model's q and k projections with rows interleaved for its
RoPE kernel, which is undone here (Qwen's it keeps as they are, for the rotation by halves). The tokenizer is
rebuilt from the GGUF metadata by transformers' converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kvstrata.errors import KvstrataError
from kvstrata.model.group_quantized import GroupQuantized, as_q8_0, from_gguf_blocks, from_q4_k_blocks
from kvstrata.model.quantized_checkpoint import save_checkpoint_tensors

KEPT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")  # read into GroupQuantized without loss

# GGUF's architecture name: transformers' class (config.json names it, as transformers' own checkpoints do)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM"}
# Llama 3.1's frequency scaling as llama.cpp ships it: a factor per RoPE frequency, which divides it (config.json
# carries them as this key)
ROPE_FACTORS = "kvstrata_rope_freq_factors"
LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2's
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's q, k and v in one product
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# where an architecture's tensor of one name holds something else: Phi-3's ffn_up is gate and up in one product
ARCHITECTURE_LAYER_TENSORS = {"phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"}}
# LongRoPE's factors (Phi-3's 128k-context models, Phi-3.5), for contexts up to the pretrained length and past it:
# config.json carries them as its rope_parameters' short_factor and long_factor, as transformers' checkpoints do
LONG_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FACTORS,
    **{name: name for name in LONG_ROPE_FACTORS},  # taken out of the weights into config.json (convert_gguf)
}
# Turn and text ends llama.cpp stops generating at wherever its vocabulary has them, beside the tokens the eos, eot
# and eom fields name: a file's eos field alone often misses one (Llama 3.1's names <|eot_id|>, and the model ends a
# call of a built-in tool with <|eom_id|>; Qwen's names <|im_end|>, and a plain text ends with <|endoftext|>).
# llama.cpp also stops at the fill-in-the-middle tokens it finds (<|file_sep|>, <reponame>, ...); they are left out,
# since kvstrata serves no fill-in-the-middle requests (a completion's `suffix` is refused).
END_OF_GENERATION_TEXTS = frozenset(("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>",
                                     "<|end|>", "<end_of_turn>", "<EOT>", "_<EOT>", "<end_of_utterance>"))
# The sampling settings llama.cpp's converter carries over from a model's generation_config.json, by the names
# transformers gives them
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _undo_rope_interleave(weight: torch.Tensor | GroupQuantized, num_heads: int):
    rows = weight.shape[0]
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    return weight.select_rows(order) if isinstance(weight, GroupQuantized) else weight[order].contiguous()


def gguf_config(reader, has_output_weight: bool) -> dict:
    """config.json's fields from the GGUF metadata (keys prefixed by the architecture's name)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise KvstrataError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    p = f"{arch}."
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):  # converted without it, the model would attend at the wrong angles
        raise KvstrataError(f"GGUF rope scaling {scaling!r} (e.g. YaRN's long context) is not supported; supported: "
                            f"none, Llama 3.1's frequency factors and LongRoPE's (Phi-3.5)")
    heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    head_dim = _field(reader, p + "attention.key_length", hidden // heads)
    rotated = _field(reader, p + "rope.dimension_count", head_dim)  # Phi-4-mini's RoPE turns 3/4 of each head
    window = _field(reader, p + "attention.sliding_window") or None  # llama.cpp writes 0 for none (Phi-4)
    return {
        "model_type": arch,
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, p + "feed_forward_length"),
        "num_hidden_layers": _field(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": _field(reader, p + "context_length", 2048),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output_weight,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": end_of_generation_ids(reader) or None,
        **({} if window is None else {"sliding_window": window, "use_sliding_window": True}),
        **({} if rotated == head_dim else {"partial_rotary_factor": rotated / head_dim}),
        **_long_rope_settings(reader, p),
    }


def _long_rope_settings(reader, p: str) -> dict:
    """config.json's LongRoPE settings where the file has its factors (convert_gguf adds them), else none."""
    if not any(tensor.name in LONG_ROPE_FACTORS for tensor in reader.tensors):
        return {}
    pretrained = _field(reader, p + "rope.scaling.original_context_length")
    return {"original_max_position_embeddings": pretrained,
            "rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": pretrained,
                                "attention_factor": _field(reader, p + "rope.scaling.attn_factor")}}


def end_of_generation_ids(reader) -> list[int]:
    """The tokens that end a generation: those the eos, eot and eom fields name (the eos first), then those of
    END_OF_GENERATION_TEXTS in the vocabulary."""
    named = [_field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    ends = [*named, *(token_id for token_id, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS)]
    return list(dict.fromkeys(token_id for token_id in ends if token_id is not None))


def _read_tensor(tensor) -> torch.Tensor | GroupQuantized:
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind == "Q4_K":
        return from_q4_k_blocks(tensor.data)
    if kind in KEPT_GGUF_TYPES:
        return from_gguf_blocks(tensor.data, kind)
    try:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError:
        raise KvstrataError(f"GGUF tensor {tensor.name!r} is of type {kind}, which the gguf package cannot "
                            f"read") from None
    values = torch.from_numpy(np.require(values, requirements=["C", "W"]))
    return as_q8_0(values) if _quantized(kind) and values.dim() == 2 else values


def _quantized(kind: str) -> bool:
    """A GGUF type of blocks of several values (Q5_K, IQ4_XS, ...), not one of plain numbers (F16, I32, ...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0] > 1


def gguf_state_dict(reader, config: dict) -> dict[str, torch.Tensor | GroupQuantized]:
    interleaved = config["model_type"] == "llama"  # q and k rows, for llama.cpp's RoPE
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
    layer_tensors = {**LAYER_TENSORS, **ARCHITECTURE_LAYER_TENSORS.get(config["model_type"], {})}
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in GLOBAL_TENSORS:
            state[GLOBAL_TENSORS[name]] = _read_tensor(tensor)
            continue
        block, layer, short = (*name.split(".", 2), None, None)[:3]  # blk.N.<layer_tensors' name>
        if block != "blk" or short not in layer_tensors:
            raise KvstrataError(f"unexpected tensor {name!r} in GGUF file")
        values = _read_tensor(tensor)
        if interleaved and short in heads:
            values = _undo_rope_interleave(values, heads[short])
        state[f"model.layers.{layer}.{layer_tensors[short]}"] = values
    return state


def requantized_types(reader) -> list[str]:
    """GGUF tensor types this converter quantizes again as Q8_0 (no kernel reads them as they are)."""
    kinds = {t.tensor_type.name for t in reader.tensors}
    return sorted(kind for kind in kinds if _quantized(kind) and kind not in KEPT_GGUF_TYPES)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import gguf
    from transformers import AutoTokenizer

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # the gguf package raises bare ValueErrors and struct errors
        size = Path(gguf_path).stat().st_size
        raise KvstrataError(f"{gguf_path} is not a readable GGUF file ({size} bytes; a file cut short by an "
                            f"interrupted download or copy fails so): {exc}") from exc
    names = {t.name for t in reader.tensors}
    config = gguf_config(reader, "output.weight" in names)
    config["kvstrata_requantized_gguf_types"] = requantized_types(reader)
    state = gguf_state_dict(reader, config)
    if ROPE_FACTORS in state:
        config[ROPE_FACTORS] = state.pop(ROPE_FACTORS).tolist()
    for tensor_name, setting in LONG_ROPE_FACTORS.items():
        if tensor_name in state:
            config["rope_parameters"][setting] = state.pop(tensor_name).tolist()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint_tensors(state, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    # float32 in the file: 0.6 reads 0.6000000238418579, so six significant digits are kept
    sampling = {name: float(f"{_field(reader, key):.6g}") for key, name in GGUF_SAMPLING.items()
                if key in reader.fields}
    if sampling:
        (out_dir / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
