"""Safetensors files whose tensors may be group-quantized.

A `GroupQuantized` tensor NAME is stored as NAME.codes, NAME.scales and (asymmetric codes) NAME.offsets;
the file's metadata maps NAME to its bits and group size, so a reader rebuilds it exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstrata.model.group_quantized import GroupQuantized

METADATA_KEY = "kvstrata_group_quantized"
PARTS = ("codes", "scales", "offsets")


def save_checkpoint_tensors(state: dict[str, torch.Tensor | GroupQuantized], path: Path) -> None:
    flat, layouts = {}, {}
    for name, value in state.items():
        if isinstance(value, GroupQuantized):
            layouts[name] = {"bits": value.bits, "group_size": value.group_size}
            for part in PARTS:
                if getattr(value, part) is not None:
                    flat[f"{name}.{part}"] = getattr(value, part).contiguous()
        else:
            flat[name] = value.contiguous()
    save_file(flat, str(path), metadata={METADATA_KEY: json.dumps(layouts)})


def regroup(flat: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, torch.Tensor | GroupQuantized]:
    """Inverse of `save_checkpoint_tensors`' flattening, given the file's tensors and metadata."""
    layouts = json.loads((metadata or {}).get(METADATA_KEY, "{}"))
    state: dict[str, torch.Tensor | GroupQuantized] = {}
    for name, layout in layouts.items():
        codes, scales = flat.pop(f"{name}.codes"), flat.pop(f"{name}.scales")
        state[name] = GroupQuantized(codes, scales, flat.pop(f"{name}.offsets", None), layout["bits"],
                                     layout["group_size"])
    state.update(flat)
    return state
