"""Chained hashes of full KV blocks: a block's key covers its tokens and every token before it."""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def chained_block_hash(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def full_block_hashes(token_ids: list[int], block_size: int, known: list[BlockHash]) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already known prefix of the chain."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(chained_block_hash(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes
