"""Exceptions raised by kungfu. Each subclasses the matching builtin, so callers may catch either.

Raised from the status codes of the native runtime (see `raise_for_status`).
"""


class KungFuError(Exception):
    """Base class of kungfu's errors."""


class InvalidArgumentError(KungFuError, ValueError):
    """Bad input, or peers disagree on an operation (size, dtype)."""


class OpTimeoutError(KungFuError, TimeoutError):
    """An operation did not complete before its deadline."""


class PeerFailedError(KungFuError, ConnectionError):
    """A peer died, left or could not be reached; the message names it."""


class InternalError(KungFuError, RuntimeError):
    """An unexpected failure inside the runtime."""


class CancelledError(KungFuError, RuntimeError):
    """The local peer was stopped while the operation was pending."""


class NotFoundError(KungFuError, LookupError):
    """A peer has no stored blob of the requested name."""


class ResourceExhaustedError(KungFuError, MemoryError):
    """Out of memory or threads, or a peer sent more than the runtime keeps."""


# By the runtime's status names (kungfu._kungfu.status_codes() maps codes to them: one source).
_BY_NAME = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "DEADLINE_EXCEEDED": OpTimeoutError,
    "UNAVAILABLE": PeerFailedError,
    "INTERNAL": InternalError,
    "CANCELLED": CancelledError,
    "NOT_FOUND": NotFoundError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
}
_names = None


def _class_of(code: int):
    global _names
    if _names is None:
        from kungfu import _native

        _names = _native.table("status_codes")
    return _BY_NAME.get(_names.get(code), InternalError)


def raise_for_status(status) -> None:
    """Raises the exception for a native (code, message) status; returns if code is 0."""
    code, message = status
    if code != 0:
        raise _class_of(code)(message)


__all__ = [
    "KungFuError",
    "InvalidArgumentError",
    "OpTimeoutError",
    "PeerFailedError",
    "InternalError",
    "CancelledError",
    "NotFoundError",
    "ResourceExhaustedError",
]
