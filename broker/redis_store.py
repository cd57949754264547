"""A :class:`~broker.state.StateStore` in Redis, shared by broker replicas.

Keys (``P`` is the prefix, ``R`` a rank ``"{tp_rank}:{engine_id}"``):

=========================  ==========================================================
``P counter:NAME``         ``INCR`` counters (generations, release sequences)
``P rank:R``               hash: ``reg`` (``RegisterRankRequest`` bytes), ``lease``, ``exp``,
                           ``at``, ``gen``; index sets ``P ranks`` and ``P engine:ID``
``P lease:LEASE``          ``R`` of the rank holding that lease
``P transfer:ID``          hash: ``m`` (JSON record naming its plans' token), ``d``
                           (deadline), ``ids`` (plan ids), ``p`` (plans blob); set
                           ``P transfers``
``P deadlines``            sorted set: transfer id by deadline (ms)
``P usage:ENGINE``         hash: ``t`` transfers and ``i`` block ids a prefill engine's
                           transfers hold (each transfer's own share in its field ``q``)
``P plan:PLAN``            transfer id of a plan
``P contacts:R``           set of agents a decode rank was given metadata for
``P releases:R``           stream: release events, entry id ``SEQUENCE-0``, fields ``e``
                           (JSON event) and ``b`` (its backlog bytes)
``P cursor:R``             the largest sequence delivered to a watcher (durable cursor)
``P backlog:R``            hash: ``bytes`` of the rank's kept events, ``compacted`` (the
                           newest sequence dropped); ``P backlog`` all ranks' bytes, sorted
                           set ``P backlogs`` each rank's
=========================  ==========================================================

**Server-side TTLs.** Lease *expiry* stays the service's decision (it must fail the rank's
transfers and release their blocks), but every rank, lease, contact, stream and cursor key
carries a Redis TTL of ``rank_ttl_ms`` refreshed by each ``put_rank`` (each keep-alive), and
transfer and plan keys one of ``transfer_ttl_ms`` refreshed by each ``put_transfer``: if every
broker dies, Redis forgets what nobody renews. Index entries whose record expired that way are
skipped and removed when read.

**Replicas.** Outside :meth:`RedisStateStore.transact` every call applies at once, which is
exactly the interface's get → mutate → put contract and safe for one broker. Two replicas must
run each service operation through :meth:`~RedisStateStore.transact`: its reads ``WATCH`` the
keys they return, its writes are queued and applied in one ``MULTI``/``EXEC`` that fails if any
watched key changed, and the operation then runs again on fresh records. So two replicas never
both claim a transfer, both count one report or both release a prefill rank. Release sequences
are taken from ``P counter:release`` inside the commit (a Lua script), so they grow per stream
in commit order and a cursor never skips an event; each commit publishes the rank on
``P releases`` for :meth:`~RedisStateStore.subscribe_releases`.

**Outages.** Every connect and every reply has a deadline (``timeout_ms``, no retries), so a
stalled or dead Redis fails a call within it and never holds the caller (the server's event
loop) longer. Such a failure raises :class:`~broker.errors.StoreUnavailableError` (gRPC
UNAVAILABLE) naming the store, and from then on every call fails at once, without touching
Redis, until a background thread's ``PING`` is answered again (every
:data:`PROBE_INTERVAL_S`): the event loop is blocked at most once per outage.

Values: plans are stored once per change as one blob (a JSON header and the int64 columns of
every :class:`~broker.planner.SourceReads`), the rest of a transfer as compact JSON; decoded
plans and registrations are cached by content token and generation, so the many reads that
change only counters move and decode only the small JSON part.
"""

from __future__ import annotations

import json
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, fields
from functools import wraps
from types import FunctionType
from typing import Any, TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.convert import registration_from_proto, registration_to_proto
from broker.errors import StoreUnavailableError
from broker.planner import RankPlan, SourceReads
from broker.records import (
    PlanRecord,
    RankKey,
    RankRecord,
    RankRegistration,
    ReleaseEvent,
    TimelineEntry,
    TransferRecord,
)
from broker.state import StateStore, held_block_ids
from broker.v1 import broker_pb2 as pb
from broker.wire import ReleaseReason, ReportStatus, TransferState

T = TypeVar("T")

#: How often a due transfer is handed out again if the reaper that got it never put it back.
REDELIVER_MS = 5_000
#: Plan runs (32 bytes each) kept decoded in memory across transfers.
PLAN_CACHE_RUNS = 4_000_000
#: Default deadline of one connect or reply (ms): a store that takes longer is unavailable.
STORE_TIMEOUT_MS = 1_000
#: Pause between probes of an unavailable store (seconds).
PROBE_INTERVAL_S = 0.1
#: What a store that cannot be reached in time raises.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)
_RANK_FIELDS = ("reg", "lease", "exp", "at", "gen")
_COLUMNS = 4  # region, local_offset, remote_offset, length

