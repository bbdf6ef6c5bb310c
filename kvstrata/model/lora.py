"""LoRA adapters in PEFT's saved form (a directory with `adapter_config.json` and `adapter_model.safetensors`, or
an older `adapter_model.bin`), read for a Llama-family model: each targeted projection W gains the low-rank update
scaling * B A, with scaling = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA), as PEFT computes it.

The model fuses q, k and v into one product and gate and up into another (model/llama.py), so an adapter's
updates are grouped the same way: for a fused projection, the targeted parts' A matrices stacked ([sum of r, in]),
so that one product gives every part's x A.T, and each part's B apart, with the rows of the fused output it adds
to. Phi-3's adapters target the fused projections themselves (qkv_proj, gate_up_proj, as its checkpoints hold
them): such a module is one part whose B adds to every row.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvstrata.errors import KvstrataError
from kvstrata.model.config import ModelConfig
from kvstrata.model.rotary import as_the_layers_attend

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILE = "adapter_model.safetensors"
PICKLED_WEIGHT_FILE = "adapter_model.bin"  # PEFT's older form: read with torch.load(weights_only=True)
WHOLE = -1  # the place of a PEFT module that is the fused projection itself (Phi-3's qkv_proj and gate_up_proj)
# PEFT's module names: the block that holds each, and its fused projection in the model and place in it
PARTS = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
         "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
         "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
         "down_proj": ("mlp", "down_proj", 0), "qkv_proj": ("self_attn", "qkv_proj", WHOLE),
         "gate_up_proj": ("mlp", "gate_up_proj", WHOLE)}
_WEIGHT_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
# adapter_config.json settings whose effect is not a plain low-rank update of the projections
_REFUSED_SETTINGS = {
    "use_dora": "DoRA's magnitude vectors", "modules_to_save": "whole modules saved beside the update",
    "layer_replication": "repeated layers", "alpha_pattern": "per-module alphas", "lora_bias": "a bias on lora_B",
    "trainable_token_indices": "trained embedding rows", "use_qalora": "QA-LoRA's pooled inputs",
}


@dataclass
class PartUpdate:
    """One part of a fused projection: output[:, outputs] += (x @ a.T)[:, ranks] @ b.T."""

    outputs: slice  # of the fused projection's output
    ranks: slice  # of the stacked A's rows
    b: torch.Tensor  # [part's out_features, part's rank], scaling included


@dataclass
class FusedUpdate:
    a: torch.Tensor  # [sum of the parts' ranks, in_features]
    parts: list[PartUpdate]


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    digest: bytes  # of its weights and scaling: requests on other adapters never share its KV blocks
    updates: dict[tuple[int, str], FusedUpdate] = field(default_factory=dict)  # (layer, fused projection)

    @property
    def nbytes(self) -> int:
        """Memory its updates take (in --lora-dtype, beside the KV cache's budget)."""
        return sum(u.a.nbytes + sum(part.b.nbytes for part in u.parts) for u in self.updates.values())


def part_sizes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Output sizes of each fused projection's parts, in the order they are fused."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv_proj": (q, kv, kv), "o_proj": (config.hidden_size,),
            "gate_up_proj": (config.intermediate_size, config.intermediate_size), "down_proj": (config.hidden_size,)}


def part_rows(sizes: tuple[int, ...], index: int) -> slice:
    """The output rows of a fused projection (its parts' `sizes`) that part `index` (or WHOLE) adds to."""
    if index == WHOLE:
        return slice(0, sum(sizes))
    offset = sum(sizes[:index])
    return slice(offset, offset + sizes[index])


def input_sizes(config: ModelConfig) -> dict[str, int]:
    q = config.num_heads * config.head_dim
    return {"qkv_proj": config.hidden_size, "o_proj": q, "gate_up_proj": config.hidden_size,
            "down_proj": config.intermediate_size}


