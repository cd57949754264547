"""What one unit of work of :class:`~broker.store.redis.RedisStateStore` holds (its pending
writes, :class:`Unit`), the connection units watch and commit on (:class:`UnitLink`), how
records are named in Redis keys, and the decoded plans kept across units
(:class:`PlanBlobs`)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import redis

from broker.planner import RankPlan
from broker.records import RankKey, RankLoss, RankRecord, TransferKey, TransferRecord
from broker.store import codec
from broker.store.redis_link import read_replies
from broker.store.turns import waiting

Command = tuple[Any, ...]
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def pack(commands: list[Command]) -> bytes:
    """``commands`` in the Redis protocol, in one buffer; each argument bytes, text (sent
    as UTF-8) or a number. (redis-py's packing checks more types per argument, and costs a
    store call more CPU than the rest of its sending.)"""
    parts: list[bytes] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, str):
                arg = arg.encode()
            elif not isinstance(arg, bytes):
                if isinstance(arg, bool) or not isinstance(arg, (int, float)):
                    raise TypeError(f"{type(arg).__name__} {arg!r} is not a Redis argument")
                arg = repr(arg).encode()
            parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(parts)


def exchange(connection: Any, commands: list[Command]) -> list[Any]:
    """The raw replies to ``commands``, sent on ``connection`` at once (one round trip), with
    this thread's turn handed on meanwhile (:func:`~broker.store.turns.waiting`). An error
    reply, or no reply in time, raises and drops the connection (its other replies unread)."""
    return waiting(_exchange, connection, pack(commands), len(commands))


def _exchange(connection: Any, packed: bytes, count: int) -> list[Any]:
    connection.send_packed_command([packed])
    try:
        return read_replies(connection, count)
    except BaseException:
        connection.disconnect()
        raise


class UnitLink:
    """The connection that units of work (one at a time) watch keys and commit on. Keys are
    watched in the round trip that reads them (``WATCH`` first); a unit that ends without
    ``EXEC`` leaves its watches to be cleared by ``UNWATCH`` sent ahead of the next unit's
    first commands, not by a round trip of their own."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self.connection: Any = None
        #: Whether keys may still be watched from a unit that ended.
        self.stale = False

    def exchange(self, commands: list[Command]) -> list[Any]:
        """:func:`exchange` on this link's connection."""
        if self.connection is None:
            self.connection = self.pool.get_connection()
        if self.stale:
            self.stale = False
            return exchange(self.connection, [("UNWATCH",), *commands])[1:]
        return exchange(self.connection, commands)

    def commit(self, commands: list[Command]) -> list[Any] | None:
        """``commands`` in ``MULTI``/``EXEC``: their replies, or None when a watched key
        changed (nothing applied)."""
        replies = self.exchange([("MULTI",), *commands, ("EXEC",)])[-1]
        if replies is not None:
            for reply in replies:
                if isinstance(reply, redis.ResponseError):
                    raise reply
        return replies

    def drop(self) -> None:
        """Close the connection (its watches go with it)."""
        if self.connection is not None:
            self.connection.disconnect()
        self.stale = False


class Unit:
    """One attempt of :meth:`RedisStateStore.transact`: the keys it watched, the writes
    queued for ``EXEC`` (by record, so a record written twice is written once) and this
    attempt's own records, which its reads must see."""

    def __init__(self) -> None:
        self.watched: set[bytes] = set()
        self.ops: dict[object, Callable[[Any], Any]] = {}
        self.ranks: dict[RankKey, RankRecord | None] = {}
        self.transfers: dict[TransferKey, TransferRecord | None] = {}
        #: The rank losses as read in this attempt (None: not read yet) and its own writes.
        self.losses_read: dict[tuple[str, int, int], RankLoss] | None = None
        self.loss_writes: dict[tuple[str, int, int], RankLoss | None] = {}
        self.contacts: set[tuple[RankKey, str]] = set()
        #: The raw records of transfers read (and watched) ahead of their read, by key.
        self.read_ahead: dict[TransferKey, bytes | None] = {}
        #: The parties of the transfer read last: the next engine read reads theirs too.
        self.near_engines: frozenset[str] = frozenset()
        #: Engines read ahead: the ranks guessed, and the replies (set, then each guess).
        self.engines_ahead: dict[str, tuple[list[RankKey], list[Any]]] = {}
        #: Engines the unit will read: their ranks go with its next round trip.
        self.engines_expected: set[str] = set()
        #: Ranks the unit may read, to go with its next round trip; and those read so.
        self.ranks_expected: set[RankKey] = set()
        self.ranks_ahead: dict[RankKey, list[Any]] = {}
        #: Plans blobs this unit writes, by plan object id, and what to remember of them
        #: once it committed.
        self.plan_tokens: dict[int, str] = {}
        self.plan_blobs: dict[str, bytes] = {}
        self.on_commit: list[Callable[[], None]] = []

    def queue(self, op: Callable[[Any], Any], record: object = None) -> None:
        """Queue ``op``; one naming ``record`` replaces that record's earlier write."""
        slot = object() if record is None else record
        self.ops.pop(slot, None)
        self.ops[slot] = op


