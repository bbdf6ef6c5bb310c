"""Errors a user can cause and fix: a bad path, a bad parameter, an impossible budget."""


class KvstrataError(ValueError):
    """A problem with what the user asked for; the message names the value and what is allowed."""


class ParameterError(KvstrataError):
    """A bad value of one named parameter (a server answers 400 naming it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestFailed(Exception):
    """One request cannot go on (its preloaded KV could not be stored, its logits are not finite) while the
    other requests can: the engine ends it alone, with finish reason "error" and this message."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id
