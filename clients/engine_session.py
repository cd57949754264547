"""The client side of ``EngineSession``: a decode engine's ``GetTransferPlans`` and
``ReportTransfers`` as messages on one open stream (an exchange costs both sides less than a
call), for :class:`~clients.protocol.FailoverStub`. The stream is opened on the replica calls
go to when first needed and carries one exchange at a time (one made meanwhile is made as
the unary call). When it cannot carry one (it broke, the broker refused it, or the broker
predates it: UNIMPLEMENTED, after which this client makes the unary calls for good) the
exchange is made as the unary call instead (for :data:`REFUSED_RETRY_S` after the broker
refused a stream for want of room); both
are safe to repeat after an unknown outcome (a plan asked again is the plan handed out
before, a report again is answered ``duplicate``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import grpc

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc

#: The calls a session carries, by the name of their field in a session message.
SESSION_CALLS = {"GetTransferPlans": "get_transfer_plans", "ReportTransfers": "report_transfers"}
_STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}
#: How long closing a client waits for the broker to end its stream (seconds).
CLOSE_WAIT_S = 1.0
#: How long a client whose stream the broker refused (RESOURCE_EXHAUSTED: it holds its
#: ``--max-session-streams``) makes the unary calls before it asks for a stream again (s).
REFUSED_RETRY_S = 30.0


class EngineSession:
    """One ``EngineSession`` stream of a client, opened on first use."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._stub: pb_grpc.BrokerStub | None = None
        self._call: Any = None  # the open stream (grpc.aio.StreamStreamCall)
        self._sequence = 0
        #: False once a broker answered UNIMPLEMENTED: this client makes the unary calls.
        self.enabled = True
        #: ``time.monotonic()`` before which no stream is asked for (one was refused).
        self._refused_until = 0.0

    async def exchange(
        self,
        stub: pb_grpc.BrokerStub,
        method: str,
        request: Any,
        timeout: float | None,
        metadata: Iterable[tuple[str, str]] | None,
    ) -> Any:
        """The response of ``method`` (one of :data:`SESSION_CALLS`) to ``request``, asked
        on the stream to ``stub``'s replica (the stream on another replica is closed first)
        and answered within ``timeout`` seconds; None when the stream cannot carry it (make
        the unary call): it broke, the broker lacks it, or another exchange holds it. A
        message the broker refused raises the status the call would have ended with
        (:class:`grpc.aio.AioRpcError`), as does an exchange that takes too long
        (DEADLINE_EXCEEDED: the stream is closed)."""
        if not self.enabled or self._lock.locked() or time.monotonic() < self._refused_until:
            return None
        async with self._lock:
            if self._stub is not stub:
                self.close()
                self._stub, self._call = stub, stub.EngineSession()
            call, expired = self._call, asyncio.Event()

            def expire() -> None:
                expired.set()
                call.cancel()

            loop = asyncio.get_running_loop()
            timer = None if timeout is None else loop.call_later(timeout, expire)
            try:
                return await self._exchange(call, SESSION_CALLS[method], request, metadata)
            except asyncio.CancelledError:
                self.close()  # the answer may still come: not on this stream
                if expired.is_set():
                    raise _status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline") from None
                raise
            finally:
                if timer is not None:
                    timer.cancel()

    async def _exchange(
        self,
        call: Any,
        field: str,
        request: Any,
        metadata: Iterable[tuple[str, str]] | None,
    ) -> Any:
        self._sequence += 1
        message = pb.EngineSessionRequest(
            sequence=self._sequence,
            traceparent=dict(metadata or ()).get("traceparent", ""),
            **{field: request},
        )
        try:
            await call.write(message)
            answer = await call.read()
        except grpc.aio.AioRpcError as exc:  # the stream ended with a status
            self.close()
            self.enabled = exc.code() is not grpc.StatusCode.UNIMPLEMENTED
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._refused_until = time.monotonic() + REFUSED_RETRY_S
            return None
        except Exception:  # noqa: BLE001 - the stream is unusable: the call goes unary
            self.close()
            return None
        if answer is grpc.aio.EOF or answer.sequence != self._sequence:
            self.close()
            return None
        if answer.WhichOneof("response") == "error":
            code = _STATUS_BY_CODE.get(answer.error.code, grpc.StatusCode.UNKNOWN)
            raise _status(code, answer.error.message)
        return getattr(answer, field)

    def close(self) -> None:
        """Close the stream (the next exchange opens another)."""
        call, self._call, self._stub = self._call, None, None
        if call is not None:
            call.cancel()

    async def aclose(self) -> None:
        """End the stream as a client done with it (the broker ends it in turn) and wait
        for its status, at most :data:`CLOSE_WAIT_S` (then cancel it): before its channel
        closes."""
        call, self._call, self._stub = self._call, None, None
        if call is None:
            return
        try:
            await call.done_writing()
            await asyncio.wait_for(call.code(), CLOSE_WAIT_S)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError):
            call.cancel()


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary call ending with ``code`` and ``details`` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
