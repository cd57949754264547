"""Reads ahead of a unit of work's need, for :class:`~broker.store.redis.RedisStateStore`:
a mixin over the store's key naming and reads. The engines and ranks a unit is expected to
read (told by the service, or guessed from what this replica wrote) go with its next round
trip, watched like any read, and the reads that want them take them from there: an
engine's ranks (:meth:`RedisReadsAhead.engine_ranks`) and single ranks (``_ranks``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis

from broker.records import RankKey, RankRecord
from broker.store.redis_link import fails_fast
from broker.store.redis_unit import RANK_FIELDS, Command, ThreadUnits, Unit, rank_member

#: What keeps the replies to reads made ahead.
Keep = Callable[[list[Any]], None]


@fails_fast
class RedisReadsAhead:
    """Engines' ranks read in a unit, ahead when expected (:meth:`expect_engines`)."""

    client: redis.Redis
    _units: ThreadUnits
    #: The tp ranks of each engine when last read in a unit of work.
    _engine_members: dict[str, tuple[int, ...]]
    _key: Callable[..., bytes]
    _prefix_of: Callable[[str], str]
    _fetch: Callable[..., list[Any]]
    _run: Callable[..., Any]
    _ranks: Callable[..., list[RankRecord | None]]
    _decode_rank: Callable[[RankKey, list[bytes | None]], RankRecord | None]

    def engine_ranks(self, engine_id: str) -> list[RankRecord]:
        engine_key = self._key("engine", engine_id)
        if self._units.unit is None:  # one round trip
            rows = self._run(
                "engine", [engine_key], [self._prefix_of("rank"), engine_id], self.client
            )
            records = (self._decode_rank((engine_id, int(tp)), row) for tp, *row in rows)
            return sorted((r for r in records if r is not None), key=lambda r: r.key[1])
        unit = self._units.unit
        if engine_id not in unit.engines_ahead:
            self._read_engines([engine_id, *sorted(unit.near_engines - {engine_id})])
            unit.near_engines = frozenset()
        guess, (members, *rows) = unit.engines_ahead.pop(engine_id)
        tp_ranks = {int(m) for m in members}
        self._engine_members[engine_id] = tuple(sorted(tp_ranks))
        pending = unit.ranks
        tp_ranks |= {k[1] for k in pending if k[0] == engine_id}
        keys = [(engine_id, r) for r in sorted(tp_ranks)]
        read = {k: row for k, row in zip(guess, rows) if k not in pending}
        rest = [k for k in keys if k not in read]
        found = dict(zip(rest, self._ranks(rest)))
        records = (found[k] if k in found else self._decode_rank(k, read[k]) for k in keys)
        return [r for r in records if r is not None]

    def expect_engines(self, engine_ids: Iterable[str]) -> None:
        unit = self._units.unit
        if unit is not None:
            unit.engines_expected.update(e for e in engine_ids if e not in unit.engines_ahead)

    def _reads_ahead(self, unit: Unit) -> tuple[list[bytes], list[Command], Keep]:
        """The reads ``unit`` expects (then forgotten), to go with its next round trip: the
        keys to watch, the commands, and what keeps their replies for the unit."""
        engine_ids = sorted(unit.engines_expected)
        rank_keys = sorted(unit.ranks_expected - unit.ranks.keys())
        unit.engines_expected.clear()
        unit.ranks_expected.clear()
        watch, reads, guesses = self._engine_reads(engine_ids)
        rank_watch = [self._key("rank", rank_member(k)) for k in rank_keys]
        engine_replies = len(reads)

        def keep(replies: list[Any]) -> None:
            self._keep_engines_ahead(engine_ids, guesses, replies[:engine_replies])
            unit.ranks_ahead.update(zip(rank_keys, replies[engine_replies:]))

        rank_reads: list[Command] = [("HMGET", k, *RANK_FIELDS) for k in rank_watch]
        return [*watch, *rank_watch], [*reads, *rank_reads], keep

    def _read_engines(self, engine_ids: list[str]) -> None:
        """Read (and watch) the engines' sets of ranks in one round trip, each with the ranks
        it had when last read here (so one round trip unless they changed), for the unit's
        :meth:`engine_ranks` to take."""
        assert self._units.unit is not None
        watch, reads, guesses = self._engine_reads(engine_ids)
        self._keep_engines_ahead(engine_ids, guesses, self._fetch(watch, reads))

    def _engine_reads(
        self, engine_ids: list[str]
    ) -> tuple[list[bytes], list[Command], list[list[RankKey]]]:
        """The keys to watch and the reads of :meth:`_read_engines`, and the ranks guessed."""
        watch: list[bytes] = []
        reads: list[Command] = []
        guesses = []
        for engine_id in engine_ids:
            guess = [(engine_id, tp) for tp in self._engine_members.get(engine_id, ())]
            keys = [self._key("engine", engine_id)]
            keys += [self._key("rank", rank_member(k)) for k in guess]
            watch += keys
            reads += [("SMEMBERS", keys[0]), *(("HMGET", k, *RANK_FIELDS) for k in keys[1:])]
            guesses.append(guess)
        return watch, reads, guesses

    def _keep_engines_ahead(
        self, engine_ids: list[str], guesses: list[list[RankKey]], replies: list[Any]
    ) -> None:
        """The replies of :meth:`_engine_reads`, for the unit's :meth:`engine_ranks`."""
        assert self._units.unit is not None
        for engine_id, guess in zip(engine_ids, guesses):
            self._units.unit.engines_ahead[engine_id] = (guess, replies[: 1 + len(guess)])
            del replies[: 1 + len(guess)]
