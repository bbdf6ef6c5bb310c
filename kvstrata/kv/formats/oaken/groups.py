"""Oaken's magnitude groups: the configuration, compare-only membership and the group shift.

Groups are numbered from the outermost (largest magnitudes, 0) to the innermost (values near zero, G-1).
Boundary g separates group g from the groups inside it; `bounds[g] = (lo_g, hi_g)` with
lo_0 < lo_1 < ... < hi_1 < hi_0. The dense group is the one with the largest fraction; the others are
sparse (stored as outliers).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvstrata.errors import KvstrataError

OUTLIER_MODES = ("5bit", "fp16")
SCALE_SCOPES = ("token", "window")
_JSON_KEYS = ("ratios", "group_shift", "outliers", "scales")


@dataclass(frozen=True)
class OakenConfig:
    """Group fractions from outermost to innermost, and the ablation switches of the codec."""

    ratios: tuple[float, ...] = (0.04, 0.90, 0.06)
    group_shift: bool = True
    outliers: str = "5bit"  # "5bit" (paper) | "fp16" (sparse values kept as float16)
    scales: str = "token"  # "token" (paper: params per token) | "window" (params over one encode call)

    def __post_init__(self) -> None:
        ratios = self.ratios
        if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__len__"):
            raise KvstrataError(f"Oaken ratios must be a sequence of 2 to 5 fractions, got {ratios!r}")
        if not 2 <= len(ratios) <= 5:
            raise KvstrataError(f"Oaken needs 2 to 5 group ratios, got {len(ratios)}: {tuple(ratios)!r}")
        for r in ratios:
            if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r) or r <= 0:
                raise KvstrataError(f"Oaken group ratio {r!r} is not allowed; each ratio must be a number > 0")
        total = math.fsum(ratios)
        if abs(total - 1.0) > 1e-6:
            raise KvstrataError(f"Oaken group ratios {tuple(ratios)!r} sum to {total!r}; they must sum to 1")
        # Lists (e.g. from JSON) become tuples so the config stays hashable.
        object.__setattr__(self, "ratios", tuple(float(r) for r in ratios))
        if not isinstance(self.group_shift, bool):
            raise KvstrataError(f"Oaken group_shift must be true or false, got {self.group_shift!r}")
        if self.outliers not in OUTLIER_MODES:
            raise KvstrataError(
                f"Oaken outliers {self.outliers!r} is not supported; allowed: {', '.join(OUTLIER_MODES)}"
            )
        if self.scales not in SCALE_SCOPES:
            raise KvstrataError(f"Oaken scales {self.scales!r} is not supported; allowed: {', '.join(SCALE_SCOPES)}")

    @property
    def num_groups(self) -> int:
        return len(self.ratios)

    @property
    def dense_group(self) -> int:
        """The group with the largest fraction; ties go to the outermost."""
        return self.ratios.index(max(self.ratios))

    @property
    def sparse_groups(self) -> tuple[int, ...]:
        """Sparse groups, outermost first; a group's position here is its slot in a sparse entry."""
        return tuple(g for g in range(self.num_groups) if g != self.dense_group)

    @property
    def boundary_fractions(self) -> tuple[float, ...]:
        """a_g = f_0 + ... + f_g for g = 0..G-2: the fraction of values outside boundary g."""
        return tuple(math.fsum(self.ratios[: g + 1]) for g in range(self.num_groups - 1))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the form stored inside calibration files)."""
        out = asdict(self)
        out["ratios"] = list(self.ratios)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> OakenConfig:
        """Inverse of to_json; also accepts the dict serialized as a JSON string."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise KvstrataError(f"Oaken config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise KvstrataError(f"Oaken config must be a JSON object, got {type(data).__name__}")
        if set(data) != set(_JSON_KEYS):
            raise KvstrataError(f"Oaken config has keys {sorted(data)}; expected exactly {sorted(_JSON_KEYS)}")
        return cls(**data)


def parse_ratios(text: str, what: str) -> tuple[float, ...]:
    """Group fractions from a command-line style "0.04,0.90,0.06"; `what` names the option in errors."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise KvstrataError(f"{what} {text!r} must be comma-separated numbers, e.g. 0.04,0.90,0.06") from None
    return OakenConfig(ratios=tuple(values)).ratios


def validate_bounds(bounds: torch.Tensor, config: OakenConfig) -> torch.Tensor:
    """Check a [G-1, 2] (lo, hi) threshold tensor; return it as contiguous float32."""
    want = (config.num_groups - 1, 2)
    if not isinstance(bounds, torch.Tensor) or not bounds.is_floating_point():
        raise KvstrataError(f"Oaken bounds must be a float tensor of shape {list(want)}, got {type(bounds).__name__}")
    if tuple(bounds.shape) != want:
        raise KvstrataError(
            f"Oaken bounds have shape {list(bounds.shape)}; {config.num_groups} groups need shape {list(want)}"
        )
    b = bounds.detach().to(torch.float32).contiguous()
    if not bool(torch.isfinite(b).all()):
        raise KvstrataError(f"Oaken bounds must be finite, got {b.tolist()}")
    # Nested order: lo_0 < lo_1 < ... < lo_{G-2} < hi_{G-2} < ... < hi_0.
    chain = torch.cat((b[:, 0], b[:, 1].flip(0)))
    if not bool((chain[1:] > chain[:-1]).all()):
        raise KvstrataError(f"Oaken bounds {b.tolist()} are not strictly ordered; need lo_0 < lo_1 < ... < hi_1 < hi_0")
    return b


def assign_groups(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Group index (int64, same shape as x) by comparison only: the number of boundaries strictly inside.

    Boundaries are nested, so a value strictly inside boundary g is inside every outer one too; values on a
    threshold belong to the outer side, as in the paper's reference code.
    """
    inside = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)  # narrow while counting, cheaper
    for lo, hi in bounds.tolist():
        inside += (x > lo) & (x < hi)
    return inside.long()


@dataclass(frozen=True)
class ShiftTables:
    """Per-group thresholds, each a float32 tensor [G]; zero where a group is not shifted."""

    lo: torch.Tensor  # added back on the low side
    hi: torch.Tensor  # added back on the high side; also the split: a value is on the low side iff x < hi[g]


def shift_tables(bounds: torch.Tensor, config: OakenConfig, device: torch.device | None = None) -> ShiftTables:
    g = config.num_groups
    lo = torch.zeros(g, dtype=torch.float32, device=device)
    hi = torch.zeros(g, dtype=torch.float32, device=device)
    if config.group_shift:
        # The innermost group (g-1) has no boundary of its own and is never shifted.
        lo[: g - 1] = bounds[:, 0]
        hi[: g - 1] = bounds[:, 1]
    return ShiftTables(lo=lo, hi=hi)


def group_shift(x: torch.Tensor, groups: torch.Tensor, tables: ShiftTables) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', low side): x' = x - hi_g on the high side, x - lo_g on the low side.

    A shifted value on the high side has x' >= 0 and on the low side x' <= 0; unshifted groups split at 0.
    """
    flat = groups.reshape(-1)
    hi = tables.hi.index_select(0, flat).view(groups.shape)
    low = x < hi
    return x - torch.where(low, tables.lo.index_select(0, flat).view(groups.shape), hi), low
