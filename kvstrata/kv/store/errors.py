"""What can go wrong below the paged cache. Neither ends a request: it is prefilled from its text instead."""

from kvstrata.errors import KvstrataError


class StoreUnavailable(Exception):
    """A tier could not be reached or did not answer in time (a dead Redis, a full or unreadable disk)."""


class CorruptObject(KvstrataError):
    """A stored object that is truncated, altered, or made for another chunk, model or stored form."""
