"""Shared by the Oaken benchmarks (papers/oaken.md §5-§7): the KV formats compared, the texts, engines
that skip a configuration the engine refuses, and the bytes a format really keeps for real KV."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvstrata.bench.report import sig
from kvstrata.config import EngineConfig
from kvstrata.engine.kv_setup import engine_storage_layout
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.kv.sparse_pages import SparsePages

# Every --kv-format compared; a name the engine does not (yet) know is skipped with a note.
FORMATS = ("fp32", "fp16", "bf16", "int8", "int4", "fp8", "fp8_e5m2", "kivi4", "kivi2", "oaken")
PERSUASION = Path(__file__).parent / "data" / "persuasion.txt"


def build_engine(base: EngineConfig, loaded, **overrides) -> tuple[LLMEngine | None, str | None]:
    """(engine, None), or (None, why) when EngineConfig or the engine refuses the configuration."""
    try:
        return LLMEngine(dataclasses.replace(base, **overrides), loaded=loaded), None
    except (KvstrataError, TypeError) as exc:  # TypeError: an option this kvstrata does not have
        return None, f"skipped: {exc}"


def parse_formats(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _values(engine: LLMEngine, tokens: int) -> int:
    mc = engine.loaded.config
    return 2 * mc.num_layers * tokens * mc.num_kv_heads * mc.head_dim


def budgeted_bits(engine: LLMEngine) -> float:
    """Bits per value the engine charges its memory budget (StorageLayout.bytes_per_token; for Oaken this
    includes the sparse headroom)."""
    c = engine.config
    layout = engine_storage_layout(engine, getattr(torch, c.dtype), c.kv_format)
    mc = engine.loaded.config
    return 8 * layout.bytes_per_token / (2 * mc.num_layers * mc.num_kv_heads * mc.head_dim)


def stored_bytes(engine: LLMEngine, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The bytes the engine's cache keeps for K and V [layers, tokens, heads, head_dim]: a quantized format's
    records and sparse entries from encoding the real values (with the decoded values' mean squared error relative
    to the values' mean square, per layer, averaged), a float cache's storage dtype, and otherwise the layout's
    per-token charge (labelled `accounted`)."""
    tokens = k.shape[1]
    values = _values(engine, tokens)
    cache = engine.kv_cache
    fmt = getattr(cache, "format", None)
    out: dict = {"values": values}
    if fmt is None and hasattr(cache, "k"):
        size = values * cache.k.dtype.itemsize
        error = {kind: sig(float(((x.to(cache.k.dtype).float() - x).square().mean((1, 2, 3)) /
                                  x.square().mean((1, 2, 3))).mean())) for kind, x in (("k", k), ("v", v))}
        out.update(source="measured: float storage", bytes=size, dense_bytes=size, sparse_bytes=0, relative_mse=error)
    elif fmt is None:
        bits = budgeted_bits(engine)
        out.update(source="accounted: StorageLayout.bytes_per_token (not measured; excludes any full-precision "
                          "window reserved apart)", bytes=round(bits * values / 8))
    else:
        out.update(source="measured: encoded real KV", **_encoded_bytes(fmt, k, v))
        if fmt.name == "oaken":
            out["oaken"] = _oaken_split(fmt, out, tokens, 2 * k.shape[0], engine.config.block_size, values)
    out["bits_per_value"] = round(8 * out["bytes"] / values, 4)
    out["budgeted_bits_per_value"] = round(budgeted_bits(engine), 4)
    return out


def _encoded_bytes(fmt, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Bytes of every layer's K and V records, and the decoded values' error relative to the values' power."""
    tokens = k.shape[1]
    positions = torch.arange(tokens)
    dense = sparse = 0
    error = {"k": 0.0, "v": 0.0}
    for layer in range(k.shape[0]):
        for kind, x in (("k", k), ("v", v)):
            values = x[layer].reshape(tokens, -1).float()
            encoded = fmt.encode(values, layer, kind, positions)
            dense += encoded.dense.numel()
            sparse += 0 if encoded.sparse is None else encoded.sparse.numel()
            decoded = fmt.decode(encoded.dense, encoded.sparse, layer, kind, positions)
            error[kind] += float((decoded - values).square().mean() / values.square().mean()) / k.shape[0]
    table = SparsePages.TABLE_BYTES * tokens * 2 * k.shape[0] if fmt.has_sparse else 0
    return {"bytes": dense + sparse + table, "dense_bytes": dense, "sparse_bytes": sparse, "page_table_bytes": table,
            "relative_mse": {kind: sig(e) for kind, e in error.items()}}


def _oaken_split(fmt, counted: dict, tokens: int, vectors_per_token: int, block_size: int, values: int) -> dict:
    """Oaken's bytes by role, from its record layout (codec.py): nibbles | G x (min, step) | per-64 counts."""
    from kvstrata.kv.formats.oaken.codec import BLOCK, sparse_entry_bytes

    records = tokens * vectors_per_token
    nibbles = records * fmt.width // 2
    params = records * 4 * fmt.config.num_groups
    counts = records * fmt.width // BLOCK
    assert nibbles + params + counts == counted["dense_bytes"], "Oaken record layout changed"
    sparse, table = counted["sparse_bytes"], counted["page_table_bytes"]
    parts = {"payload": nibbles + sparse, "per_token_params": params, "block_outlier_counts": counts,
             "sparse_page_table": table}
    derived = counted["bytes"] - params + params / block_size
    return {
        "bytes": parts,
        "bits_per_value": {name: round(8 * size / values, 4) for name, size in parts.items()},
        "nibble_bytes": nibbles,
        "sparse_entry_bytes": sparse,
        "outlier_fraction": round(sparse / sparse_entry_bytes(fmt.config) / (records * fmt.width), 5),
        "derived_params_per_block": {
            "label": f"derived, not measured: the per-token group params kept once per {block_size}-token cache "
                     "block instead (bytes only; quality not evaluated)",
            "bits_per_value": round(8 * derived / values, 4),
        },
    }


def pareto_front(points: list[dict], x: str = "bits_per_value", y: str = "perplexity") -> list[dict]:
    """Points no other point beats on both axes (lower is better for both), by increasing x."""
    front = [p for p in points
             if not any(q[x] <= p[x] and q[y] <= p[y] and (q[x] < p[x] or q[y] < p[y]) for q in points)]
    return sorted(front, key=lambda p: (p[x], p[y]))
