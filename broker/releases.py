"""What a prefill rank's release stream reads (:class:`ReleaseFeeds`): where a watcher
starts, the events after its cursor, and what was delivered. The events themselves are
queued by :mod:`broker.effects` as the transfer state machine releases ranks."""

from __future__ import annotations

from broker.effects import Effects, atomic
from broker.errors import CompactedError, NotFoundError, PreconditionError
from broker.records import RankKey, ReleaseEvent


class ReleaseFeeds:
    """Release events of prefill ranks, for their watchers; ``resume_window`` delivered
    events are kept per rank for streams that resume."""

    def __init__(self, effects: Effects, resume_window: int) -> None:
        self.effects = effects
        self.store = effects.store
        self.resume_window = resume_window

    def start(
        self, engine_id: str, tp_rank: int, after_sequence: int, lease_id: str = ""
    ) -> tuple[int, int]:
        """Start watching prefill rank ``(engine_id, tp_rank)``: returns its registration
        generation and the cursor to read from (``after_sequence``, or where the last
        watcher stopped when 0). A ``lease_id`` that is not the rank's current lease fails:
        the cursor was read under another registration, whose sequences these are not."""
        record = self.store.get_rank((engine_id, tp_rank))
        if record is None:
            field_name = "tp_rank" if self.store.engine_ranks(engine_id) else "engine_id"
            raise NotFoundError(
                field_name, f"engine {engine_id!r} has no registered rank {tp_rank}"
            )
        if not record.registration.role.publishes:
            raise PreconditionError("engine_id", f"engine {engine_id!r} is a decode engine")
        if lease_id and lease_id != record.lease_id:
            raise PreconditionError(
                "lease_id",
                f"not the current lease of rank {tp_rank}: it registered again since; "
                "watch under the new lease from after_sequence 0",
            )
        cursor = after_sequence or self.store.delivered((engine_id, tp_rank))
        self._check_kept((engine_id, tp_rank), cursor)
        return record.generation, cursor

    def after(self, key: RankKey, generation: int, cursor: int) -> list[ReleaseEvent] | None:
        """Events after ``cursor`` for the rank, or ``None`` once that registration is gone;
        :class:`CompactedError` when some of them are no longer kept."""
        record = self.store.get_rank(key)
        if record is None or record.generation != generation:
            return None
        self._check_kept(key, cursor)
        return self.store.releases_after(key, cursor)

    def _check_kept(self, key: RankKey, cursor: int) -> None:
        through = self.store.compacted_through(key)
        if cursor < through:
            raise CompactedError(
                "after_sequence",
                f"release events of rank {key[1]} after {cursor} through {through} are no "
                "longer kept; ask GetTransfer which of your transfers were released, then "
                f"watch from after_sequence {through}",
                through,
            )

    @atomic
    def delivered(self, key: RankKey, sequence: int) -> None:
        """A watcher sent events up to ``sequence``."""
        self.store.mark_delivered(key, sequence)
        self.store.trim_releases(key, self.resume_window)
