"""Values callers hand :class:`broker.service.BrokerService` and get back from it.

Plain frozen data, free of protobuf: :mod:`broker.convert` maps them to and from
``pdbroker.v1`` messages. Sizes are bytes, durations milliseconds unless named ``_us``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from broker.errors import PdbrokerError
from broker.records import ANY_DECODE_ENGINE, RankRecord, TransferRecord
from broker.wire import BlockIds, MemoryKind, ReportStatus, Role, TransferState


@dataclass(frozen=True)
class Lease:
    """A registered rank's lease: renew within ``ttl_ms``; ``generation`` is its engine's."""

    lease_id: str
    ttl_ms: int
    generation: int
    engine_complete: bool


@dataclass(frozen=True)
class Publication:
    """A prefill engine offers ``block_ids`` (per group) holding ``num_tokens`` tokens;
    ``ttl_ms`` 0 means the broker's default; empty ``allowed_decode_engines``: any;
    ``traceparent``: the publisher's W3C trace context, kept with the transfer."""

    transfer_id: str
    engine_id: str
    block_ids: BlockIds
    num_tokens: int
    ttl_ms: int = 0
    allowed_decode_engines: frozenset[str] = ANY_DECODE_ENGINE
    traceparent: str = ""


@dataclass(frozen=True)
class PlanQuery:
    """Decode rank ``tp_rank`` of ``engine_id`` asks for its reads into ``block_ids``;
    ``prefill_engine_id``: the publisher it expects ('' for any)."""

    transfer_id: str
    engine_id: str
    tp_rank: int
    block_ids: BlockIds
    want_agent_metadata: bool = False
    prefill_engine_id: str = ""


#: ``(transfer_id, prefill_engine_id)`` of a transfer a decode engine waits for ('' for the
#: prefill engine: whichever published that id).
TransferName = tuple[str, str]


@dataclass(frozen=True)
class Extension:
    """What extending one transfer did: its expiry and TTL now, or ``error``, why that
    entry was refused (then both are 0)."""

    expires_at_ms: int = 0
    ttl_ms: int = 0
    error: PdbrokerError | None = None


@dataclass(frozen=True)
class SourceDescriptors:
    """Reads from one prefill rank: ``local``/``remote`` are ``(n, 3)`` int64 rows
    ``(addr, len, dev_id)``; row *i* of ``local`` is filled from row *i* of ``remote``."""

    prefill_rank: int
    agent_name: str
    agent_metadata: bytes
    local: np.ndarray
    remote: np.ndarray
    total_bytes: int
    notification: bytes
    local_memory_kind: MemoryKind
    remote_memory_kind: MemoryKind

    @property
    def num_descriptors(self) -> int:
        return int(self.local.shape[0])


@dataclass(frozen=True)
class PlanResult:
    """One decode rank's plan; ``naive_bytes`` and ``vllm_descriptors`` are what copying
    whole padded pages and vLLM 0.33's per-block scheme would cost; ``traceparent`` the
    W3C trace context decode's read and report spans descend from."""

    plan_id: str
    sources: tuple[SourceDescriptors, ...]
    naive_bytes: int
    vllm_descriptors: int
    expires_at_ms: int
    traceparent: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self.sources)

    @property
    def num_descriptors(self) -> int:
        return sum(s.num_descriptors for s in self.sources)


@dataclass(frozen=True)
class Report:
    """A decode rank's outcome for one plan: bytes read and how long it took (us)."""

    plan_id: str
    engine_id: str
    tp_rank: int
    status: ReportStatus
    bytes_moved: int = 0
    duration_us: int = 0
    error: str = ""


@dataclass(frozen=True)
class ReportOutcome:
    """``intact``: recorded DONE while the transfer was live (its sources fenced), so the
    data is usable."""

    duplicate: bool
    state: TransferState
    intact: bool


@dataclass(frozen=True)
class EngineView:
    """An engine as operators see it: its registered ranks, by tp rank."""

    engine_id: str
    role: Role
    tp_size: int
    model_fingerprint: str
    generation: int
    ranks: tuple[RankRecord, ...] = field(default=())

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.tp_size


@dataclass(frozen=True)
class TransferListing:
    """The transfers the broker holds at ``now_ms``: ``counts`` of all of them by state, and
    ``transfers``: unfinished ones oldest first, then (if asked for) finished ones most recent
    first, cut at the requested limit."""

    now_ms: int
    counts: dict[TransferState, int]
    transfers: tuple[TransferRecord, ...]
