"""Errors of saved KV streams: every way a file can be unusable gets its own clear message."""

from kvstrata.errors import KvstrataError


class CorruptStreamError(KvstrataError):
    """A KV stream that is truncated, altered or not a kvstrata KV file at all."""


class ForeignModelError(KvstrataError):
    """A KV stream or profile made for a different model than the one loaded."""