class ThreadUnits(threading.local):
    """A thread's unit of work in progress, and the connection its units watch and commit
    on."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.unit: Unit | None = None
        self.link = UnitLink(pool)


#: The fields of a rank's hash a read of its record takes, in order.
RANK_FIELDS = ("reg", "meta", "lease", "exp", "at", "gen")


def transfer_member(key: TransferKey) -> str:
    engine_id, transfer_id = key
    return f"{len(engine_id)}:{engine_id}:{transfer_id}"


def parse_transfer(member: bytes | str) -> TransferKey:
    text = member.decode() if isinstance(member, bytes) else member
    size, rest = text.split(":", 1)
    return rest[: int(size)], rest[int(size) + 1 :]


def rank_member(key: RankKey) -> str:
    return f"{key[1]}:{key[0]}"


def parse_rank(member: bytes | str) -> RankKey:
    text = member.decode() if isinstance(member, bytes) else member
    tp_rank, engine_id = text.split(":", 1)
    return engine_id, int(tp_rank)


class PlanBlobs:
    """Decoded plans by the token of the blob they were stored as, the newest ``max_runs``
    runs (32 bytes each), and the token of each cached plan object (by id: the cache keeps
    the object alive, so the id stays its own). A transfer written again with plans already
    stored writes only their token."""

    def __init__(self, max_runs: int = 4_000_000) -> None:
        self.max_runs = max_runs
        self._plans: dict[str, dict[int, RankPlan]] = {}
        self._tokens: dict[int, str] = {}
        self._runs = 0

    def get(self, token: str) -> dict[int, RankPlan] | None:
        return self._plans.get(token)

    def token_of(self, record: TransferRecord, unit: Unit | None) -> tuple[str, bytes]:
        """The token of the record's rank plans and, when they changed since they were last
        stored or read here, their blob (else ``b""``)."""
        plans = {p.decode_rank: p.rank_plan for p in record.plans}
        if not plans:
            return "", b""
        pending = {} if unit is None else unit.plan_tokens
        tokens = {pending.get(id(p), self._tokens.get(id(p))) for p in plans.values()}
        if len(tokens) == 1 and None not in tokens:
            token = tokens.pop()
            assert token is not None
            if unit is not None and token in unit.plan_blobs:  # written again in this unit
                return token, unit.plan_blobs[token]
            cached = self._plans.get(token)
            if (
                cached is not None
                and cached.keys() == plans.keys()
                and all(cached[d] is p for d, p in plans.items())
            ):
                return token, b""
        token, blob = secrets.token_hex(8), codec.encode_plans(plans)
        if unit is None:
            self.remember(token, plans)
        else:  # remembered only once written: a unit that does not commit writes no blob
            unit.plan_tokens.update((id(p), token) for p in plans.values())
            unit.plan_blobs[token] = blob
            unit.on_commit.append(lambda: self.remember(token, plans))
        return token, blob

    def remember(self, token: str, plans: dict[int, RankPlan]) -> None:
        """Remember decoded plans by token; the oldest go once more than
        ``max_runs`` runs are cached."""
        self._plans[token] = plans
        self._runs += sum(p.num_descriptors for p in plans.values())
        for plan in plans.values():
            self._tokens[id(plan)] = token
        while self._runs > self.max_runs and len(self._plans) > 1:
            old = self._plans.pop(next(iter(self._plans)))
            self._runs -= sum(p.num_descriptors for p in old.values())
            for plan in old.values():
                self._tokens.pop(id(plan), None)


class Recent(Generic[K, V]):
    """The newest ``size`` values put, by key (the oldest put is forgotten first)."""

    def __init__(self, size: int = 16_384) -> None:
        self.size = size
        self._values: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._values.get(key)

    def put(self, key: K, value: V) -> None:
        self._values.pop(key, None)
        self._values[key] = value
        if len(self._values) > self.size:
            del self._values[next(iter(self._values))]

    def forget(self, key: K) -> None:
        self._values.pop(key, None)
