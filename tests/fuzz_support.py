"""What the fuzz tests share (hypothesis: tests/test_fuzz.py; atheris: tests/fuzz_atheris.py).

:class:`LiveBroker` runs one in-process ``grpc.aio`` broker in a thread. :class:`Fuzzer` sends
raw request bytes to it over one channel and checks every reply: OK or a status of the
contract whose message starts with a field path (never UNKNOWN, INTERNAL or a hang), and for
every plan, that each descriptor lies inside a region the rank registered. It keeps a model
of what the broker accepted (registrations, leases, transfers, plans) from which
:class:`Requests` builds valid requests for the fuzzers to send as they are or mutated.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from broker_helpers import FakeClock, hybrid, register_request

from broker.server import BrokerServer
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.wire import DESCRIPTOR_BYTES, join_plan_chunks, unpack
from harness.scenarios import Scenario, build_scenario

SERVICE = pb.DESCRIPTOR.services_by_name["Broker"]
#: Method name → (request type, response type, server streaming).
METHODS: dict[str, tuple[type, type, bool]] = {
    m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name), m.server_streaming)
    for m in SERVICE.methods
}
#: Every status a bad request may get (ABORTED: a report on a transfer that ended while the
#: rank read); anything else (UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED but on a
#: waiting release stream) is a bug.
ALLOWED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
#: gRPC status codes by number (batched calls answer each entry with one).
_CODES = {code.value[0]: code for code in grpc.StatusCode}
#: Names a status message may start with: a field of some request, or the request itself.
FIELD_NAMES = frozenset(
    {"request"} | {f.name for m in SERVICE.methods for f in m.input_type.fields}
)
#: Longest any call may take before it counts as a hang, seconds.
CALL_TIMEOUT_S = 10.0
#: How long a release stream may wait silently before the fuzzer moves on, seconds.
STREAM_WAIT_S = 0.02
#: The fuzzers' engines (:class:`Requests`): prefill, decode, and a second decode engine.
PREFILL, DECODE, OTHER = "P", "D", "X"


@dataclass
class Model:
    """What the broker accepted so far, as the replies said."""

    #: ``(engine, tp_rank)`` → ``(3, n)`` base, length, device of its registered regions.
    regions: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    #: Live ranks that publish (releases may be streamed to them).
    publishers: set[tuple[str, int]] = field(default_factory=set)
    leases: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Transfer id → prefill engine.
    transfers: dict[str, str] = field(default_factory=dict)
    #: ``(plan_id, decode engine, tp_rank, total_bytes)`` of every plan handed out.
    plans: list[tuple[str, str, int, int]] = field(default_factory=list)
    #: Inputs sent, and how many were answered OK.
    inputs: int = 0
    ok: int = 0


class LiveBroker:
    """A real broker on an ephemeral port, its event loop in a daemon thread."""

    def __init__(self) -> None:
        self.service = BrokerService(clock=FakeClock())
        self.server = BrokerServer(self.service, "127.0.0.1:0")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(CALL_TIMEOUT_S)
        self.channel = grpc.insecure_channel(self.server.address)

    def stop(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(CALL_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CALL_TIMEOUT_S)
        self.loop.close()


class Fuzzer:
    """Sends raw request bytes to a :class:`LiveBroker` and checks each reply."""

    def __init__(self, broker: LiveBroker) -> None:
        self.model = Model()
        self._calls = {
            name: (broker.channel.unary_stream if streaming else broker.channel.unary_unary)(
                f"/{SERVICE.full_name}/{name}"
            )
            for name, (_, _, streaming) in METHODS.items()
        }

    def call(self, method: str, payload: bytes) -> bytes | None:
        """Send ``payload`` to ``method``; the reply's bytes if OK (a stream: its first event,
        or ``b""`` while it waits), None for an allowed error status; AssertionError
        otherwise."""
        request_type, response_type, streaming = METHODS[method]
        self.model.inputs += 1
        try:
            request = request_type.FromString(payload)
        except Exception:  # noqa: BLE001 - the broker must refuse it as INVALID_ARGUMENT
            request = None
        try:
            if method == "StreamTransferPlan":  # a finite stream: the whole plan
                chunks = self._calls[method](payload, timeout=CALL_TIMEOUT_S)
                parsed = (response_type.FromString(chunk) for chunk in chunks)
                reply = join_plan_chunks(parsed).SerializeToString()
                streaming = False
            elif method == "EngineSession":  # one message, answered by one, then the end
                replies = list(self._calls[method](payload, timeout=CALL_TIMEOUT_S))
                assert len(replies) == 1, f"{method}: {len(replies)} answers to one message"
                reply, streaming = replies[0], False
            elif streaming:
                reply = self._first_event(method, payload, request)
            else:
                reply = self._calls[method](payload, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            self._check_error(method, err)
            return None
        self.model.ok += 1
        if request is not None and not streaming:
            self._accepted(method, request, response_type.FromString(reply))
        return reply

    def _first_event(self, method: str, payload: bytes, request) -> bytes:
        """A release stream's first event, ``b""`` if it ended cleanly or waits (only a
        publishing rank's stream may wait; anything else must answer at once)."""
        waiting_ok = request is not None and (request.engine_id, request.tp_rank) in (
            self.model.publishers
        )
        stream = self._calls[method](
            payload, timeout=STREAM_WAIT_S if waiting_ok else CALL_TIMEOUT_S
        )
        try:
            return next(stream, b"")
        except grpc.RpcError as err:
            if waiting_ok and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return b""
            raise
        finally:
            stream.cancel()

    @classmethod
    def _check_error(cls, method: str, err: grpc.RpcError) -> None:
        cls._check_status(method, err.code(), err.details() or "")

    @staticmethod
    def _check_status(method: str, code: grpc.StatusCode, details: str) -> None:
        assert code in ALLOWED, f"{method}: {code.name} {details}"
        head = details.split(": ", 1)[0].split(".", 1)[0].split("[", 1)[0]
        assert head in FIELD_NAMES, f"{method}: {code.name} message names no field: {details}"

    def _accepted(self, method: str, request, reply) -> None:
        """Check an OK reply against the model, then record what it changed."""
        model = self.model
        if method == "RegisterRank":
            key = (request.engine_id, request.tp_rank)
            for lease, held in list(model.leases.items()):
                if held == key:
                    del model.leases[lease]
            model.leases[reply.lease_id] = key
            model.regions[key] = np.array(
                [[r.base_addr, r.length_bytes, r.device_id] for r in request.regions],
                dtype=np.int64,
            ).T.reshape(3, -1)
            (model.publishers.add if request.role != pb.ROLE_DECODE else model.publishers.discard)(
                key
            )
        elif method == "Deregister":
            key = model.leases.pop(request.lease_id)
            model.regions.pop(key, None)
            model.publishers.discard(key)
        elif method == "PublishBlocks":
            model.transfers[request.transfer_id] = request.engine_id
        elif method in ("GetTransferPlan", "StreamTransferPlan"):
            self._plan_handed_out(request, reply)
        elif method in ("GetTransferPlans", "ReportTransfers"):
            entries = request.entries if method == "GetTransferPlans" else request.reports
            assert len(reply.results) == len(entries)
            for entry, result in zip(entries, reply.results):
                if result.code:
                    self._check_status(method, _CODES[result.code], result.message)
                elif method == "GetTransferPlans":
                    entry.engine_id = request.engine_id
                    self._plan_handed_out(entry, result.plan)
        elif method == "EngineSession":  # the answer of the call it carried, or its status
            assert reply.sequence == request.sequence
            answer = reply.WhichOneof("response")
            if answer == "error":
                self._check_status(method, _CODES[reply.error.code], reply.error.message)
            else:
                carried = request.WhichOneof("request")
                assert answer == carried, f"{method}: {answer} answers {carried}"
                call = "".join(word.title() for word in carried.split("_"))
                self._accepted(call, getattr(request, carried), getattr(reply, answer))

    def _plan_handed_out(self, request: pb.GetTransferPlanRequest, reply) -> None:
        self._check_plan(request, reply)
        self.model.plans.append(
            (reply.plan_id, request.engine_id, request.tp_rank, reply.total_bytes)
        )

    def _check_plan(self, request: pb.GetTransferPlanRequest, reply) -> None:
        """Every descriptor inside a region of the asking rank (local) and of the source
        prefill rank (remote); lengths and totals agree."""
        prefill = self.model.transfers[request.transfer_id]
        total = 0
        for source in reply.sources:
            assert len(source.local_descriptors) % DESCRIPTOR_BYTES == 0
            local, remote = unpack(source.local_descriptors), unpack(source.remote_descriptors)
            assert len(local) == len(remote) == source.num_descriptors
            assert (local[:, 1] == remote[:, 1]).all()
            assert_within(local, self.model.regions[(request.engine_id, request.tp_rank)])
            assert_within(remote, self.model.regions[(prefill, source.prefill_rank)])
            assert source.total_bytes == int(local[:, 1].sum())
            total += source.total_bytes
        assert reply.total_bytes == total


