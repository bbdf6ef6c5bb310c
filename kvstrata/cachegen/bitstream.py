"""The saved-context file: a checked header, then one record per (chunk, level). Layout in docs/KV_FORMAT.md.

Every byte is covered by a digest (the header's after it, each record's in the header), and every
length and offset is checked against the file, so a truncated, altered or foreign file raises
CorruptStreamError or ForeignModelError instead of decoding into wrong tensors.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstrata.cachegen.errors import CorruptStreamError, ForeignModelError
from kvstrata.cachegen.levels import CodecSettings
from kvstrata.errors import KvstrataError

MAGIC = b"KVSTRATA-KV\x00"
VERSION = 7  # 2: settings name which of K and V are coded as anchor differences; 3: "channels" step codes;
# 4: settings name the step allocation; 5: settings name token_steps (codes per token after the other groups);
# 6: settings name transform (components of the profile's transforms); 7: settings name sink_anchor_only and may
# name fitted coder models
READABLE_VERSIONS = (2, 3, 4, 5, 6, 7)  # a version-2 file has no "channels" section: one step per layer
PREAMBLE = struct.Struct("<12sHI")  # magic, version, header length
DIGEST_BYTES = 16
MAX_HEADER = 1 << 28


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


@dataclass
class ModelShape:
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass
class Record:
    chunk: int
    level: str
    settings: CodecSettings
    offset: int  # from the start of the payload
    sections: dict[str, int]  # name -> length, in payload order
    digest: str

    @property
    def length(self) -> int:
        return sum(self.sections.values())


@dataclass
class KVFileHeader:
    model: ModelShape
    token_ids: list[int]
    chunk_bounds: list[tuple[int, int]]  # [start, end) of every chunk, contiguous from 0
    profile: str | None  # digest of the offline profile the records need, if any
    records: list[Record]

    def to_json(self) -> dict:
        return {
            "model": vars(self.model),
            "tokens": base64.b64encode(np.array(self.token_ids, dtype="<u4").tobytes()).decode(),
            "chunks": [list(b) for b in self.chunk_bounds],
            "profile": self.profile,
            "records": [
                {"chunk": r.chunk, "level": r.level, "settings": r.settings.to_json(), "offset": r.offset,
                 "sections": r.sections, "digest": r.digest}
                for r in self.records
            ],
        }


def write_kv_file(path: str | Path, header: KVFileHeader, payloads: list[dict[str, bytes]]) -> int:
    """Write atomically (a temporary file renamed into place); return the file's size in bytes."""
    offset = 0
    for record, sections in zip(header.records, payloads):
        record.offset = offset
        record.sections = {name: len(data) for name, data in sections.items()}
        record.digest = _digest(b"".join(sections.values())).hex()
        offset += record.length
    header_bytes = json.dumps(header.to_json(), separators=(",", ":")).encode()
    path = Path(path)
    staging = None
    try:
        fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as out:
            out.write(PREAMBLE.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes + _digest(header_bytes))
            for sections in payloads:
                for data in sections.values():
                    out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, path)
    except OSError as exc:
        if staging is not None:
            Path(staging).unlink(missing_ok=True)
        raise KvstrataError(f"could not write the KV file {path}: {exc.strerror or exc}") from None
    return PREAMBLE.size + len(header_bytes) + DIGEST_BYTES + offset