def load_lora_adapter(name: str, path: str | Path, config: ModelConfig, device: torch.device,
                      dtype: torch.dtype) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for a model of `config`, its updates kept in `dtype`; errors name the file,
    tensor or setting."""
    path = Path(path).expanduser()
    settings = _read_settings(path)
    tensors = _read_weights(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _WEIGHT_NAME.fullmatch(tensor_name)
        if match is None or PARTS.get(match.group(3), ("",))[0] != match.group(2):
            allowed = ", ".join(f"{parent}.{module}" for module, (parent, *_) in PARTS.items())
            raise KvstrataError(f"LoRA adapter {path}: tensor {tensor_name!r} is not a LoRA update of a decoder "
                                f"layer's projection ({allowed}); embeddings, the LM head and biases are not taken")
        layer, module, side = int(match.group(1)), match.group(3), match.group(4)
        if layer >= config.num_layers:
            raise KvstrataError(f"LoRA adapter {path}: tensor {tensor_name!r} is for layer {layer}; the model has "
                                f"{config.num_layers} layers")
        pair = pairs.setdefault((layer, module), {})
        if side in pair:
            raise KvstrataError(f"LoRA adapter {path}: layer {layer} {module} has two lora_{side} tensors (the "
                                f"second is {tensor_name!r})")
        pair[side] = tensor
    if not pairs:
        raise KvstrataError(f"LoRA adapter {path}: its weights file holds no LoRA tensors")
    parts = _checked_parts(path, pairs, config, settings)
    updates = {key: _fused(parts_of, part_sizes(config)[key[1]], device, dtype)
               for key, parts_of in _by_fused_projection(parts).items()}
    digest = hashlib.blake2b(digest_size=16)
    for (layer, module), (a, b) in sorted(parts.items()):
        digest.update(f"{layer}.{module}".encode())
        digest.update(a.numpy().tobytes())
        digest.update(b.numpy().tobytes())
    return LoRAAdapter(name, path, digest.digest(), updates)


def _read_settings(path: Path) -> dict:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise KvstrataError(f"LoRA adapter {path}: no {CONFIG_FILE} (a PEFT adapter directory holds it and "
                            f"{WEIGHT_FILE} or {PICKLED_WEIGHT_FILE})")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvstrataError(f"LoRA adapter {config_file}: not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise KvstrataError(f"LoRA adapter {config_file}: not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise KvstrataError(f"LoRA adapter {config_file}: peft_type {settings['peft_type']!r} is not LORA")
    for key, what in _REFUSED_SETTINGS.items():
        if settings.get(key):
            raise KvstrataError(f"LoRA adapter {config_file}: {key} ({what}) is not supported")
    if settings.get("bias", "none") != "none":
        raise KvstrataError(f"LoRA adapter {config_file}: bias {settings['bias']!r} (trained biases) is not "
                            f"supported; only 'none'")
    alpha = settings.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise KvstrataError(f"LoRA adapter {config_file}: lora_alpha {alpha!r} is not a number")
    if not isinstance(settings.get("use_rslora", False), bool):
        raise KvstrataError(f"LoRA adapter {config_file}: use_rslora {settings['use_rslora']!r} is not true or false")
    return settings


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    weight_file, pickled = path / WEIGHT_FILE, path / PICKLED_WEIGHT_FILE
    try:
        if weight_file.is_file():
            return load_file(str(weight_file))
        if pickled.is_file():
            tensors = torch.load(pickled, map_location="cpu", weights_only=True)
            if isinstance(tensors, dict) and all(isinstance(name, str) and isinstance(t, torch.Tensor)
                                                 and t.layout == torch.strided and not t.is_quantized
                                                 for name, t in tensors.items()):
                return tensors
            raise ValueError("it does not hold a dict of names to dense tensors")
    except (SafetensorError, OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise KvstrataError(f"LoRA adapter {path}: its weights are not readable ({exc})") from None
    raise KvstrataError(f"LoRA adapter {path}: no {WEIGHT_FILE} (or {PICKLED_WEIGHT_FILE})")


def _checked_parts(path: Path, pairs: dict[tuple[int, str], dict[str, torch.Tensor]], config: ModelConfig,
                   settings: dict) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each (layer, PEFT module)'s A and B in float64, B scaled; shapes checked against the model."""
    sizes, inputs = part_sizes(config), input_sizes(config)
    parts = {}
    for (layer, module), pair in pairs.items():
        where = f"LoRA adapter {path}: layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise KvstrataError(f"{where} has lora_{next(iter(pair))} without lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"].double(), pair["B"].double()
        _, fused, index = PARTS[module]
        rows = part_rows(sizes[fused], index)
        out = rows.stop - rows.start
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inputs[fused] or b.shape != (out, a.shape[0]) or not len(a):
            raise KvstrataError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                                f"model (A must be [r, {inputs[fused]}] and B [{out}, r], r >= 1)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise KvstrataError(f"{where}: the weights hold values that are not finite")
        b = b * scaling(settings, a.shape[0])
        if fused == "qkv_proj":
            b = _as_the_layers_attend(b, rows, config)
        parts[(layer, module)] = (a, b)
    return parts


def _as_the_layers_attend(b: torch.Tensor, rows: slice, config: ModelConfig) -> torch.Tensor:
    """A q/k/v part's B (its `rows` of the fused product) with its rows as the model's own are (LongRoPE's factor
    on q's, RoPE's channel order: rotary.as_the_layers_attend). Both keep each part's rows within the part."""
    if config.query_scale == 1.0 and config.rotary_dim is None:
        return b
    whole = b.new_zeros(sum(part_sizes(config)["qkv_proj"]), b.shape[1])
    whole[rows] = b
    return as_the_layers_attend(whole, config)[rows]


def scaling(settings: dict, rank: int) -> float:
    """PEFT's factor of a module's B A: lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA."""
    return settings["lora_alpha"] / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _by_fused_projection(parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
                         ) -> dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    grouped: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in parts.items():
        _, fused, index = PARTS[module]
        grouped.setdefault((layer, fused), {})[index] = pair
    return grouped


def _fused(parts: dict[int, tuple[torch.Tensor, torch.Tensor]], sizes: tuple[int, ...], device: torch.device,
           dtype: torch.dtype) -> FusedUpdate:
    """The parts' A stacked, and each part's B with the output rows it adds to."""
    placed = functools.partial(torch.Tensor.to, device=device, dtype=dtype)
    stacked, updates, rank = [], [], 0
    for index, (a, b) in sorted(parts.items()):
        updates.append(PartUpdate(part_rows(sizes, index), slice(rank, rank + a.shape[0]), placed(b)))
        stacked.append(a)
        rank += a.shape[0]
    return FusedUpdate(placed(torch.cat(stacked)), updates)