# KEYS: rank, ranks, engine, lease, stream, cursor, contacts, backlog
# ARGV: member, tp_rank, reg, lease_id, expires, registered, generation, ttl_ms, lease prefix
_PUT_RANK = """
local old = redis.call('HGET', KEYS[1], 'lease')
if old and old ~= ARGV[4] then redis.call('DEL', ARGV[9] .. old) end
redis.call('HSET', KEYS[1], 'reg', ARGV[3], 'lease', ARGV[4], 'exp', ARGV[5], 'at', ARGV[6],
           'gen', ARGV[7])
redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[8])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
for i = 1, 8 do
  if i ~= 2 and i ~= 3 then redis.call('PEXPIRE', KEYS[i], ARGV[8]) end
end
"""
# Release backlog accounting shared by the scripts below: ARGV[1] is the key prefix. drop()
# forgets the oldest `count` events of rank `member` (all of them with count < 0).
_BACKLOG = """
local prefix = ARGV[1]
local function drop(member, count)
  local stream, backlog = prefix .. 'releases:' .. member, prefix .. 'backlog:' .. member
  local entries = redis.call('XRANGE', stream, '-', '+', 'COUNT', count < 0 and 1000000000 or count)
  local size, last = 0, nil
  for _, entry in ipairs(entries) do
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'b' then size = size + tonumber(fields[i + 1]) end
    end
    redis.call('XDEL', stream, entry[1])
    last = entry[1]
  end
  if last then
    redis.call('HINCRBY', backlog, 'bytes', -size)
    redis.call('HSET', backlog, 'compacted', string.match(last, '^(%d+)'))
    redis.call('DECRBY', prefix .. 'backlog', size)
    redis.call('ZINCRBY', prefix .. 'backlogs', -size, member)
  end
  return #entries
end
"""
# KEYS: rank, ranks, engine; ARGV: member, tp_rank, lease prefix
_DELETE_RANK = """
local old = redis.call('HGET', KEYS[1], 'lease')
if old then redis.call('DEL', ARGV[3] .. old) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[2])
"""
# KEYS: engine; ARGV: rank key prefix, engine id. Returns [tp_rank, reg, lease, exp, at, gen]
# per member of the engine's set.
_ENGINE = """
local rows = {}
for _, tp in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local row = redis.call('HMGET', ARGV[1] .. tp .. ':' .. ARGV[2], 'reg', 'lease', 'exp', 'at', 'gen')
  table.insert(rows, {tp, unpack(row)})
end
return rows
"""
# A transfer's hold on its prefill engine's quota: field `q` of its hash (block ids held) is
# counted in the usage hash named by its field `u` (`t` transfers, `i` block ids). recount()
# replaces it.
_USAGE = """
local function recount(transfer, usage, held)
  local before = tonumber(redis.call('HGET', transfer, 'q') or '0')
  if before == held then return end
  if before > 0 then
    redis.call('HINCRBY', usage, 't', -1)
    redis.call('HINCRBY', usage, 'i', -before)
  end
  if held > 0 then
    redis.call('HINCRBY', usage, 't', 1)
    redis.call('HINCRBY', usage, 'i', held)
  end
  redis.call('HSET', transfer, 'q', held, 'u', usage)
end
"""
# KEYS: transfer, deadlines, transfers, usage
# ARGV: id, meta, deadline, plan ids, plans or '', ttl_ms, block ids held
_PUT_TRANSFER = (
    _USAGE
    + """
if redis.call('HGET', KEYS[1], 'd') ~= ARGV[3] then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
end
recount(KEYS[1], KEYS[4], tonumber(ARGV[7]))
redis.call('HSET', KEYS[1], 'm', ARGV[2], 'd', ARGV[3], 'ids', ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'p', ARGV[5]) end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[4], ARGV[6])
redis.call('SADD', KEYS[3], ARGV[1])
"""
)
# KEYS: transfer, deadlines, transfers; ARGV: id, plan key prefix
_DELETE_TRANSFER = (
    _USAGE
    + """
local usage = redis.call('HGET', KEYS[1], 'u')
if usage then recount(KEYS[1], usage, 0) end
local ids = redis.call('HGET', KEYS[1], 'ids')
if ids then
  for plan in string.gmatch(ids, '%S+') do redis.call('DEL', ARGV[2] .. plan) end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
"""
)
# KEYS: deadlines; ARGV: now, redeliver at. Hands each due id out once per REDELIVER_MS.
_DUE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return ids
"""
# KEYS: stream, counter, backlog; ARGV: prefix, event, channel, member, ttl_ms, bytes,
# rank budget, total budget. Returns the sequence.
_APPEND = (
    _BACKLOG
    + """
local member = ARGV[4]
local seq = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], seq .. '-0', 'e', ARGV[2], 'b', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('HINCRBY', KEYS[3], 'bytes', ARGV[6])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('INCRBY', prefix .. 'backlog', ARGV[6])
redis.call('ZINCRBY', prefix .. 'backlogs', ARGV[6], member)
while tonumber(redis.call('HGET', KEYS[3], 'bytes')) > tonumber(ARGV[7]) do
  if drop(member, 1) == 0 then break end
