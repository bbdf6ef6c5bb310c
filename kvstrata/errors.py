"""Errors a user can cause and fix: a bad path, a bad parameter, an impossible budget."""


class KvstrataError(ValueError):
    """A problem with what the user asked for; the message names the value and what is allowed."""
