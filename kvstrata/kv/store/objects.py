"""One stored object: a small header that names what it holds, a checksum, then the payload.

Every object is checked when read: the magic, the checksum over header and payload, and that the
header names the chunk, the object (layer and K or V) and the namespace (model fingerprint and the
device cache's stored form) the reader asked for. The header also names the object's own form. A truncated, altered or foreign object raises CorruptObject and
is never decoded.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

from kvstrata.kv.store.errors import CorruptObject

MAGIC = b"KVSO"
# 2: CacheGen objects may carry per-channel step codes; 3: K coded directly, steps from sensitivity; 4: fitted coder
# models (cachegen/fitted_models.py), and an 8-bit anchor only in a context's first chunk
VERSION = 4
MAX_POSITION = 2**31  # of a chunk's first token: beyond any context a model here attends over
PREAMBLE = struct.Struct("<4sBH16s")  # magic, version, header length, blake2b-128 of header + payload


@dataclass(frozen=True)
class ObjectHeader:
    namespace: str  # model fingerprint and the device cache's stored form
    chunk: str  # the chunk's chained token hash, hex
    name: str  # "k.<layer>" or "v.<layer>"
    form: str  # how the payload is coded (forms.py: float32, float16, bfloat16, a CacheGen level, "<level>+transform")
    shape: tuple[int, ...]  # of the decoded tensor: (tokens, kv_heads, head_dim)
    position: int | None = None  # of its first token in its context; None: not recorded (tokens not in order, a
    # manifest, a probe, or an object written before positions were)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def _digest(header: bytes, payload: bytes) -> bytes:
    digest = hashlib.blake2b(header, digest_size=16)
    digest.update(payload)
    return digest.digest()


def pack_object(header: ObjectHeader, payload: bytes) -> bytes:
    head = header.to_bytes()
    return PREAMBLE.pack(MAGIC, VERSION, len(head), _digest(head, payload)) + head + payload


def unpack_object(data: bytes, namespace: str, chunk: str, name: str) -> tuple[ObjectHeader, bytes]:
    """The header and payload of an object, after checking that it is whole and is the object asked for."""
    where = f"object {name} of chunk {chunk[:16]}"
    if len(data) < PREAMBLE.size:
        raise CorruptObject(f"{where} is truncated: {len(data)} bytes, shorter than its preamble")
    magic, version, head_len, digest = PREAMBLE.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"{where} is not a kvstrata store object of version {VERSION} "
                            f"(magic {magic!r}, version {version})")
    head = data[PREAMBLE.size : PREAMBLE.size + head_len]
    payload = data[PREAMBLE.size + head_len :]
    if len(head) != head_len or _digest(head, payload) != digest:
        raise CorruptObject(f"{where} fails its checksum: truncated or altered")
    try:
        fields = json.loads(head)
        header = ObjectHeader(fields["namespace"], fields["chunk"], fields["name"], str(fields["form"]),
                              tuple(int(size) for size in fields["shape"]), fields.get("position"))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObject(f"{where} has an unreadable header: {exc}") from None
    if header.position is not None and (type(header.position) is not int or not 0 <= header.position < MAX_POSITION):
        raise CorruptObject(f"{where} names the position {header.position!r}, not an integer in [0, {MAX_POSITION})")
    if (header.namespace, header.chunk, header.name) != (namespace, chunk, name):
        raise CorruptObject(f"{where} holds {header.name} of chunk {header.chunk[:16]} in namespace "
                            f"{header.namespace!r}, not this model and stored form's ({namespace!r})")
    return header, payload
