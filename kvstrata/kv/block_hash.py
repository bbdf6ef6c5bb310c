"""Chained hashes of full KV blocks: a block's key covers its tokens and every token before it."""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def tenant_salt(cache_salt: str) -> bytes:
    """The bytes a request's `cache_salt` (vLLM's) starts its chains with: requests share cached KV only with those
    bringing the same string, so one tenant cannot learn from its time to first token what another has asked. A
    digest of fixed length, so that it joins the other salts (a LoRA adapter's, a saved context's) unambiguously."""
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"cache_salt").digest()


def chained_block_hash(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def full_block_hashes(
    token_ids: list[int], block_size: int, known: list[BlockHash], salt: bytes | None = None
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already known prefix of the chain.

    A salt starts a separate chain: blocks whose KV came from somewhere else than a plain prefill
    (a decoded saved context) are shared only with requests that bring the same salt.
    """
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(chained_block_hash(hashes[-1] if hashes else salt, token_ids[start : start + block_size]))
    return hashes
