"""LoRA adapters written by PEFT itself, and PEFT's model as the reference kvstrata's outputs are held to: neither
depends on how kvstrata reads the format."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_peft_adapter(base: torch.nn.Module, directory: Path, seed: int, **settings) -> Path:
    """A random adapter of `base` (transformers; left unchanged) saved by PEFT: A and B drawn as PEFT draws them
    with init_lora_weights=False (a fresh adapter's B is zeros: no update to test)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **{"target_modules": list(ALL_PROJECTIONS), **settings})
    model = get_peft_model(base, config)
    model.save_pretrained(str(directory))
    model.unload()  # the base's modules back as they were
    return directory


def peft_reference(base: torch.nn.Module, directory: Path, adapter_name: str = "default") -> torch.nn.Module:
    """`base` running the adapter saved in `directory`, as PEFT runs it (unmerged); more adapters join it by
    `load_adapter` and are chosen by `set_adapter`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(directory), adapter_name=adapter_name).eval()