class KVFile:
    """A parsed, checked saved-context file; record payloads are verified when read."""

    def __init__(self, data: bytes, source: str = "<bytes>"):
        self.source = source
        self.data = data
        if len(data) < PREAMBLE.size:
            raise CorruptStreamError(f"{source} is {len(data)} bytes long, too short for a kvstrata KV file")
        magic, version, header_len = PREAMBLE.unpack_from(data)
        if magic != MAGIC:
            raise CorruptStreamError(f"{source} is not a kvstrata KV file (bad magic bytes)")
        if version not in READABLE_VERSIONS:
            raise CorruptStreamError(f"{source} has format version {version}; this kvstrata reads versions "
                                     f"{', '.join(map(str, READABLE_VERSIONS))}")
        end = PREAMBLE.size + header_len
        if header_len > MAX_HEADER or end + DIGEST_BYTES > len(data):
            raise CorruptStreamError(f"{source} is truncated: its header claims {header_len} bytes")
        header_bytes = data[PREAMBLE.size : end]
        if _digest(header_bytes) != data[end : end + DIGEST_BYTES]:
            raise CorruptStreamError(f"{source}: the header's checksum does not match (the file is corrupted)")
        self.payload_start = end + DIGEST_BYTES
        try:
            self.header = _parse_header(json.loads(header_bytes))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptStreamError(f"{source}: the header is malformed: {exc}") from None
        for record in self.header.records:
            if self.payload_start + record.offset + record.length > len(data):
                raise CorruptStreamError(f"{source} is truncated: chunk {record.chunk} ({record.level}) runs past the end")

    @classmethod
    def open(cls, path: str | Path) -> KVFile:
        try:
            return cls(Path(path).read_bytes(), str(path))
        except OSError as exc:
            raise KvstrataError(f"cannot read the KV file {path}: {exc.strerror or exc}") from None

    def check_model(self, shape: ModelShape) -> None:
        mine = self.header.model
        if mine.fingerprint != shape.fingerprint:
            raise ForeignModelError(
                f"{self.source} holds the KV cache of model {mine.fingerprint}; the loaded model is {shape.fingerprint}"
            )
        if vars(mine) != vars(shape):
            raise CorruptStreamError(f"{self.source}: model shape {vars(mine)} does not match {vars(shape)}")

    def levels(self, chunk: int) -> list[str]:
        return [r.level for r in self.header.records if r.chunk == chunk]

    def record(self, chunk: int, level: str) -> Record:
        for record in self.header.records:
            if record.chunk == chunk and record.level == level:
                return record
        raise KvstrataError(f"{self.source} has no level {level!r} for chunk {chunk}; it has {self.levels(chunk)}")

    def sections(self, record: Record) -> dict[str, bytes]:
        start = self.payload_start + record.offset
        payload = self.data[start : start + record.length]
        if _digest(payload).hex() != record.digest:
            raise CorruptStreamError(
                f"{self.source}: chunk {record.chunk} at level {record.level} fails its checksum (the file is corrupted)"
            )
        out, position = {}, 0
        for name, length in record.sections.items():
            out[name] = payload[position : position + length]
            position += length
        return out


def _parse_header(raw: dict) -> KVFileHeader:
    model = raw["model"]
    shape = ModelShape(str(model["fingerprint"]), *(_int(model[k], 1, 1 << 20) for k in
                                                     ("num_layers", "num_kv_heads", "head_dim")))
    tokens = np.frombuffer(base64.b64decode(raw["tokens"], validate=True), dtype="<u4").tolist()
    bounds = [(_int(s, 0, len(tokens)), _int(e, 1, len(tokens))) for s, e in raw["chunks"]]
    if not tokens or not bounds or bounds[0][0] != 0 or bounds[-1][1] != len(tokens) or any(
        s >= e for s, e in bounds
    ) or any(bounds[i][1] != bounds[i + 1][0] for i in range(len(bounds) - 1)):
        raise ValueError(f"chunk bounds {bounds[:4]}... do not tile the {len(tokens)} tokens")
    profile = raw["profile"]
    if profile is not None and not isinstance(profile, str):
        raise ValueError(f"profile {profile!r} is not a digest")
    records = []
    for item in raw["records"]:
        sections = item["sections"]
        if not isinstance(sections, dict) or not sections:
            raise ValueError(f"record sections {sections!r} are not a name -> length map")
        record = Record(
            _int(item["chunk"], 0, len(bounds) - 1), str(item["level"]), CodecSettings.from_json(item["settings"]),
            _int(item["offset"], 0, 1 << 62), {str(k): _int(v, 0, 1 << 40) for k, v in sections.items()},
            str(item["digest"]),
        )
        if record.settings.source == "profiled" and profile is None:
            raise ValueError(f"chunk {record.chunk} uses a profiled model but the file names no profile")
        records.append(record)
    return KVFileHeader(shape, tokens, bounds, profile, records)


def _int(value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{value!r} is not an integer in [{low}, {high}]")
    return value
