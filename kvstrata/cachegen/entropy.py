"""Lossless coding of integer symbols with a range (ANS) coder.

Symbols come in groups; each group is coded with a probability model over the integer range
[lo, lo + len(probabilities)), its own or one it shares with other groups (`group_models`). A model is
counted from the group itself (its table of counts travels in the stream), given from an offline profile
(only its range travels), or fitted (fitted_models.py: a few parameters travel).

Two coders, named by the section that holds their output: "rans", the compiled coder
(kernels/rans.cpp: one call per tensor, without the GIL; a chunk decodes 1.6-1.9x faster end to end,
docs/BENCHMARKS.md), written wherever it builds; and
"symbols", constriction's ANS coder, written where no compiler is at hand and read in streams written
before the compiled coder existed.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import constriction
import numpy as np
import torch

from kvstrata.cachegen.errors import CorruptStreamError
from kvstrata.compiled_extension import load_extension

COMPILED_SECTION = "rans"
CONSTRICTION_SECTION = "symbols"
CODER_SECTIONS = (COMPILED_SECTION, CONSTRICTION_SECTION)


@functools.cache
def compiled_coder():
    """The compiled rANS coder, or None (with a warning) where it cannot be built."""
    return load_extension("kvstrata_rans")


@dataclass
class SymbolModel:
    lo: int
    probabilities: np.ndarray  # float64, sums to 1; entry i is the probability of symbol lo + i

    def categorical(self):
        # perfect=False: a faster, slightly lossy fixed-point approximation, computed the same
        # way on both sides, so encoder and decoder always agree. constriction refuses a
        # one-symbol alphabet, so a constant group gets an unused second symbol.
        probabilities = self.probabilities if len(self.probabilities) > 1 else np.array([1.0, 0.0])
        return constriction.stream.model.Categorical(probabilities, perfect=False)


def symbol_range(group: np.ndarray) -> tuple[int, int]:
    return (int(group.min()), int(group.max())) if group.size else (0, 0)


def counted_model(group: np.ndarray) -> tuple[SymbolModel, np.ndarray]:
    """The group's own histogram as a model, and the counts that describe it."""
    lo, hi = symbol_range(group)
    counts = np.bincount(group - lo, minlength=hi - lo + 1) if group.size else np.ones(1, dtype=np.int64)
    return SymbolModel(lo, counts / counts.sum()), counts


def encode_groups(groups: list[np.ndarray], models: list[SymbolModel], group_models: np.ndarray | None = None,
                  group_offsets: np.ndarray | None = None) -> tuple[str, bytes]:
    """The section name of the coder used (COMPILED_SECTION where it builds) and the coded symbols; group i is
    coded less group_offsets[i] (default: 0) with models[group_models[i]] (default: models[i])."""
    group_models = _group_models(group_models, len(groups))
    if group_offsets is not None:
        groups = [g.reshape(-1) - offset for g, offset in zip(groups, group_offsets)]
    coder = compiled_coder()
    if coder is None:
        return CONSTRICTION_SECTION, _constriction_encode(groups, [models[m] for m in group_models])
    symbols = np.concatenate([g.reshape(-1) - models[m].lo for g, m in zip(groups, group_models)] or [np.zeros(0)])
    words = coder.rans_encode(torch.from_numpy(symbols.astype(np.int32)),
                              *_layout(models, [g.size for g in groups], group_models))
    return COMPILED_SECTION, words.numpy().view(np.uint32).astype("<u4", copy=False).tobytes()


def decode_symbols(sections: dict[str, bytes], models: list[SymbolModel], sizes: list[int],
                   group_models: np.ndarray | None = None, group_offsets: np.ndarray | None = None) -> np.ndarray:
    """Every group's symbols, concatenated (int32), from whichever coder's section `sections` holds; group i
    under models[group_models[i]] (default: models[i]), plus group_offsets[i] (what the encoder took off it)."""
    group_models = _group_models(group_models, len(sizes))
    offsets = np.array([m.lo for m in models], dtype=np.int64)[group_models]
    if group_offsets is not None:
        offsets = offsets + group_offsets
    if COMPILED_SECTION in sections:
        return _compiled_decode(sections[COMPILED_SECTION], models, sizes, group_models, offsets)
    if CONSTRICTION_SECTION in sections:
        symbols = _constriction_decode(sections[CONSTRICTION_SECTION], [models[m] for m in group_models], sizes)
        return np.concatenate([np.zeros(0, dtype=np.int32),
                               *(s + (o - models[m].lo) for s, o, m in zip(symbols, offsets, group_models))]
                              ).astype(np.int32)
    raise CorruptStreamError(f"the stream has no coded symbols (a section named one of {', '.join(CODER_SECTIONS)})")


def _group_models(group_models: np.ndarray | None, num_groups: int) -> np.ndarray:
    return np.arange(num_groups, dtype=np.int64) if group_models is None else np.asarray(group_models, np.int64)


