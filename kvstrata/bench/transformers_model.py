"""The baseline's model: the same weights in Hugging Face transformers, in fp32."""

from __future__ import annotations

from pathlib import Path

import torch


def transformers_model(source: Path):
    """A GGUF file through transformers' own GGUF reader (dequantized to fp32), a checkpoint directory as is."""
    from transformers import AutoModelForCausalLM

    if source.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    return model.eval()
