"""Random LoRA adapters in PEFT's saved form, for a model of a given shape: the benchmark's and the tests' adapters
(nothing is downloaded, and a random update changes the output as much as a trained one of its size), and the
merged weights W + scaling * B A that transformers runs as their reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstrata.model.config import ModelConfig
from kvstrata.model.lora import CONFIG_FILE, PARTS, WEIGHT_FILE, WHOLE, input_sizes, part_rows, part_sizes, scaling

ALL_MODULES = tuple(module for module, (_, _, index) in PARTS.items() if index != WHOLE)  # a Llama's projections


def write_random_adapter(directory: Path, config: ModelConfig, rank: int = 8, alpha: float = 16.0,
                         modules: tuple[str, ...] = ALL_MODULES, seed: int = 0, std: float = 0.05,
                         rslora: bool = False) -> Path:
    """A PEFT adapter of `rank` on `modules` of every layer, A and B drawn from N(0, std^2) (PEFT starts B at zero;
    a trained B is not)."""
    generator = torch.Generator().manual_seed(seed)
    sizes, inputs = part_sizes(config), input_sizes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module in modules:
            parent, fused, index = PARTS[module]
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inputs[fused], generator=generator) * std
            rows = part_rows(sizes[fused], index)
            tensors[f"{name}.lora_B.weight"] = torch.randn(rows.stop - rows.start, rank, generator=generator) * std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHT_FILE))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
                "use_rslora": rslora, "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    (directory / CONFIG_FILE).write_text(json.dumps(settings))
    return directory


def merge_adapter(hf_model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """`hf_model` (transformers) with the adapter's updates added to its weights, in place."""
    from safetensors.torch import load_file

    settings = json.loads((adapter_dir / CONFIG_FILE).read_text())
    tensors = load_file(str(adapter_dir / WEIGHT_FILE))
    parameters = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            weight = parameters[name.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"]
            weight += (scaling(settings, a.shape[0]) * b.double() @ a.double()).to(weight.dtype)
    return hf_model