def _layout(models: list[SymbolModel], sizes: list[int], group_models: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group sizes, each group's model, model lengths and every model's probabilities concatenated, as the compiled
    coder takes them."""
    lengths = np.array([len(m.probabilities) for m in models], dtype=np.int64)
    probabilities = np.concatenate([m.probabilities for m in models] or [np.zeros(0)]).astype(np.float64, copy=False)
    return (torch.from_numpy(np.asarray(sizes, dtype=np.int64)), torch.from_numpy(group_models),
            torch.from_numpy(lengths), torch.from_numpy(probabilities))


def _compiled_decode(data: bytes, models: list[SymbolModel], sizes: list[int], group_models: np.ndarray,
                     offsets: np.ndarray) -> np.ndarray:
    coder = compiled_coder()
    if coder is None:
        raise CorruptStreamError("the stream was coded with the compiled rANS coder, which could not be built on this "
                                 "machine (a C++ compiler is needed to read it)")
    if len(data) % 4:
        raise CorruptStreamError(f"an entropy-coded section of {len(data)} bytes is not whole 32-bit words")
    words = torch.from_numpy(np.frombuffer(data, dtype="<u4").astype(np.uint32).view(np.int32))
    if len(offsets) and (offsets.min() < np.iinfo(np.int32).min or offsets.max() > np.iinfo(np.int32).max):
        raise CorruptStreamError("a coder group's symbols would lie outside 32-bit integers")
    try:
        return coder.rans_decode(words, *_layout(models, sizes, group_models),
                                 torch.from_numpy(offsets.astype(np.int32))).numpy()
    except (ValueError, RuntimeError) as exc:  # a stream that does not decode, or models it cannot hold
        raise CorruptStreamError(str(exc).splitlines()[0]) from None


def _constriction_encode(groups: list[np.ndarray], models: list[SymbolModel]) -> bytes:
    coder = constriction.stream.stack.AnsCoder()
    for group, model in zip(reversed(groups), reversed(models)):  # a stack: encode last group first
        if group.size:
            coder.encode_reverse((group - model.lo).astype(np.int32), model.categorical())
    return coder.get_compressed().tobytes()


def _constriction_decode(data: bytes, models: list[SymbolModel], sizes: list[int]) -> list[np.ndarray]:
    if len(data) % 4:
        raise CorruptStreamError(f"an entropy-coded section of {len(data)} bytes is not whole 32-bit words")
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(data, dtype=np.uint32).copy())
    out = []
    for model, size in zip(models, sizes):
        symbols = coder.decode(model.categorical(), size) if size else np.zeros(0, dtype=np.int32)
        out.append(symbols.astype(np.int32) + model.lo)
    return out


# --- count tables: the models counted per chunk, serialized -----------------------------------


def write_count_tables(counts: list[np.ndarray], los: list[int]) -> bytes:
    """lo (int32) and table length (uint32) per model, then every count (uint32), deflated."""
    header = np.stack([np.array(los, dtype=np.int64), np.array([len(c) for c in counts], dtype=np.int64)], axis=1)
    raw = header.astype("<i4").tobytes() + np.concatenate(counts).astype("<u4").tobytes()
    return zlib.compress(raw, 6)


def read_count_tables(data: bytes, num_models: int, max_table: int) -> list[SymbolModel]:
    try:
        raw = zlib.decompress(data)
    except zlib.error as exc:
        raise CorruptStreamError(f"the model table does not inflate: {exc}") from None
    if len(raw) < 8 * num_models:
        raise CorruptStreamError(f"the model table holds {len(raw)} bytes, too few for {num_models} models")
    header = np.frombuffer(raw[: 8 * num_models], dtype="<i4").reshape(num_models, 2)
    lengths = header[:, 1].astype(np.int64)
    if (lengths < 1).any() or (lengths > max_table).any() or len(raw) != 8 * num_models + 4 * int(lengths.sum()):
        raise CorruptStreamError("the model table's lengths do not match its size")
    counts = np.frombuffer(raw[8 * num_models :], dtype="<u4").astype(np.float64)
    models, start = [], 0
    for lo, length in zip(header[:, 0].tolist(), lengths.tolist()):
        table = counts[start : start + length]
        start += length
        if table.sum() <= 0:
            raise CorruptStreamError("a model table has no counts")
        models.append(SymbolModel(lo, table / table.sum()))
    return models


def write_ranges(groups: list[np.ndarray]) -> bytes:
    """Each group's (lo, hi), deflated: all a profiled model needs from the chunk."""
    ranges = np.array([symbol_range(g) for g in groups], dtype="<i4")
    return zlib.compress(ranges.tobytes(), 6)


def read_ranges(data: bytes, num_models: int) -> np.ndarray:
    try:
        raw = zlib.decompress(data)
    except zlib.error as exc:
        raise CorruptStreamError(f"the symbol ranges do not inflate: {exc}") from None
    if len(raw) != 8 * num_models:
        raise CorruptStreamError(f"the symbol ranges hold {len(raw)} bytes, expected {8 * num_models}")
    ranges = np.frombuffer(raw, dtype="<i4").reshape(num_models, 2)
    if (ranges[:, 1] < ranges[:, 0]).any():
        raise CorruptStreamError("a symbol range ends before it starts")
    return ranges
