"""The model's linear layers, whatever form their weights take (float, bfloat16, packed int4 or int8 codes: every
form has `in_features` and `out_features`, while only some hold their weight as a parameter)."""

from __future__ import annotations

from torch import nn


def linear_layers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


def multiplied_weights(module: nn.Module) -> int:
    """The weights a token's hidden state is multiplied by, passing once through `module`'s linear layers."""
    return sum(m.in_features * m.out_features for m in linear_layers(module))
