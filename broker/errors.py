"""Typed errors of the domain layer; each names the offending field.

The gRPC servicers map them to status codes (INVALID_ARGUMENT, FAILED_PRECONDITION, ...);
the CLI prints them and exits non-zero.
"""

from __future__ import annotations


class PdbrokerError(ValueError):
    """Base class: ``field`` is the dotted path of the input that is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class UsageError(PdbrokerError):
    """A command-line option, or the environment variable standing in for it, cannot be
    used (malformed, contradicting another, a port already taken); ``field`` is the flag."""

    @classmethod
    def of(cls, exc: ValueError) -> UsageError:
        """``exc``, whose message is ``--flag: why``, as a usage error."""
        flag, _, why = str(exc).partition(": ")
        return cls(flag, why)


class LayoutError(PdbrokerError):
    """A layout declaration is malformed (a segment outside its page, a bad dtype, ...)."""


class IncompatibleLayoutsError(PdbrokerError):
    """Prefill and decode layouts describe different models or cannot be resharded."""


class RequestError(PdbrokerError):
    """A transfer request does not fit the layouts (block counts, ids out of range, ...)."""


class InvalidFieldError(PdbrokerError):
    """A field of an API request is malformed (empty id, unknown enum value, bad size)."""


class NotFoundError(PdbrokerError):
    """An engine, rank, lease, transfer or plan the broker does not know (any more)."""


class PreconditionError(PdbrokerError):
    """The request is well-formed but the system is not in a state to serve it (transfer
    expired or finished, engine not fully registered, rank disagrees with its engine)."""


class AlreadyExistsError(PdbrokerError):
    """A duplicate: a transfer id already published, a conflicting second plan request."""


class PermissionDeniedError(PdbrokerError):
    """The caller may not act on this object (a decode engine not allowed to read a transfer)."""


class AbortedError(PdbrokerError):
    """What a decode rank read is invalid: its transfer ended (expired, aborted, failed)
    while the rank was reading. The rank must recompute; it never gets DONE for it."""


class LimitExceededError(PdbrokerError):
    """A repeated field or one of the broker's tables exceeds its configured limit."""


class UnauthenticatedError(PdbrokerError):
    """The caller presented no credentials the broker accepts (no or an unknown token)."""


class StoreUnavailableError(PdbrokerError):
    """The state store cannot be reached in time (down, stalled, refusing connections);
    ``field`` is ``store`` and the message names the store, never its credentials. Another
    broker replica, or this one once the store is back, can serve the call."""


#: Trailing metadata of a release stream refused with :class:`CompactedError` (gRPC
#: OUT_OF_RANGE): the newest sequence no longer kept, in decimal.
COMPACTED_THROUGH_KEY = "pdbroker-compacted-through"


class CompactedError(PdbrokerError):
    """A release stream would resume before events the broker no longer keeps; ``through``
    is the newest sequence dropped (resume after it once reconciled)."""

    def __init__(self, field: str, message: str, through: int) -> None:
        super().__init__(field, message)
        self.through = through
