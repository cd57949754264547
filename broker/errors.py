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


class LayoutError(PdbrokerError):
    """A layout declaration is malformed (a segment outside its page, a bad dtype, ...)."""


class IncompatibleLayoutsError(PdbrokerError):
    """Prefill and decode layouts describe different models or cannot be resharded."""


class RequestError(PdbrokerError):
    """A transfer request does not fit the layouts (block counts, ids out of range, ...)."""