end
while tonumber(redis.call('GET', prefix .. 'backlog')) > tonumber(ARGV[8]) do
  local top = redis.call('ZREVRANGE', prefix .. 'backlogs', 0, 0, 'WITHSCORES')
  if #top == 0 then break end
  if drop(top[1], 1) == 0 then  -- its stream expired with its rank: forget what it counted
    redis.call('ZREM', prefix .. 'backlogs', top[1])
    redis.call('DECRBY', prefix .. 'backlog', math.floor(tonumber(top[2])))
  end
end
redis.call('PUBLISH', ARGV[3], member)
return seq
"""
)
# KEYS: cursor; ARGV: sequence, ttl_ms
_MARK = """
if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
"""
# KEYS: stream, cursor; ARGV: prefix, member, keep. Keeps every undelivered event and `keep`
# delivered ones.
_TRIM = (
    _BACKLOG
    + """
local cursor = redis.call('GET', KEYS[2])
if not cursor then return 0 end
local delivered = #redis.call('XRANGE', KEYS[1], '-', cursor .. '-0')
local keep = tonumber(ARGV[3])
if delivered > keep then return drop(ARGV[2], delivered - keep) end
return 0
"""
)
# KEYS: stream, cursor, backlog; ARGV: prefix, member, channel. Forgets the rank's queue.
_DROP = (
    _BACKLOG
    + """
drop(ARGV[2], -1)
-- Whatever the rank still counts (events written before backlogs were counted) goes too.
local left = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
redis.call('DECRBY', prefix .. 'backlog', left)
redis.call('ZREM', prefix .. 'backlogs', ARGV[2])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('PUBLISH', ARGV[3], ARGV[2])
"""
)


class ConflictError(RuntimeError):
    """:meth:`RedisStateStore.transact` kept losing races with other replicas."""


class _Tx:
    """One attempt of :meth:`RedisStateStore.transact`: the watching connection, the writes
    queued for ``EXEC`` and this attempt's own writes, which its reads must see."""

    def __init__(self, pipe: redis.client.Pipeline) -> None:
        self.pipe = pipe
        self.watched: set[bytes] = set()
        self.ops: list[Callable[[redis.client.Pipeline], Any]] = []
        self.ranks: dict[RankKey, RankRecord | None] = {}
        self.transfers: dict[str, TransferRecord | None] = {}
        self.contacts: set[tuple[RankKey, str]] = set()


