"""What every Broker handler shares: the authorization rule of each call, and the status a
failure ends a call with (or answers an ``EngineSession`` message with): the code of each
error class, a message starting with the offending field's path."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from broker.auth import AccessGuard, Identity
from broker.errors import (
    COMPACTED_THROUGH_KEY,
    AbortedError,
    AlreadyExistsError,
    CompactedError,
    IncompatibleLayoutsError,
    LimitExceededError,
    NotFoundError,
    PdbrokerError,
    PermissionDeniedError,
    PreconditionError,
    StoreUnavailableError,
    UnauthenticatedError,
)

log = logging.getLogger(__name__)

#: Work that grows with a request runs on the worker thread past these sizes (smaller work
#: takes less than a thread hand-off): requests are parsed there past OFFLOAD_REQUEST_BYTES,
#: translated, checked and planned past OFFLOAD_BLOCK_IDS block ids, and plans turned into
#: descriptors and serialized past OFFLOAD_DESCRIPTORS descriptors.
OFFLOAD_REQUEST_BYTES = 256 << 10
OFFLOAD_BLOCK_IDS = 16_384
OFFLOAD_DESCRIPTORS = 32_768

#: First matching class wins; any other :class:`PdbrokerError` is INVALID_ARGUMENT.
_STATUS_BY_ERROR: tuple[tuple[type[PdbrokerError], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (IncompatibleLayoutsError, grpc.StatusCode.FAILED_PRECONDITION),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (AbortedError, grpc.StatusCode.ABORTED),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),  # another replica may serve it
    (CompactedError, grpc.StatusCode.OUT_OF_RANGE),
)


def status_code(exc: PdbrokerError) -> grpc.StatusCode:
    for cls, code in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


class Refused(Exception):
    """A request refused before its handler looks at it: ``code`` and ``detail`` say why."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


def failure_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status ``exc`` fails a call with: its code and message (INTERNAL, logged, for
    anything but our errors)."""
    if isinstance(exc, Refused):
        return exc.code, f"request: {exc.detail}"
    if isinstance(exc, PdbrokerError):
        return status_code(exc), str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with the status of ``exc`` (:func:`failure_status`)."""
    code, details = failure_status(exc)
    if isinstance(exc, CompactedError):
        trailing: tuple[tuple[str, str], ...] = ((COMPACTED_THROUGH_KEY, str(exc.through)),)
        await context.abort(code, details, trailing_metadata=trailing)
    await context.abort(code, details)


#: An RPC's authorization: raises unless the identified caller may make this request.
Rule = Callable[[AccessGuard, Identity, Any], object]


def as_engine(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.act_as(who, request.engine_id)


def registrant(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.register(who, request.engine_id, request.tp_rank)


def lease_holder(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.hold_lease(who, request.lease_id)


def plan_holder(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.act_as(who, request.engine_id)
    guard.report_plan(who, request.plan_id)


def transfer_party(guard: AccessGuard, who: Identity, request: Any) -> str:
    return guard.see_transfer(who, request.transfer_id, request.prefill_engine_id)


def operator(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.administer(who)
