"""InfiniGen's skew (papers/infinigen.md §2.1): one orthogonal matrix per (layer, KV head) that turns the
queries and keys so a few columns carry most of q·k, calibrated once per model and kept in a versioned file.

With RoPE the skew cannot be folded into W_Q and W_K (the rotation depends on the position), so it is applied
to q and k after RoPE at run time, as the authors' Llama code does; grouped-query attention shares one matrix
among the query heads of a KV head. For each (layer, KV head) A is the right singular vectors of that group's
stacked post-RoPE queries on calibration text (the eigenvectors of QᵀQ), columns ordered by σ_q·σ_k (the
query's singular value times the keys' norm along that direction, as the authors' code orders them). Since A is
orthogonal, Q̃K̃ᵀ = (QA)(KA)ᵀ = QKᵀ exactly.

The partial columns (the paper's top 30%) are ranked by the mean |Q̃| + |K̃| per column over the calibration
tokens. The paper ranks them per prompt at prefill; here the ranking is the model's, fixed at calibration,
so the partial keys of a cached block mean the same for every sequence that shares it (prefix caching,
preemption). `kvstrata bench infinigen-skew` measures what that costs against a per-prompt ranking.
"""

from __future__ import annotations

import io
import json
import math
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstrata.errors import KvstrataError
from kvstrata.files import calibration_dir, write_atomically

FORMAT = "kvstrata-infinigen-skew"
VERSION = 1
DATA_DIR = Path(__file__).parent / "data"  # shipped files, named <fingerprint>.npz
ORTHOGONALITY_TOLERANCE = 1e-4


class ForeignSkewError(KvstrataError):
    """A skew calibrated on another model's weights."""


