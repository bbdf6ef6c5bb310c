"""Oaken's offline thresholds (papers/oaken.md §3.1-3.2), profiled once per model and kept in a versioned JSON file.

For G groups with fractions f_0 .. f_{G-1} (outermost first), boundary g sits at the cumulative outer fraction
a_g = f_0 + ... + f_g: its low threshold is the a_g/2 quantile ("lower" interpolation) and its high threshold the
1 - a_g/2 quantile ("higher") of one window's values of one layer (all tokens x all channels), K and V separately,
averaged over the windows, as the authors' code does. Keys are profiled before RoPE (where that code hooks k_proj)
and after it (what the paged cache holds), so the engine can pick either at run time.

Key centering (ours, not the paper's): each layer's mean key per channel before RoPE is profiled too (a first pass
over the same windows), and the keys' thresholds are also taken on centered keys, pre-RoPE keys minus the mean or
post-RoPE keys minus the mean rotated to the key's position. On the default model subtracting the mean removes
65-90% of a key's mean square, so per-token scales over centered keys are far finer (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from kvstrata.errors import KvstrataError
from kvstrata.files import calibration_dir, write_atomically
from kvstrata.kv.formats.oaken.groups import OakenConfig
from kvstrata.model.config import LLAMA_FAMILY, ModelConfig
from kvstrata.model.rotary import RotaryEmbedding, apply_rope, undo_rope

FORMAT = "kvstrata-oaken-thresholds"
VERSION = 2  # 2: key centering (k_mean and the centered key tables)
DEFAULT_RATIOS = OakenConfig().ratios
DEFAULT_WINDOWS = 100
DEFAULT_WINDOW_TOKENS = 512
KEY_POSITIONS = ("pre-rope", "post-rope")
TENSOR_FIELDS = ("k_pre_rope", "k_post_rope", "k_pre_rope_centered", "k_post_rope_centered", "v")
FIELDS = ("fingerprint", "ratios", "num_windows", "window_tokens", "source", "num_layers", *TENSOR_FIELDS, "k_mean")
DATA_DIR = Path(__file__).parent / "data"  # shipped files, named <fingerprint>.json


class ForeignCalibrationError(KvstrataError):
    """Thresholds profiled on another model's weights."""


def same_ratios(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-9 for x, y in zip(a, b))