#: The user information of a URL, up to its last ``@`` (a password may hold ``@``, ``/``, ``?``).
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>.*)@", re.DOTALL)
_PASSWORD_PARAM = re.compile(r"(?P<key>[?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` as it may be logged or shown: its password (``redis://:PASSWORD@HOST``,
    ``redis://USER:PASSWORD@HOST``, ``?password=PASSWORD``) replaced by ``***``; user
    information without a ``:`` is hidden whole."""

    def userinfo(match: re.Match[str]) -> str:
        user, colon, _ = match["userinfo"].partition(":")
        return f"{match['scheme']}{user}:***@" if colon else f"{match['scheme']}***@"

    return _PASSWORD_PARAM.sub(r"\g<key>***", _USERINFO.sub(userinfo, url, count=1))


def _fails_fast(cls: type[T]) -> type[T]:
    """Every public method of ``cls``: while the store is known to be unavailable, raise
    :class:`StoreUnavailableError` at once; when Redis cannot be reached in time, raise it
    and start probing (see the module docstring)."""

    def guard(method: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(method)
        def guarded(self: RedisStateStore, *args: Any, **kwargs: Any) -> Any:
            if self._outage is not None:
                raise self._unavailable()
            try:
                return method(self, *args, **kwargs)
            except _UNREACHABLE as exc:
                raise self._lost(exc) from None

        return guarded

    for name, method in list(vars(cls).items()):
        if isinstance(method, FunctionType) and not name.startswith("_"):
            setattr(cls, name, guard(method))
    return cls


def _raise_if_broken(exc: Exception) -> None:
    """Raise the connection error behind a ``WatchError`` (redis-py's answer when a watching
    connection breaks); a lost race is not one."""
    if isinstance(exc, redis.WatchError) and isinstance(exc.__context__, _UNREACHABLE):
        raise exc.__context__ from None


def _store_name(client: redis.Redis) -> str:
    """``redis://HOST:PORT/DB`` (or ``unix://PATH``) of ``client``'s server, without
    credentials."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"{scheme}://{host}:{port}/{db}"


@_fails_fast
class RedisStateStore(StateStore):
    """Records in one Redis server (or primary); see the module docstring.

    ``rank_ttl_ms`` must exceed the service's lease TTL and ``transfer_ttl_ms`` the longest
    transfer TTL plus retention, so Redis never forgets what the service still needs.
    Not thread-safe, like the service: use it from one thread (callbacks of
    :meth:`subscribe_releases` run on their own).
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "pdbroker:",
        *,
        rank_ttl_ms: int = 60_000,
        transfer_ttl_ms: int = 3_720_000,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.rank_ttl_ms = rank_ttl_ms
        self.transfer_ttl_ms = transfer_ttl_ms
        self._tx: _Tx | None = None
        #: Decoded registrations by rank: (generation, registration).
        self._registrations: dict[RankKey, tuple[int, RankRegistration]] = {}
        #: Decoded plans by blob token, and the token of each cached plan
        #: object (by id: the cache keeps the object alive, so the id stays its own).
        self._plans: dict[str, dict[int, RankPlan]] = {}
        self._plan_tokens: dict[int, str] = {}
        self._cached_runs = 0
        #: How errors name the store: its address, never its credentials.
        self.name = _store_name(client)
        #: Why the store is unavailable (None: it is not known to be); set by the call that
        #: could not reach it, cleared by the probe that got an answer.
        self._outage: str | None = None
        self._outage_lock = threading.Lock()
        scripts = {
            "put_rank": _PUT_RANK,
            "delete_rank": _DELETE_RANK,
            "engine": _ENGINE,
            "put_transfer": _PUT_TRANSFER,
            "delete_transfer": _DELETE_TRANSFER,
            "due": _DUE,
            "append": _APPEND,
            "mark": _MARK,
            "trim": _TRIM,
            "drop": _DROP,
        }
        self._scripts = {name: client.register_script(text) for name, text in scripts.items()}

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "pdbroker:", *, timeout_ms: int = STORE_TIMEOUT_MS, **ttls: int
    ) -> RedisStateStore:
        """A store on ``redis://HOST:PORT/DB`` (``rediss://`` for TLS, ``unix://`` too) whose
        connects and replies each time out after ``timeout_ms``, never retried (the caller
        gets UNAVAILABLE and may go to another replica)."""
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_ms / 1000,
            socket_connect_timeout=timeout_ms / 1000,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=30,
        )
        return cls(client, prefix, **ttls)

    # ------------------------------------------------------------------ availability

    @property
    def available(self) -> bool:
        """False from a call that could not reach Redis in time until a probe is answered."""
        return self._outage is None

    def _unavailable(self, why: str | None = None) -> StoreUnavailableError:
        """The error of a call that could not reach the store (``why``: the outage's cause)."""
        why = why or self._outage
        return StoreUnavailableError("store", f"Redis store {self.name} is unavailable: {why}")

    def _lost(self, exc: Exception) -> StoreUnavailableError:
        """Record an outage (``exc`` says why) and start probing, unless already probing."""
        why = " ".join(str(exc).split()) or type(exc).__name__
        with self._outage_lock:
            if self._outage is None:
                self._outage = why
                threading.Thread(target=self._probe, name="store-probe", daemon=True).start()
        return self._unavailable(why)

    def _probe(self) -> None:
        """``PING`` every :data:`PROBE_INTERVAL_S` until Redis answers; then end the outage."""
        while True:
            time.sleep(PROBE_INTERVAL_S)
            try:
                self.client.ping()
            except redis.RedisError:
                continue
            with self._outage_lock:
                self._outage = None
            return

    # ------------------------------------------------------------------ transactions

    def transact(self, operation: Callable[[], T], attempts: int = 32) -> T:
        """Run ``operation`` (a service call using this store) as one optimistic transaction
        and return its result. Its reads are watched, its writes applied together at the end;
        if another replica changed a watched key meanwhile, nothing is applied and it runs
        again. Writes made before ``operation`` raised are applied too (as without a
        transaction), then the exception propagates. Nested calls join the outer one."""
        if self._tx is not None:
            return operation()
        for _ in range(attempts):
            with self.client.pipeline(transaction=True) as pipe:
                self._tx = tx = _Tx(pipe)
                try:
                    try:
                        result, error = operation(), None
                    except Exception as exc:  # noqa: BLE001 - re-raised once committed
                        result, error = None, exc
                        _raise_if_broken(exc)
                    if self._outage is not None:  # nothing can be committed
                        if pipe.connection is not None:  # no UNWATCH to wait for
                            pipe.connection.disconnect()
                        raise self._unavailable()
                    pipe.multi()
                    for op in tx.ops:
                        op(pipe)
                    pipe.execute()
                except redis.WatchError as exc:
                    _raise_if_broken(exc)
                    continue
                finally:
                    self._tx = None
            if error is not None:
                raise error
            return result  # type: ignore[return-value]
        raise ConflictError(f"gave up after {attempts} conflicting attempts")

    def _watch(self, keys: Iterable[bytes]) -> None:
        tx = self._tx
        if tx is not None:
            new = [k for k in keys if k not in tx.watched]
            if new:
                tx.pipe.watch(*new)
                tx.watched.update(new)

    def _write(self, op: Callable[[Any], Any]) -> Any:
        """Apply ``op`` to the client now, or queue it for the transaction's ``EXEC``."""
        if self._tx is None:
            return op(self.client)
        self._tx.ops.append(op)
        return None

    def _run(self, name: str, keys: list[bytes], args: list[Any], client: Any) -> Any:
        return self._scripts[name](keys=keys, args=args, client=client)

    # ------------------------------------------------------------------ keys

    def _key(self, *parts: str) -> bytes:
        return (self.prefix + ":".join(parts)).encode()

    @staticmethod
    def _member(key: RankKey) -> str:
        return f"{key[1]}:{key[0]}"

    def _rank_key(self, key: RankKey) -> bytes:
        return self._key("rank", self._member(key))

    # ------------------------------------------------------------------ counters

    def next_counter(self, name: str) -> int:
        return int(self.client.incr(self._key("counter", name)))

    # ------------------------------------------------------------------ ranks

    def put_rank(self, record: RankRecord) -> None:
        key = record.registration.key
        member = self._member(key)
        keys = [
            self._rank_key(key),
            self._key("ranks"),
            self._key("engine", key[0]),
            self._key("lease", record.lease_id),
            self._key("releases", member),
            self._key("cursor", member),
            self._key("contacts", member),
            self._key("backlog", member),
        ]
        args = [
            member,
            key[1],
            registration_to_proto(record.registration).SerializeToString(),
            record.lease_id,
            record.lease_expires_at_ms,
            record.registered_at_ms,
            record.generation,
            self.rank_ttl_ms,
            self._key("lease", "").decode(),
        ]
        self._registrations[key] = (record.generation, record.registration)
        if self._tx is not None:
            self._tx.ranks[key] = record
        self._write(lambda c: self._run("put_rank", keys, args, c))

    def get_rank(self, key: RankKey) -> RankRecord | None:
        return self._ranks([key])[0]

    def rank_by_lease(self, lease_id: str) -> RankRecord | None:
        lease_key = self._key("lease", lease_id)
        self._watch([lease_key])
        if self._tx is not None:
            for record in self._tx.ranks.values():
                if record is not None and record.lease_id == lease_id:
                    return record
        member = self.client.get(lease_key)
        if member is None:
            return None
        tp_rank, engine_id = member.decode().split(":", 1)
        record = self.get_rank((engine_id, int(tp_rank)))
        return record if record is not None and record.lease_id == lease_id else None

    def delete_rank(self, key: RankKey) -> None:
        keys = [self._rank_key(key), self._key("ranks"), self._key("engine", key[0])]
        args = [self._member(key), key[1], self._key("lease", "").decode()]
        if self._tx is not None:
            self._tx.ranks[key] = None
        self._write(lambda c: self._run("delete_rank", keys, args, c))

    def ranks(self) -> list[RankRecord]:
        members = self.client.smembers(self._key("ranks"))
        keys = [_parse_member(m) for m in members]
        if self._tx is not None:
            keys = list(set(keys) | set(self._tx.ranks))
        found = self._ranks(keys, watch=False)
        gone = [
            self._member(k) for k, r in zip(keys, found) if r is None and k not in self._pending()
        ]
        if gone:
            self._write(lambda c: c.srem(self._key("ranks"), *gone))
        return sorted((r for r in found if r is not None), key=lambda r: r.registration.key)

    def engine_ranks(self, engine_id: str) -> list[RankRecord]:
        engine_key = self._key("engine", engine_id)
        if self._tx is None:  # one round trip
            rows = self._run(
                "engine", [engine_key], [self._key("rank", "").decode(), engine_id], self.client
            )
            records = (self._decode_rank((engine_id, int(tp)), row) for tp, *row in rows)
            return sorted(
                (r for r in records if r is not None), key=lambda r: r.registration.tp_rank
            )
        self._watch([engine_key])
        tp_ranks = {int(m) for m in self.client.smembers(engine_key)}
        if self._tx is not None:
            tp_ranks |= {k[1] for k in self._tx.ranks if k[0] == engine_id}
        keys = [(engine_id, r) for r in sorted(tp_ranks)]
        return [r for r in self._ranks(keys) if r is not None]

    def _pending(self) -> set[RankKey]:
        return set() if self._tx is None else set(self._tx.ranks)

    def _ranks(self, keys: list[RankKey], watch: bool = True) -> list[RankRecord | None]:
        """The records at ``keys`` (``None`` where missing), in one round trip."""
        tx_ranks = {} if self._tx is None else self._tx.ranks
        remote = [k for k in keys if k not in tx_ranks]
        if watch:
            self._watch(self._rank_key(k) for k in remote)
        with self.client.pipeline(transaction=False) as pipe:
            for key in remote:
                pipe.hmget(self._rank_key(key), _RANK_FIELDS)
            rows = dict(zip(remote, pipe.execute()))
        return [tx_ranks[k] if k in tx_ranks else self._decode_rank(k, rows[k]) for k in keys]

    def _decode_rank(self, key: RankKey, row: list[bytes | None]) -> RankRecord | None:
        reg, lease, expires, registered, generation = row
        if reg is None or generation is None:
            return None
        gen = int(generation)
        cached = self._registrations.get(key)
        if cached is None or cached[0] != gen:
            cached = (gen, registration_from_proto(pb.RegisterRankRequest.FromString(reg)))
            self._registrations[key] = cached
        return RankRecord(cached[1], lease.decode(), int(expires), int(registered), gen)

    # ------------------------------------------------------------------ transfers and plans

    def put_transfer(self, record: TransferRecord) -> None:
        token, blob = self._plans_token(record)
        keys = [
            self._key("transfer", record.transfer_id),
            self._key("deadlines"),
            self._key("transfers"),
            self._key("usage", record.prefill_engine_id),
        ]
        args = [
            record.transfer_id,
            _transfer_json(record, token),
            record.deadline_ms,
            " ".join(p.plan_id for p in record.plans.values()),
            blob,
            self.transfer_ttl_ms,
            held_block_ids(record),
        ]
        if self._tx is not None:
            self._tx.transfers[record.transfer_id] = record
        self._write(lambda c: self._run("put_transfer", keys, args, c))

    def get_transfer(self, transfer_id: str) -> TransferRecord | None:
        return self._transfers([transfer_id])[0]

    def delete_transfer(self, transfer_id: str) -> None:
        keys = [self._key("transfer", transfer_id), self._key("deadlines"), self._key("transfers")]
        args = [transfer_id, self._key("plan", "").decode()]
        if self._tx is not None:
            self._tx.transfers[transfer_id] = None
        self._write(lambda c: self._run("delete_transfer", keys, args, c))

    def transfers(self) -> Iterator[TransferRecord]:
        ids = {m.decode() for m in self.client.smembers(self._key("transfers"))}
        if self._tx is not None:
            ids |= set(self._tx.transfers)
        ordered = sorted(ids)
        found = self._transfers(ordered)
        gone = [
            i for i, t in zip(ordered, found) if t is None and i not in self._pending_transfers()
        ]
        if gone:
            self._write(lambda c: c.srem(self._key("transfers"), *gone))
        return iter([t for t in found if t is not None])

    def due_transfers(self, now_ms: int) -> list[TransferRecord]:
        """Due transfers; each one is handed out again after :data:`REDELIVER_MS` unless it
        was put with a new deadline or deleted (a reaper that died does not lose it)."""
        ids = self._run(
            "due", [self._key("deadlines")], [now_ms, now_ms + REDELIVER_MS], self.client
        )
        ids = [i.decode() for i in ids]
        found = self._transfers(ids)
        gone = [i for i, t in zip(ids, found) if t is None and i not in self._pending_transfers()]
        if gone:
            self.client.zrem(self._key("deadlines"), *gone)
        return [t for t in found if t is not None]

    def count_transfers(self) -> int:
        """Stored transfers (in a transaction, not counting its own writes)."""
        return int(self.client.scard(self._key("transfers")))

    def index_plan(self, plan_id: str, transfer_id: str) -> None:
        key, ttl = self._key("plan", plan_id), self.transfer_ttl_ms
        self._write(lambda c: c.set(key, transfer_id, px=ttl))

    def transfer_of_plan(self, plan_id: str) -> str | None:
        if self._tx is not None:
            for record in self._tx.transfers.values():
                if record is not None and any(p.plan_id == plan_id for p in record.plans.values()):
                    return record.transfer_id
        value = self.client.get(self._key("plan", plan_id))
        return None if value is None else value.decode()

    def _pending_transfers(self) -> set[str]:
        return set() if self._tx is None else set(self._tx.transfers)

    def _transfers(self, ids: list[str]) -> list[TransferRecord | None]:
        """The records of ``ids`` (``None`` where missing) in one round trip, plus one for
        the plans blobs whose token is not cached here."""
        tx_transfers = {} if self._tx is None else self._tx.transfers
        remote = [i for i in ids if i not in tx_transfers]
        keys = [self._key("transfer", i) for i in remote]
        self._watch(keys)
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "m")
            metas = [None if raw is None else json.loads(raw) for raw in pipe.execute()]
        plans = {m["token"]: self._plans.get(m["token"]) for m in metas if m is not None}
        plans[""] = {}
        misses = [i for i, m in enumerate(metas) if m is not None and plans[m["token"]] is None]
        if misses:
            with self.client.pipeline(transaction=False) as pipe:
                for i in misses:
                    pipe.hmget(keys[i], ("m", "p"))
                for i, (raw, blob) in zip(misses, pipe.execute()):
                    # Read again with the blob: a writer may have replaced both meanwhile.
                    metas[i] = m = None if raw is None else json.loads(raw)
                    if m is not None and plans.get(m["token"]) is None:
                        plans[m["token"]] = _decode_plans(blob)
                        self._cache_plans(m["token"], plans[m["token"]])
        decoded = {
            i: None if m is None else _transfer_from_json(m, plans[m["token"]])
            for i, m in zip(remote, metas)
        }
        return [tx_transfers[i] if i in tx_transfers else decoded[i] for i in ids]

    def _plans_token(self, record: TransferRecord) -> tuple[str, bytes]:
        """The token of the record's rank plans and, when they changed since they were last
        stored or read here, their blob (else ``b""``)."""
        plans = {d: p.rank_plan for d, p in record.plans.items()}
        if not plans:
            return "", b""
        tokens = {self._plan_tokens.get(id(p)) for p in plans.values()}
        if len(tokens) == 1 and None not in tokens:
            token = tokens.pop()
            cached = self._plans[token]
            if cached.keys() == plans.keys() and all(cached[d] is p for d, p in plans.items()):
                return token, b""
        token = secrets.token_hex(8)
        self._cache_plans(token, plans)
        return token, _encode_plans(plans)

    def _cache_plans(self, token: str, plans: dict[int, RankPlan]) -> None:
        """Remember decoded plans by token; the oldest go once more than
        :data:`PLAN_CACHE_RUNS` runs are cached."""
        self._plans[token] = plans
        self._cached_runs += sum(p.num_descriptors for p in plans.values())
        for plan in plans.values():
            self._plan_tokens[id(plan)] = token
        while self._cached_runs > PLAN_CACHE_RUNS and len(self._plans) > 1:
            old = self._plans.pop(next(iter(self._plans)))
            self._cached_runs -= sum(p.num_descriptors for p in old.values())
            for plan in old.values():
                self._plan_tokens.pop(id(plan), None)

    # ------------------------------------------------------------------ agent contacts

    def add_contact(self, decode: RankKey, agent: str) -> bool:
        key = self._key("contacts", self._member(decode))
        if self._tx is None:
            with self.client.pipeline(transaction=False) as pipe:
                added, _ = pipe.sadd(key, agent).pexpire(key, self.rank_ttl_ms).execute()
            return bool(added)
        self._watch([key])
        if (decode, agent) in self._tx.contacts or self.client.sismember(key, agent):
            return False
        self._tx.contacts.add((decode, agent))
        ttl = self.rank_ttl_ms
        self._write(lambda c: (c.sadd(key, agent), c.pexpire(key, ttl)))
        return True

    def drop_contacts(self, decode: RankKey) -> None:
        key = self._key("contacts", self._member(decode))
        self._write(lambda c: c.delete(key))

    # ------------------------------------------------------------------ release queues

    def append_release(
        self, key: RankKey, event: ReleaseEvent, rank_bytes: int, total_bytes: int
    ) -> None:
        """Queue ``event`` under a sequence taken when the write is applied (so sequences
        grow in commit order across replicas); ``event.sequence`` is not used."""
        member = self._member(key)
        keys = [
            self._key("releases", member),
            self._key("counter", "release"),
            self._key("backlog", member),
        ]
        payload = json.dumps(_encode(event, "sequence"), separators=(",", ":"))
        args = [
            self.prefix,
            payload,
            self._key("releases").decode(),
            member,
            self.rank_ttl_ms,
            event.nbytes,
            rank_bytes,
            total_bytes,
        ]
        self._write(lambda c: self._run("append", keys, args, c))

    def engine_usage(self, engine_id: str) -> tuple[int, int]:
        transfers, ids = self.client.hmget(self._key("usage", engine_id), "t", "i")
        return int(transfers or 0), int(ids or 0)

    def compacted_through(self, key: RankKey) -> int:
        value = self.client.hget(self._key("backlog", self._member(key)), "compacted")
        return 0 if value is None else int(value)

    def releases_after(self, key: RankKey, sequence: int) -> list[ReleaseEvent]:
        entries = self.client.xrange(
            self._key("releases", self._member(key)), f"({sequence}-0", "+"
        )
        return [_release_event(entry_id, fields[b"e"]) for entry_id, fields in entries]

    def mark_delivered(self, key: RankKey, sequence: int) -> None:
        cursor, ttl = self._key("cursor", self._member(key)), self.rank_ttl_ms
        self._write(lambda c: self._run("mark", [cursor], [sequence, ttl], c))

    def delivered(self, key: RankKey) -> int:
        value = self.client.get(self._key("cursor", self._member(key)))
        return 0 if value is None else int(value)

    def trim_releases(self, key: RankKey, keep_delivered: int) -> None:
        member = self._member(key)
        keys = [self._key("releases", member), self._key("cursor", member)]
        self._write(lambda c: self._run("trim", keys, [self.prefix, member, keep_delivered], c))

    def drop_releases(self, key: RankKey) -> None:
        member = self._member(key)
        keys = [
            self._key("releases", member),
            self._key("cursor", member),
            self._key("backlog", member),
        ]
        args = [self.prefix, member, self._key("releases").decode()]
        self._write(lambda c: self._run("drop", keys, args, c))

    def subscribe_releases(self, callback: Callable[[RankKey], None]) -> Callable[[], None]:
        """Call ``callback(key)`` on a background thread whenever any replica queues a
        release for prefill rank ``key`` or drops its queue (so a local watcher wakes up);
        returns the function that stops listening. Listening survives outages: the thread
        subscribes again once Redis is back."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(
            **{self._key("releases").decode(): lambda m: callback(_parse_member(m["data"]))}
        )

        def keep_listening(exc: BaseException, *_: Any) -> None:
            if not isinstance(exc, _UNREACHABLE):
                raise exc
            time.sleep(PROBE_INTERVAL_S)

        worker = pubsub.run_in_thread(sleep_time=1.0, daemon=True, exception_handler=keep_listening)

        def stop() -> None:
            worker.stop()
            worker.join(5)
            pubsub.close()

        return stop


# --------------------------------------------------------------------------- codecs


def _parse_member(member: bytes) -> RankKey:
    tp_rank, engine_id = member.decode().split(":", 1)
    return engine_id, int(tp_rank)


def _ids(groups: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in groups)


def _same(value: Any) -> Any:
    return value


# Every dataclass field is stored under its name; fields not named here are JSON as they are
# (ints, strings, None), so a field added to a record is stored without touching this module.
_ENCODE: dict[str, Callable[[Any], Any]] = {
    "allowed_decode_engines": sorted,
    "state": lambda v: v.value,
    "status": lambda v: None if v is None else v.value,
    "reason": lambda v: v.value,
    "end_reason": lambda v: None if v is None else v.value,
    "consumers": lambda v: [[p, sorted(ds)] for p, ds in v.items()],
    "released": lambda v: [[p, r.value] for p, r in v.items()],
    "timeline": lambda v: [astuple(e) for e in v],
}
_DECODE: dict[str, Callable[[Any], Any]] = {
    "block_ids": _ids,
    "allowed_decode_engines": frozenset,
    "state": TransferState,
    "status": lambda v: None if v is None else ReportStatus(v),
    "reason": ReleaseReason,
    "end_reason": lambda v: None if v is None else ReleaseReason(v),
    "consumers": lambda v: {p: frozenset(ds) for p, ds in v},
    "released": lambda v: {p: ReleaseReason(r) for p, r in v},
    "timeline": lambda v: [TimelineEntry(*e) for e in v],
}


def _encode(record: Any, *skip: str) -> dict[str, Any]:
    return {
        f.name: _ENCODE.get(f.name, _same)(getattr(record, f.name))
        for f in fields(record)
        if f.name not in skip
    }


def _decode(cls: type[T], values: dict[str, Any], **extra: Any) -> T:
    return cls(**{k: _DECODE.get(k, _same)(v) for k, v in values.items()}, **extra)


def _transfer_json(t: TransferRecord, token: str) -> str:
    """Everything but the rank plans (stored under ``token``), as compact JSON."""
    values = _encode(t, "plans")
    values["plans"] = [_encode(p, "rank_plan", "transfer_id") for p in t.plans.values()]
    values["token"] = token
    return json.dumps(values, separators=(",", ":"))


def _transfer_from_json(values: dict[str, Any], plans: dict[int, RankPlan]) -> TransferRecord:
    values = dict(values)
    del values["token"]
    transfer_id = values["transfer_id"]
    records = {
        p["decode_rank"]: _decode(
            PlanRecord, p, transfer_id=transfer_id, rank_plan=plans[p["decode_rank"]]
        )
        for p in values.pop("plans")
    }
    return _decode(TransferRecord, values, plans=records)


def _encode_plans(plans: dict[int, RankPlan]) -> bytes:
    """``u32 header length | JSON header | int64 columns``: per plan its decode rank, byte
    and descriptor counts and per source its prefill rank and run count; then per source
    a ``(4, runs)`` array of region, local offset, remote offset and length."""
    header = [
        [
            d,
            p.naive_bytes,
            p.vllm_descriptors,
            [[s.prefill_rank, s.num_descriptors] for s in p.sources],
        ]
        for d, p in plans.items()
    ]
    arrays = [
        np.stack([s.region, s.local_offset, s.remote_offset, s.length]).astype("<i8", copy=False)
        for p in plans.values()
        for s in p.sources
    ]
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(head)), head, *(a.tobytes() for a in arrays)])


def _decode_plans(blob: bytes) -> dict[int, RankPlan]:
    (size,) = struct.unpack_from("<I", blob)
    header = json.loads(blob[4 : 4 + size])
    columns = np.frombuffer(bytearray(blob[4 + size :]), dtype="<i8")
    plans, at = {}, 0
    for d, naive, vllm, sources in header:
        reads = []
        for prefill_rank, runs in sources:
            table = columns[at : at + _COLUMNS * runs].reshape(_COLUMNS, runs)
            at += _COLUMNS * runs
            reads.append(SourceReads(prefill_rank, *table))
        plans[d] = RankPlan(d, tuple(reads), naive, vllm)
    return plans


def _release_event(entry_id: bytes, payload: bytes) -> ReleaseEvent:
    sequence = int(entry_id.split(b"-", 1)[0])
    return _decode(ReleaseEvent, json.loads(payload), sequence=sequence)