def assert_within(descriptors: np.ndarray, regions: np.ndarray) -> None:
    """Every ``(addr, len, dev)`` row lies inside one of ``regions`` (``(3, n)`` base,
    length, device) and names its device. Python integers: no overflow can hide a miss."""
    for addr, length, dev in descriptors.tolist():
        assert length > 0, f"descriptor of {length} bytes"
        assert any(
            base <= addr and addr + length <= base + size and dev == device
            for base, size, device in regions.T.tolist()
        ), f"descriptor ({addr:#x}, {length}, {dev}) outside every registered region"


@dataclass(frozen=True)
class Engine:
    engine_id: str
    role: int
    index: int
    scenario: Scenario
    prefill_side: bool

    @property
    def layout(self):
        return self.scenario.prefill if self.prefill_side else self.scenario.decode

    @property
    def block_ids(self) -> tuple[tuple[int, ...], ...]:
        request = self.scenario.request
        return request.prefill_block_ids if self.prefill_side else request.decode_block_ids


#: Picks one of a sequence (the fuzzer's choice).
Pick = Callable[[Sequence], object]


class Requests:
    """Valid requests for the current model state: prefill ``P`` (TP 2) publishes to decode
    ``D`` (TP 4) or ``X`` (TP 1) of a small Mamba2 + attention model. Leases and transfers
    of other engines are never picked."""

    def __init__(self, model: Model) -> None:
        self.model = model
        wide, narrow = build_scenario(hybrid(), 2, 4, 100), build_scenario(hybrid(), 2, 1, 100)
        self.engines = {
            PREFILL: Engine(PREFILL, pb.ROLE_PREFILL, 0, wide, True),
            DECODE: Engine(DECODE, pb.ROLE_DECODE, 1, wide, False),
            OTHER: Engine(OTHER, pb.ROLE_DECODE, 2, narrow, False),
        }
        # Only X deregisters: a lost P or D rank fails every transfer in flight.
        self.builders: dict[str, Callable[[Pick], object]] = {
            "RegisterRank": self.register,
            "KeepAlive": lambda pick: pb.KeepAliveRequest(lease_id=self._lease(pick)),
            "Deregister": lambda pick: pb.DeregisterRequest(lease_id=self._lease(pick, OTHER)),
            "PublishBlocks": self.publish,
            "GetTransferPlan": self.plan,
            "StreamTransferPlan": self.plan,
            "ReportTransfer": self.report,
            "GetTransferPlans": lambda pick: pb.GetTransferPlansRequest(
                engine_id=pick([DECODE, OTHER]),
                entries=[self._entry(self.plan(pick), pick) for _ in range(pick([0, 1, 3]))],
            ),
            "ReportTransfers": lambda pick: pb.ReportTransfersRequest(
                engine_id=pick([DECODE, OTHER]),
                reports=[self._entry(self.report(pick), pick) for _ in range(pick([0, 1, 3]))],
            ),
            "WatchReleases": lambda pick: pb.WatchReleasesRequest(
                engine_id=PREFILL, tp_rank=pick([0, 1]), after_sequence=pick([0, 1, 1 << 40])
            ),
            "ExtendTransfers": lambda pick: pb.ExtendTransfersRequest(
                engine_id=pick([DECODE, OTHER]),
                transfers=[
                    pb.TransferName(
                        transfer_id=self._transfer(pick), prefill_engine_id=pick(["", PREFILL])
                    )
                    for _ in range(pick([0, 1, 3]))
                ],
            ),
            "AbortTransfer": lambda pick: pb.AbortTransferRequest(
                transfer_id=self._transfer(pick), reason=pick(["", "user left"])
            ),
            "ListEngines": lambda pick: pb.ListEnginesRequest(),
            "GetTransfer": lambda pick: pb.GetTransferRequest(transfer_id=self._transfer(pick)),
            "ListTransfers": lambda pick: pb.ListTransfersRequest(
                include_finished=pick([False, True]), limit=pick([0, 1, 10])
            ),
        }
        self.builders["EngineSession"] = self.session
        assert set(self.builders) == set(METHODS)
        self._fresh = (f"t{i}" for i in itertools.count())

    def every_rank(self) -> list[pb.RegisterRankRequest]:
        """Registrations of every rank of every engine."""
        return [
            register_request(e.layout, e.engine_id, e.role, r, e.index)
            for e in self.engines.values()
            for r in range(e.layout.tp_size)
        ]

    def session(self, pick: Pick) -> pb.EngineSessionRequest:
        """One EngineSession message carrying a batched call's request."""
        carried = pick(["get_transfer_plans", "report_transfers"])
        call = "".join(word.title() for word in carried.split("_"))
        inner = self.builders[call](pick)
        return pb.EngineSessionRequest(sequence=pick([0, 1, 1 << 63]), **{carried: inner})

    def register(self, pick: Pick) -> pb.RegisterRankRequest:
        """A rank that is not registered, else any (re-registering fails its transfers)."""
        ranks = [(e, r) for e in self.engines.values() for r in range(e.layout.tp_size)]
        missing = [(e, r) for e, r in ranks if (e.engine_id, r) not in self.model.regions]
        engine, rank = pick(missing or ranks)
        return register_request(engine.layout, engine.engine_id, engine.role, rank, engine.index)

    def publish(self, pick: Pick) -> pb.PublishBlocksRequest:
        engine = self.engines[PREFILL]
        return pb.PublishBlocksRequest(
            transfer_id=next(self._fresh) if pick([True, True, False]) else self._transfer(pick),
            engine_id=PREFILL,
            block_ids=[pb.BlockIds(ids=g) for g in engine.block_ids],
            num_tokens=pick([engine.scenario.request.num_tokens, 1, 64]),
            ttl_ms=pick([0, 60_000]),
            allowed_decode_engines=pick([[], [DECODE], [OTHER]]),
        )

    def plan(self, pick: Pick) -> pb.GetTransferPlanRequest:
        engine = self.engines[pick([DECODE, OTHER])]
        return pb.GetTransferPlanRequest(
            transfer_id=self._transfer(pick),
            engine_id=engine.engine_id,
            tp_rank=pick(range(engine.layout.tp_size)),
            block_ids=[pb.BlockIds(ids=g) for g in engine.block_ids],
            want_agent_metadata=pick([False, True]),
        )

    def report(self, pick: Pick) -> pb.ReportTransferRequest:
        plan_id, engine_id, rank, total = pick(self.model.plans or [("p", DECODE, 0, 0)])
        return pb.ReportTransferRequest(
            plan_id=plan_id,
            engine_id=engine_id,
            tp_rank=rank,
            status=pick([pb.REPORT_STATUS_DONE] * 3 + [pb.REPORT_STATUS_FAILED]),
            bytes_moved=pick([total, 0]),
            duration_us=pick([0, 1234]),
            error=pick(["", "nixl: timeout"]),
        )

    @staticmethod
    def _entry(entry, pick: Pick):
        """A batched call's entry: naming its engine, or leaving that to the call."""
        if pick([False, True]):
            entry.engine_id = ""
        return entry

    def _lease(self, pick: Pick, engine_id: str | None = None) -> str:
        """A lease of ``engine_id`` (None: of any engine here)."""
        engines = set(self.engines) if engine_id is None else {engine_id}
        leases = [lease for lease, (engine, _) in self.model.leases.items() if engine in engines]
        return pick(leases or ["no-lease"])

    def _transfer(self, pick: Pick) -> str:
        """One of the last few transfers (older ones have mostly ended)."""
        transfers = [t for t, engine in self.model.transfers.items() if engine == PREFILL]
        return pick(transfers[-4:] or ["t0"])
