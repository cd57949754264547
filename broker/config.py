"""The broker service's settings (``pdbroker serve`` flags of the same names)."""

from __future__ import annotations

from dataclasses import dataclass

#: Threads that run a broker process's calls on a shared store (they take turns running
#: service code, and wait for Redis together: :mod:`broker.store.turns`).
STORE_THREADS = 4


@dataclass(frozen=True)
class ServiceConfig:
    """Durations in milliseconds."""

    default_ttl_ms: int = 30_000
    max_ttl_ms: int = 3_600_000
    lease_ttl_ms: int = 10_000
    #: How long finished transfers stay queryable (GetTransfer, idempotent reports).
    retention_ms: int = 60_000
    max_transfers: int = 100_000
    #: Registered ranks at once, over all engines.
    max_ranks: int = 4096
    #: Template bytes the cached planners hold (one planner per pair of engine layouts);
    #: the least recently used are dropped beyond it.
    planner_cache_bytes: int = 256 << 20
    #: Delivered release events kept per prefill rank for streams that resume.
    release_resume_window: int = 1024
    #: Bytes of release events (:attr:`~broker.records.ReleaseEvent.nbytes`) kept per prefill
    #: rank, delivered or not, and over all ranks; the oldest beyond either are dropped and a
    #: stream resuming before them is told so (:class:`~broker.errors.CompactedError`), so
    #: its client asks which of its transfers ended. The default per rank holds several
    #: events of requests at the block-id limit (8 MiB each).
    release_backlog_bytes: int = 64 << 20
    release_backlog_total_bytes: int = 1 << 30
    #: Per prefill engine: transfers holding block ids at once, those block ids, and the
    #: agent metadata of its ranks (bytes). One engine at a quota does not stop another.
    max_transfers_per_engine: int = 10_000
    max_block_ids_per_engine: int = 1 << 22
    max_metadata_bytes_per_engine: int = 128 << 20
    #: How long a live plan (handed out, not reported) may hold its prefill ranks after its
    #: transfer ended; then it counts as failed and they are released.
    max_read_ms: int = 60_000
    #: EngineSession streams open at once on one broker process (a decode client holds one).
    max_session_streams: int = 4096