def quantile_levels(ratios: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """The quantiles of each boundary's low and high threshold, outermost boundary first."""
    cumulative = OakenConfig(ratios=ratios).boundary_fractions
    return [a / 2 for a in cumulative], [1 - a / 2 for a in cumulative]


def window_bounds(values: torch.Tensor, ratio_sets: list[tuple[float, ...]]) -> list[torch.Tensor]:
    """For each ratio set, float64 [rows, G-1, 2] (lo, hi) over each row of `values` [rows, N]: numpy's quantile
    with "lower" interpolation for lo and "higher" for hi (index floor / ceil of (N-1) q), one sort serving all."""
    ordered = values.double().sort(dim=1).values
    last = ordered.shape[1] - 1
    out = []
    for ratios in ratio_sets:
        q_lo, q_hi = quantile_levels(ratios)
        lo = ordered[:, [math.floor(last * q) for q in q_lo]]
        hi = ordered[:, [math.ceil(last * q) for q in q_hi]]
        out.append(torch.stack((lo, hi), dim=-1))
    return out


def _chain(bounds: torch.Tensor) -> torch.Tensor:
    """[..., G-1, 2] -> [..., 2(G-1)]: lo_0, .., lo_{G-2}, hi_{G-2}, .., hi_0, which must increase strictly."""
    return torch.cat((bounds[..., 0], bounds[..., 1].flip(-1)), dim=-1)


def strictly_ordered(bounds: torch.Tensor) -> torch.Tensor:
    """float32 [L, G-1, 2] in strict order: neighbours that ties in the data or the cast to float32 made equal are
    nudged apart by one ulp, upward from the outer low threshold (quantiles are monotone, so only ties occur)."""
    chain = _chain(bounds.float()).clone()
    for i in range(1, chain.shape[-1]):
        chain[:, i] = torch.maximum(chain[:, i], torch.nextafter(chain[:, i - 1], torch.tensor(math.inf)))
    half = chain.shape[-1] // 2
    return torch.stack((chain[:, :half], chain[:, half:].flip(-1)), dim=-1)


@dataclass(frozen=True, eq=False)
class OakenThresholds:
    fingerprint: str
    ratios: tuple[float, ...]  # group fractions, outermost first
    num_windows: int
    window_tokens: int
    source: str  # file name of the calibration text
    k_pre_rope: torch.Tensor  # float32 [layers, G-1, 2]: (lo, hi) per boundary, outermost first
    k_post_rope: torch.Tensor
    k_pre_rope_centered: torch.Tensor  # of keys minus k_mean (rotated to their position after RoPE)
    k_post_rope_centered: torch.Tensor
    v: torch.Tensor
    k_mean: torch.Tensor  # float32 [layers, kv width]: each layer's mean key per channel, before RoPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", OakenConfig(ratios=self.ratios).ratios)  # validated
        if not isinstance(self.fingerprint, str) or not isinstance(self.source, str):
            raise KvstrataError("fingerprint and source must be strings")
        for name in ("num_windows", "window_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KvstrataError(f"{name} {value!r} must be a positive integer")
        for name in TENSOR_FIELDS:
            _check_table(name, getattr(self, name), len(self.ratios), self.num_layers)
        _check_mean(self.k_mean, self.num_layers)

    @property
    def num_layers(self) -> int:
        table = self.k_pre_rope
        return table.shape[0] if isinstance(table, torch.Tensor) and table.dim() == 3 else 0

    def bounds(self, layer: int, kind: str, keys: str | None = None, centered: bool = False) -> torch.Tensor:
        """float32 [G-1, 2] (lo, hi) of one layer, outermost boundary first; `keys` ("pre-rope" or "post-rope")
        and `centered` say which key thresholds, and are ignored for V."""
        if kind == "v":
            table = self.v
        elif kind == "k" and keys in KEY_POSITIONS:
            table = getattr(self, f"k_{keys.replace('-', '_')}{'_centered' if centered else ''}")
        elif kind == "k":
            raise KvstrataError(f"keys {keys!r} must be one of {', '.join(KEY_POSITIONS)}")
        else:
            raise KvstrataError(f"kind {kind!r} must be 'k' or 'v'")
        if not 0 <= layer < self.num_layers:
            raise KvstrataError(f"layer {layer} is outside the thresholds' {self.num_layers} layers")
        return table[layer].clone()

    def to_json(self) -> dict:
        meta = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "ratios": list(self.ratios),
                "num_windows": self.num_windows, "window_tokens": self.window_tokens, "source": self.source,
                "num_layers": self.num_layers}
        tensors = {name: getattr(self, name).tolist() for name in (*TENSOR_FIELDS, "k_mean")}  # float32: exact floats
        return {**meta, **tensors}

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file then os.replace), so a reader never sees half a file."""
        text = json.dumps(self.to_json(), indent=1, allow_nan=False)
        try:
            write_atomically(path, text.encode("utf-8"))
        except OSError as exc:
            raise KvstrataError(f"cannot write the oaken thresholds to {path}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path, fingerprint: str) -> OakenThresholds:
        """Read a file written by `save`, refusing anything malformed or made for another model."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError covers bad JSON and bad UTF-8
            raise KvstrataError(f"cannot read the oaken thresholds file {path}: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise KvstrataError(f"{path} is not an oaken thresholds file (format {FORMAT!r})")
        if raw.get("version") != VERSION:
            raise KvstrataError(f"{path} is oaken thresholds version {raw.get('version')!r}; only version {VERSION} "
                                "is readable")
        missing = [name for name in FIELDS if name not in raw]
        if missing:
            raise KvstrataError(f"{path} lacks the field(s) {', '.join(missing)}")
        try:
            thresholds = cls(raw["fingerprint"], raw["ratios"], raw["num_windows"], raw["window_tokens"],
                             raw["source"], *(_table_from_json(name, raw[name]) for name in (*TENSOR_FIELDS, "k_mean")))
            if raw["num_layers"] != thresholds.num_layers:
                raise KvstrataError(f"num_layers {raw['num_layers']!r} differs from the tables' "
                                    f"{thresholds.num_layers} layers")
        except KvstrataError as exc:
            raise KvstrataError(f"{path} holds invalid oaken thresholds: {exc}") from None
        if thresholds.fingerprint != fingerprint:
            raise ForeignCalibrationError(
                f"the oaken thresholds {path} were calibrated for model {thresholds.fingerprint}, not the loaded "
                f"model {fingerprint}"
            )
        return thresholds


def _table_from_json(name: str, value) -> torch.Tensor:
    try:
        return torch.from_numpy(np.asarray(value, dtype=np.float64)).float()
    except (TypeError, ValueError):
        raise KvstrataError(f"{name} is not a rectangular array of numbers") from None


def _check_mean(mean, num_layers: int) -> None:
    if not isinstance(mean, torch.Tensor) or mean.dtype != torch.float32 or mean.dim() != 2 or len(mean) != num_layers:
        got = list(mean.shape) if isinstance(mean, torch.Tensor) else type(mean).__name__
        raise KvstrataError(f"k_mean must be a float32 tensor [{num_layers}, kv width], got {got}")
    if not bool(torch.isfinite(mean).all()):
        raise KvstrataError("k_mean has non-finite values")


def _check_table(name: str, table, num_groups: int, num_layers: int) -> None:
    expected = f"[{num_layers or 'layers'}, {num_groups - 1}, 2] float32 for {num_groups} groups"
    if not isinstance(table, torch.Tensor) or table.dtype != torch.float32:
        raise KvstrataError(f"{name} must be a float32 tensor {expected}")
    if table.dim() != 3 or table.shape[0] < 1 or table.shape[0] != num_layers or table.shape[1:] != (num_groups - 1, 2):
        raise KvstrataError(f"{name} has shape {list(table.shape)}, expected {expected}")
    bad = (~torch.isfinite(table)).flatten(1).any(1).nonzero().flatten().tolist()
    if bad:
        raise KvstrataError(f"{name} has non-finite thresholds in layer(s) {bad}")
    bad = (_chain(table).diff(dim=-1) <= 0).any(1).nonzero().flatten().tolist()
    if bad:
        raise KvstrataError(f"{name} is not in strict order lo_0 < lo_1 < .. < hi_1 < hi_0 in layer(s) {bad}")


class _WindowRope:
    """RoPE at a window's positions 0..T-1, for keys [L, T, heads, D] (OPT has learned positions and no RoPE: its
    keys are the same before and after)."""

    def __init__(self, config: ModelConfig, window_tokens: int):
        self.cos_sin = None
        if config.architecture in LLAMA_FAMILY:
            self.cos_sin = RotaryEmbedding(config).cos_sin(torch.arange(window_tokens), torch.float32)

    def undo(self, k: torch.Tensor) -> torch.Tensor:
        return k if self.cos_sin is None else undo_rope(k, *self.cos_sin)

    def apply(self, k: torch.Tensor) -> torch.Tensor:
        return k if self.cos_sin is None else apply_rope(k, *self.cos_sin)


class KVSource(Protocol):
    """What calibration needs of a model, supplied from above kv/ (an LLMEngine is one): its forward pass
    as `compute_kv` (K and V [layers, tokens, kv_heads, head_dim] of a token sequence), its config and
    fingerprint, its context length and its tokenizer."""

    model_config: ModelConfig
    model_fingerprint: str
    max_model_len: int
    tokenizer: object | None

    def compute_kv(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tokenize(self, prompt: str) -> list[int]: ...


def calibrate(engine: KVSource, token_ids: list[int], ratio_sets: list[tuple[float, ...]], windows: int = DEFAULT_WINDOWS,
              window_tokens: int = DEFAULT_WINDOW_TOKENS, progress: bool = True,
              source: str = "") -> list[OakenThresholds]:
    """Thresholds for every ratio set from `windows` windows of `window_tokens` tokens spread evenly over
    `token_ids` (windows may overlap when the text is short): a pass for the mean key, then one for the thresholds."""
    ratio_sets = [OakenConfig(ratios=ratios).ratios for ratios in ratio_sets]
    if not ratio_sets:
        raise KvstrataError("oaken calibration needs at least one set of group ratios")
    if windows < 1 or window_tokens < 1 or len(token_ids) < window_tokens:
        raise KvstrataError(
            f"oaken calibration needs at least one window of at least one token from a text that long; got "
            f"{windows} windows of {window_tokens} tokens from {len(token_ids)} tokens"
        )
    if window_tokens > engine.max_model_len:
        raise KvstrataError(f"window_tokens {window_tokens} exceeds the model's max_model_len {engine.max_model_len}")
    starts = np.linspace(0, len(token_ids) - window_tokens, windows).astype(int).tolist()
    rope = _WindowRope(engine.model_config, window_tokens)
    bar = tqdm(total=2 * len(starts), desc="calibrating oaken", disable=not progress)

    def windows_kv():
        for start in starts:
            k, v = engine.compute_kv(token_ids[start : start + window_tokens])
            for name, x in (("k", k), ("v", v)):
                bad = (~torch.isfinite(x)).flatten(1).sum(1)
                if bad.any():
                    raise KvstrataError(f"the model produced {int(bad.sum())} non-finite {name} values (layers "
                                        f"{bad.nonzero().flatten().tolist()}) in the window at token {start}")
            bar.update()
            yield k, v

    with bar:
        k_mean = torch.stack([rope.undo(k).mean(1) for k, _ in windows_kv()]).mean(0)  # [L, heads, D]
        per_window: dict[str, list[list[torch.Tensor]]] = {name: [] for name in TENSOR_FIELDS}
        for k, v in windows_kv():
            pre = rope.undo(k)
            rotated_mean = rope.apply(k_mean[:, None].expand_as(k))
            tensors = (pre, k, pre - k_mean[:, None], k - rotated_mean, v)
            for name, x in zip(TENSOR_FIELDS, tensors):
                per_window[name].append(window_bounds(x.reshape(x.shape[0], -1), ratio_sets))
    return [
        OakenThresholds(
            engine.model_fingerprint, ratios, len(starts), window_tokens, source,
            *(strictly_ordered(torch.stack([w[index] for w in per_window[name]]).mean(0)) for name in TENSOR_FIELDS),
            k_mean=k_mean.flatten(1).float(),
        )
        for index, ratios in enumerate(ratio_sets)
    ]


def cache_dir() -> Path:
    """Where thresholds calibrated on first use are kept."""
    return calibration_dir("oaken")


def _cached_path(fingerprint: str, ratios: tuple[float, ...]) -> Path:
    return cache_dir() / f"{fingerprint}-{'-'.join(repr(r) for r in ratios)}.json"


def stored_thresholds(fingerprint: str, ratios: tuple[float, ...]) -> OakenThresholds | None:
    """The shipped file for this model if it has these ratios, else an earlier first-use calibration, else None."""
    shipped = DATA_DIR / f"{fingerprint}.json"
    if shipped.is_file():
        thresholds = OakenThresholds.load(shipped, fingerprint)
        if same_ratios(thresholds.ratios, ratios):
            return thresholds
    cached = _cached_path(fingerprint, ratios)
    if cached.is_file():
        try:
            thresholds = OakenThresholds.load(cached, fingerprint)
            if same_ratios(thresholds.ratios, ratios):
                return thresholds
        except KvstrataError as exc:  # e.g. written by an older kvstrata: a cache is rebuilt, not fatal
            warnings.warn(f"calibrating oaken again: {exc}", stacklevel=3)
    return None


def default_thresholds(engine: KVSource, ratios: tuple[float, ...] = DEFAULT_RATIOS, progress: bool = True) -> OakenThresholds:
    """The loaded model's thresholds: the shipped file if it has these ratios, else the cached calibration, else a
    calibration now on the packaged text (Emma), cached for the next run. Nothing is downloaded."""
    ratios = OakenConfig(ratios=ratios).ratios
    stored = stored_thresholds(engine.model_fingerprint, ratios)
    if stored is not None:
        return stored
    if engine.tokenizer is None:
        raise KvstrataError("oaken needs thresholds for this model, and a model without a tokenizer cannot be "
                            "calibrated on the packaged text; calibrate it on token ids with "
                            "kvstrata.kv.formats.oaken.thresholds.calibrate")
    from kvstrata.data import EMMA

    token_ids = engine.tokenize(EMMA.read_text(encoding="utf-8"))
    (thresholds,) = calibrate(engine, token_ids, [ratios], DEFAULT_WINDOWS,
                              min(DEFAULT_WINDOW_TOKENS, engine.max_model_len), progress, source=EMMA.name)
    try:
        thresholds.save(_cached_path(engine.model_fingerprint, ratios))
    except KvstrataError as exc:  # the thresholds are still good for this run
        warnings.warn(f"{exc}; oaken will be calibrated again next time", stacklevel=2)
    return thresholds