@dataclass(frozen=True, eq=False)
class InfiniGenSkew:
    fingerprint: str
    rotation: torch.Tensor  # float32 [layers, kv_heads, D, D], orthogonal; column j is skewed channel j
    column_weights: torch.Tensor  # float32 [layers, kv_heads, D]: mean |Q̃| + |K̃| of each skewed channel
    num_windows: int
    window_tokens: int
    source: str  # file name of the calibration text

    def __post_init__(self) -> None:
        _check(self)

    @property
    def num_layers(self) -> int:
        return self.rotation.shape[0]

    def partial_columns(self, ratio: float) -> torch.Tensor:
        """long [layers, kv_heads, r]: each head's r = floor(ratio · D) heaviest skewed channels (at least 1)."""
        if not 0 < ratio <= 1:
            raise KvstrataError(f"the partial ratio {ratio!r} must be in (0, 1]")
        dim = self.rotation.shape[-1]
        count = max(1, math.floor(ratio * dim))
        return self.column_weights.topk(count, dim=-1).indices.sort(dim=-1).values

    def partial_rotation(self, ratio: float) -> torch.Tensor:
        """float32 [layers, kv_heads, D, r]: the columns of each A that make the partial (skewed) keys."""
        columns = self.partial_columns(ratio)
        return self.rotation.gather(-1, columns[:, :, None, :].expand(-1, -1, self.rotation.shape[2], -1))

    def to_bytes(self) -> bytes:
        meta = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                "num_windows": self.num_windows, "window_tokens": self.window_tokens, "source": self.source}
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                 rotation=self.rotation.numpy(), column_weights=self.column_weights.numpy())
        return buffer.getvalue()

    def save(self, path: str | Path) -> None:
        try:
            write_atomically(path, self.to_bytes())
        except OSError as exc:
            raise KvstrataError(f"cannot write the infinigen skew to {path}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path, fingerprint: str) -> InfiniGenSkew:
        """Read a file written by `save`, refusing anything malformed or made for another model."""
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                arrays = {name: torch.from_numpy(data[name].copy()) for name in ("rotation", "column_weights")}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # ValueError: bad JSON
            raise KvstrataError(f"{path} is not a readable infinigen skew file: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise KvstrataError(f"{path} is not an infinigen skew file (format {FORMAT!r})")
        if meta.get("version") != VERSION:
            raise KvstrataError(f"{path} is infinigen skew version {meta.get('version')!r}; only version {VERSION} "
                                "is readable")
        try:
            skew = cls(meta["fingerprint"], arrays["rotation"], arrays["column_weights"], meta["num_windows"],
                       meta["window_tokens"], meta["source"])
        except (KeyError, KvstrataError) as exc:
            raise KvstrataError(f"{path} holds an invalid infinigen skew: {exc}") from None
        if skew.fingerprint != fingerprint:
            raise ForeignSkewError(f"the infinigen skew {path} was calibrated for model {skew.fingerprint}, not the "
                                   f"loaded model {fingerprint}")
        return skew


def _check(skew: InfiniGenSkew) -> None:
    r, w = skew.rotation, skew.column_weights
    if not isinstance(skew.fingerprint, str) or not isinstance(skew.source, str):
        raise KvstrataError("fingerprint and source must be strings")
    for name in ("num_windows", "window_tokens"):
        value = getattr(skew, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KvstrataError(f"{name} {value!r} must be a positive integer")
    if not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or r.dim() != 4 or r.shape[2] != r.shape[3]:
        raise KvstrataError(f"rotation must be float32 [layers, kv_heads, D, D], got {_shape(r)}")
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.shape != r.shape[:3]:
        raise KvstrataError(f"column_weights must be float32 {list(r.shape[:3])}, got {_shape(w)}")
    if not bool(torch.isfinite(r).all()) or not bool(torch.isfinite(w).all()):
        raise KvstrataError("the skew has non-finite values")
    identity = torch.eye(r.shape[-1])
    error = (r.transpose(-1, -2).double() @ r.double() - identity.double()).abs().amax().item()
    if error > ORTHOGONALITY_TOLERANCE:
        raise KvstrataError(f"the skew matrices are not orthogonal (|AᵀA - I| up to {error:.3g})")


def _shape(x) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def skew_from_windows(windows: Iterable[tuple[torch.Tensor, torch.Tensor]], fingerprint: str, window_tokens: int,
                      source: str = "") -> InfiniGenSkew:
    """The skew of post-RoPE queries q [layers, T, heads, D] and keys k [layers, T, kv_heads, D] of calibration
    windows (a re-iterable: it is read twice, once for the matrices and once for the column weights)."""
    gram_q = gram_k = None
    count = 0
    for q, k in windows:
        grouped = _grouped(q, k.shape[2]).double()  # [L, G, rows, D]
        keys = k.transpose(1, 2).double()  # [L, G, T, D]
        gram_q = grouped.transpose(-1, -2) @ grouped + (0 if gram_q is None else gram_q)
        gram_k = keys.transpose(-1, -2) @ keys + (0 if gram_k is None else gram_k)
        count += 1
    if gram_q is None:
        raise KvstrataError("infinigen calibration needs at least one window")
    eigenvalues, vectors = torch.linalg.eigh(gram_q)  # ascending; columns are QᵀQ's eigenvectors
    sigma_q = eigenvalues.clamp(min=0).sqrt()
    sigma_k = torch.einsum("lgdj,lgde,lgej->lgj", vectors, gram_k, vectors).clamp(min=0).sqrt()
    order = (sigma_q * sigma_k).argsort(dim=-1, descending=True)
    rotation = vectors.gather(-1, order[:, :, None, :].expand_as(vectors))
    sums, tokens = 0, 0
    for q, k in windows:
        grouped, keys = _grouped(q, k.shape[2]), k.transpose(1, 2)
        rot = rotation.float()
        sums = sums + (grouped @ rot).abs().sum(2) * (keys.shape[2] / grouped.shape[2]) + (keys @ rot).abs().sum(2)
        tokens += keys.shape[2]
    return InfiniGenSkew(fingerprint, rotation.float().contiguous(), (sums / tokens).float(), count, window_tokens,
                         source)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[L, T, heads, D] -> [L, kv_heads, T * group, D]: the queries of each KV head's query heads stacked."""
    layers, tokens, heads, dim = q.shape
    group = heads // kv_heads
    return q.float().view(layers, tokens, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(
        layers, kv_heads, tokens * group, dim)


def shipped_or_cached_skew(fingerprint: str) -> InfiniGenSkew | None:
    """The skew that ships for this model, else one calibrated on first use earlier, else None."""
    shipped = DATA_DIR / f"{fingerprint}.npz"
    if shipped.is_file():
        return InfiniGenSkew.load(shipped, fingerprint)
    cached = cached_skew_path(fingerprint)
    if cached.is_file():
        try:
            return InfiniGenSkew.load(cached, fingerprint)
        except KvstrataError as exc:  # e.g. written by an older kvstrata: a cache is rebuilt, not fatal
            warnings.warn(f"calibrating the infinigen skew again: {exc}", stacklevel=2)
    return None


def cached_skew_path(fingerprint: str) -> Path:
    return calibration_dir("infinigen") / f"{fingerprint}.npz"
