"""A :class:`~broker.store.contract.StateStore` in Redis, shared by broker replicas.

Keys (``P`` is the prefix, ``R`` a rank ``"{tp_rank}:{engine_id}"``, ``T`` a transfer
``"{len(engine_id)}:{engine_id}:{transfer_id}"``):

=========================  ==========================================================
``P counter:NAME``         ``INCR`` counters (generations, release sequences)
``P rank:R``               hash: ``reg`` (registration JSON), ``meta`` (agent metadata),
                           ``lease``, ``exp``, ``at``, ``gen``, ``agent``; sets ``P ranks``,
                           ``P engine:ID``, ``P deployment:X`` (ranks of ``X_dp<N>``),
                           sorted set ``P leases`` (by expiry)
``P lease:LEASE``          ``R`` of the rank holding that lease
``P agent:NAME``           ``R`` of the rank registered with that NIXL agent
``P transfer:T``           hash: ``m`` (record JSON naming its plans' token), ``d``
                           (deadline), ``ids`` (plan ids), ``p`` (plans blob), ``named``,
                           ``parties``; sets ``P transfers``, ``P named:ID`` (by bare id),
                           ``P party:ENGINE`` (by engine it concerns)
``P deadlines``            sorted set: transfers by deadline (ms)
``P losses``               hash: rank losses not yet told to every transfer, field
                           ``GENERATION:R``, value JSON (read with the transfers a unit reads)
``P usage:ENGINE``         hash: ``t`` transfers and ``i`` block ids a prefill engine's
                           transfers hold (each transfer's own share in its field ``q``)
``P plan:PLAN``            ``T`` of a plan
``P contacts:R``           set of agents a decode rank was given metadata for
``P releases:R``           stream: release events, entry id ``SEQUENCE-0``, fields ``e``
                           (event JSON) and ``b`` (its backlog bytes)
``P cursor:R``             the largest sequence delivered to a watcher (durable cursor)
``P backlog:R``            hash: ``bytes`` of the rank's kept events, ``compacted`` (the
                           newest sequence dropped); ``P backlog`` all ranks' bytes, sorted
                           set ``P backlogs`` each rank's
=========================  ==========================================================

Values are written in the store's own format (:mod:`broker.store.codec`); decoded plans and
registrations are cached by content token and generation, so the many reads that change only
counters move and decode only the small JSON part.

**Server-side TTLs.** Lease *expiry* stays the service's decision (it must fail the rank's
transfers and release their blocks), but every rank, lease, agent, contact, stream and cursor
key carries a Redis TTL of ``rank_ttl_ms`` refreshed by each ``put_rank`` (each keep-alive),
and transfer and plan keys one of ``transfer_ttl_ms`` refreshed by each ``put_transfer``: if
every broker dies, Redis forgets what nobody renews. Index entries whose record expired that
way are skipped and removed when read.

**Units of work.** :meth:`RedisStateStore.transact` is optimistic: its reads ``WATCH`` the
keys they return (in the same round trip, on the connection units keep:
:class:`~broker.store.redis_unit.UnitLink`), its writes are queued (the last write of a
record replacing earlier ones) and applied in one ``MULTI``/``EXEC`` that fails if any
watched key changed; the unit then runs again on fresh records. Scripts inside ``EXEC`` are
sent whole (``EVAL``), so none is missing and no round trip checks. What a key named when
this replica last saw it is read with the key, watched (an engine's ranks with its set, a
lease's or agent's rank, a bare id's transfers; the ranks of the parties of the transfer
read last with the next engine read): a call makes a fixed few round trips, whatever the
number of engines and transfers (``tests/test_redis_round_trips.py``). A unit that raises
applies nothing. So two replicas never both claim a transfer, both count one report or both
release a prefill rank. Release sequences are taken from ``P counter:release`` inside the
commit (a Lua script), so they grow per stream in commit order and a cursor never skips an
event; each commit publishes the rank on ``P releases`` for
:meth:`~RedisStateStore.subscribe_releases`. Outages: :mod:`broker.store.redis_link`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, TypeVar

import redis

from broker.records import RankKey, RankRecord, RankRegistration, TransferKey, TransferRecord
from broker.store import codec
from broker.store.contract import DUE_PER_CALL, REDELIVER_MS, StateStore, held_block_ids
from broker.store.redis_ahead import RedisReadsAhead
from broker.store.redis_link import STORE_TIMEOUT_MS, Availability, client_for, fails_fast
from broker.store.redis_losses import RedisContacts, RedisRankLosses, decode_losses
from broker.store.redis_releases import RedisReleaseQueues
from broker.store.redis_scripts import SCRIPTS
from broker.store.redis_unit import (
    RANK_FIELDS,
    Command,
    PlanBlobs,
    Recent,
    ThreadUnits,
    Unit,
    exchange,
    parse_rank,
    parse_transfer,
    rank_member,
    transfer_member,
)
from broker.wire import data_parallel_deployment, names_engine

T = TypeVar("T")


class ConflictError(RuntimeError):
    """:meth:`RedisStateStore.transact` kept losing races with other replicas."""


@fails_fast
class RedisStateStore(
    RedisReleaseQueues, RedisRankLosses, RedisContacts, RedisReadsAhead, StateStore
):
    """Records in one Redis server (or primary); see the module docstring.

    ``rank_ttl_ms`` must exceed the service's lease TTL and ``transfer_ttl_ms`` the longest
    transfer TTL plus retention, so Redis never forgets what the service still needs.
    Its caches are not thread-safe: threads take turns (:mod:`broker.store.turns`), each
    thread's unit of work its own, on its own connection (:class:`ThreadUnits`)."""

    blocking = True

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
        self.link = Availability(client)
        self._units = ThreadUnits(client.connection_pool)
        #: The tp ranks of each engine when last read in a unit of work.
        self._engine_members: dict[str, tuple[int, ...]] = {}
        #: Registrations by rank (generation, decoded, encoded as stored), the newest 16,384.
        self._registrations: Recent[RankKey, tuple[int, RankRegistration, bytes | str]] = Recent()
        #: Decoded plans by blob token.
        self._plans = PlanBlobs()
        #: The rank each lease and agent key named when last read or written here (such a
        #: key never names another rank), so its record is read with the key.
        self._indexed_ranks: Recent[bytes, RankKey] = Recent()
        #: The transfers each bare id named when last read or written here.
        self._named: Recent[bytes, tuple[TransferKey, ...]] = Recent()
        #: The transfers last written here, with their text as stored (``m``): a read that
        #: finds that text again takes the record as written rather than decoding it.
        self._written: Recent[TransferKey, tuple[bytes, TransferRecord]] = Recent(1024)
        #: The transfer of each plan id written here (a plan id never names another), and the
        #: prefill ranks the plan reads from: a report of it reads them with the transfer.
        self._plan_transfers: Recent[str, tuple[TransferKey, tuple[int, ...]]] = Recent()
        self._known_contacts = Recent()
        self._scripts = {name: client.register_script(text) for name, text in SCRIPTS.items()}

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "pdbroker:", *, timeout_ms: int = STORE_TIMEOUT_MS, **ttls: int
    ) -> RedisStateStore:
        """A store on ``url`` whose every connect and reply times out after ``timeout_ms``
        (:func:`~broker.store.redis_link.client_for`)."""
        return cls(client_for(url, timeout_ms), prefix, **ttls)

    @property
    def name(self) -> str:
        return self.link.name

    @property
    def available(self) -> bool:
        """False from a call that could not reach Redis in time until a probe is answered."""
        return self.link.outage is None

    # ------------------------------------------------------------------ units of work

    def transact(self, operation: Callable[[], T], attempts: int = 32) -> T:
        units = self._units
        if units.unit is not None:
            return operation()
        link = units.link
        for _ in range(attempts):
            units.unit = unit = Unit()
            try:
                result = operation()
                if self.link.outage is not None:  # nothing can be committed
                    link.drop()
                    raise self.link.unavailable()
                commands = self._queued(unit)
                if (unit.watched or commands) and link.commit(commands) is None:
                    continue  # another replica changed what this attempt read
                for remember in unit.on_commit:
                    remember()
            except BaseException:
                link.stale = link.stale or bool(unit.watched)
                raise
            finally:
                units.unit = None
            return result
        raise ConflictError(f"gave up after {attempts} conflicting attempts")

    def _queued(self, unit: Unit) -> list[Command]:
        """The commands of the unit's writes, in order."""
        collector = self.client.pipeline(transaction=False)
        for op in unit.ops.values():
            op(collector)
        return [args for args, _ in collector.command_stack]

    def _fetch(self, watch: Iterable[bytes], commands: list[Command]) -> list[Any]:
        """The raw replies to ``commands``, in one round trip; in a unit of work, on its link
        after ``WATCH`` of the keys of ``watch`` it does not watch yet."""
        units, unit = self._units, self._units.unit
        if not commands:
            return []
        if unit is None:
            pool = self.client.connection_pool
            connection = pool.get_connection()
            try:
                return exchange(connection, commands)
            finally:
                pool.release(connection)
        if unit.engines_expected or unit.ranks_expected:  # read them with this round trip
            ahead_watch, ahead_reads, keep = self._reads_ahead(unit)
            replies = self._fetch([*watch, *ahead_watch], [*commands, *ahead_reads])
            keep(replies[len(commands) :])
            return replies[: len(commands)]
        new = [k for k in dict.fromkeys(watch) if k not in unit.watched]
        unit.watched.update(new)
        if new:
            return units.link.exchange([("WATCH", *new), *commands])[1:]
        return units.link.exchange(commands)

    def _write(self, op: Callable[[Any], Any], record: object = None) -> None:
        """Apply ``op`` to the client now, or queue it for the unit's ``EXEC``."""
        if self._units.unit is None:
            op(self.client)
        else:
            self._units.unit.queue(op, record)

    def _run(self, name: str, keys: list[bytes], args: list[Any], client: Any) -> Any:
        """Script ``name`` now (by its digest), or queued for a unit's ``EXEC`` in full:
        a script missing from Redis then fails nothing, and needs no round trip to check."""
        if isinstance(client, redis.client.Pipeline):
            return client.execute_command("EVAL", SCRIPTS[name], len(keys), *keys, *args)
        return self._scripts[name](keys=keys, args=args, client=client)

    def _key(self, *parts: str) -> bytes:
        return (self.prefix + ":".join(parts)).encode()

    def _prefix_of(self, name: str) -> str:
        return self._key(name, "").decode()

    # ------------------------------------------------------------------ counters

    def next_counter(self, name: str) -> int:
        return int(self.client.incr(self._key("counter", name)))

    # ------------------------------------------------------------------ ranks

    def put_rank(self, record: RankRecord) -> None:
        key, reg = record.key, record.registration
        member = rank_member(key)
        cached = self._registrations.get(key)
        encoded = cached[2] if cached is not None and cached[1] is reg else None
        encoded = encoded or codec.encode_registration(reg)  # encoded again once changed
        keys = [
            self._key("rank", member),
            self._key("ranks"),
            self._key("engine", key[0]),
            self._key("lease", record.lease_id),
            self._key("releases", member),
            self._key("cursor", member),
            self._key("contacts", member),
            self._key("backlog", member),
            self._key("agent", reg.agent_name),
            self._key("leases"),
            *self._deployment_key(key[0]),
        ]
        args = [
            member,
            key[1],
            encoded,
            reg.agent_metadata,
            record.lease_id,
            record.lease_expires_at_ms,
            record.registered_at_ms,
            record.generation,
            self.rank_ttl_ms,
            self._prefix_of("lease"),
            self._prefix_of("agent"),
            reg.agent_name,
        ]
        self._registrations.put(key, (record.generation, reg, encoded))
        self._indexed_ranks.put(keys[3], key)
        self._indexed_ranks.put(keys[8], key)
        if self._units.unit is not None:
            self._units.unit.ranks[key] = record
        self._write(lambda c: self._run("put_rank", keys, args, c), ("rank", key))

    def get_rank(self, key: RankKey) -> RankRecord | None:
        return self._ranks([key])[0]

    def _rank_at(self, index: bytes, matches: Callable[[RankRecord], bool]) -> RankRecord | None:
        """The rank an index key names, if it still ``matches`` (pending writes first); the
        rank it named when last seen is read in the same round trip."""
        pending = {} if self._units.unit is None else self._units.unit.ranks
        guess = self._indexed_ranks.get(index)
        guessed = (
            [] if guess is None or guess in pending else [self._key("rank", rank_member(guess))]
        )
        member, *row = self._fetch(
            [index, *guessed], [("GET", index), *(("HMGET", k, *RANK_FIELDS) for k in guessed)]
        )
        for record in pending.values():
            if record is not None and matches(record):
                return record
        if member is None:
            return None
        key = parse_rank(member)
        self._indexed_ranks.put(index, key)
        record = self._decode_rank(key, row[0]) if row and key == guess else self.get_rank(key)
        return record if record is not None and matches(record) else None

    def rank_by_lease(self, lease_id: str) -> RankRecord | None:
        return self._rank_at(self._key("lease", lease_id), lambda r: r.lease_id == lease_id)

    def rank_by_agent(self, agent_name: str) -> RankRecord | None:
        return self._rank_at(
            self._key("agent", agent_name), lambda r: r.registration.agent_name == agent_name
        )

    def delete_rank(self, key: RankKey) -> None:
        keys = [
            self._key("rank", rank_member(key)),
            self._key("ranks"),
            self._key("engine", key[0]),
            self._key("leases"),
            *self._deployment_key(key[0]),
        ]
        args = [rank_member(key), key[1], self._prefix_of("lease"), self._prefix_of("agent")]
        if self._units.unit is not None:
            self._units.unit.ranks[key] = None
        self._write(lambda c: self._run("delete_rank", keys, args, c), ("rank", key))

    def count_ranks(self) -> int:
        """Registered ranks (in a unit of work, not counting its own writes)."""
        return int(self.client.scard(self._key("ranks")))

    def _deployment_key(self, engine_id: str) -> list[bytes]:
        """``P deployment:X`` of a data-parallel rank ``X_dp<N>`` (none for other engines)."""
        return [self._key("deployment", d) for d in [data_parallel_deployment(engine_id)] if d]

    def ranks_named(self, names: Collection[str]) -> list[RankKey]:
        ordered = list(names)
        keys = [self._key(index, name) for name in ordered for index in ("engine", "deployment")]
        members = self._run("named", keys, [self._prefix_of("rank"), *ordered], self.client)
        pending = {} if self._units.unit is None else self._units.unit.ranks
        found = {parse_rank(m) for m in members} - pending.keys()
        found.update(k for k, r in pending.items() if r is not None and names_engine(names, k[0]))
        return sorted(found)

    def due_leases(self, now_ms: int) -> list[RankKey]:
        args = [now_ms, self._prefix_of("rank")]
        members = self._run("due_leases", [self._key("leases")], args, self.client)
        return [parse_rank(m) for m in members]

    def ranks(self) -> list[RankRecord]:
        keys = [parse_rank(m) for m in self.client.smembers(self._key("ranks"))]
        if self._units.unit is not None:
            keys = list(set(keys) | set(self._units.unit.ranks))
        found = self._ranks(keys, watch=False)
        gone = [rank_member(k) for k, r in zip(keys, found) if r is None and not self._pending(k)]
        if gone:
            self._write(lambda c: c.srem(self._key("ranks"), *gone))
        return sorted((r for r in found if r is not None), key=lambda r: r.key)

    def _pending(self, key: object) -> bool:
        unit = self._units.unit
        return unit is not None and (key in unit.ranks or key in unit.transfers)

    def _ranks(self, keys: list[RankKey], watch: bool = True) -> list[RankRecord | None]:
        """The records at ``keys`` (``None`` where missing), in one round trip."""
        unit = self._units.unit
        pending = {} if unit is None else unit.ranks
        ahead = {} if unit is None else unit.ranks_ahead  # read (and watched) ahead
        rows = {k: ahead.pop(k) for k in keys if k in ahead and k not in pending}
        remote = [k for k in keys if k not in pending and k not in rows]
        rank_keys = [self._key("rank", rank_member(k)) for k in remote]
        reads: list[Command] = [("HMGET", k, *RANK_FIELDS) for k in rank_keys]
        rows.update(zip(remote, self._fetch(rank_keys if watch else [], reads)))
        return [pending[k] if k in pending else self._decode_rank(k, rows[k]) for k in keys]

    def _decode_rank(self, key: RankKey, row: list[bytes | None]) -> RankRecord | None:
        reg, meta, lease, expires, registered, generation = row
        if reg is None or generation is None or lease is None:
            self._registrations.forget(key)  # gone: removed here or by another broker
            return None
        gen = int(generation)
        cached = self._registrations.get(key)
        if cached is None or cached[0] != gen:
            cached = (gen, codec.decode_registration(reg, meta or b""), reg)
            self._registrations.put(key, cached)
        return RankRecord(cached[1], lease.decode(), int(expires or 0), int(registered or 0), gen)

    # ------------------------------------------------------------------ transfers

    def put_transfer(self, record: TransferRecord) -> None:
        key = record.key
        member = transfer_member(key)
        keys = [
            self._key("transfer", member),
            self._key("deadlines"),
            self._key("transfers"),
            self._key("usage", record.prefill_engine_id),
            self._key("named", record.transfer_id),
            *(self._key("party", engine) for engine in sorted(record.parties)),
        ]
        if self._units.unit is not None:
            self._units.unit.transfers[key] = record
        for plan in record.plans:
            self._plan_transfers.put(plan.plan_id, (key, plan.prefill_ranks))
        named = self._named.get(keys[4]) or ()
        if key not in named:
            self._named.put(keys[4], (*named, key))
        token, blob = self._plans.token_of(record, self._units.unit)

        def put(client: Any) -> Any:  # the record encoded once, when written
            text = codec.encode_transfer(record, token)
            self._written.put(key, (text.encode(), record))
            args = [
                member,
                text,
                record.deadline_ms,
                " ".join(p.plan_id for p in record.plans),
                blob,
                self.transfer_ttl_ms,
                held_block_ids(record),
                self._prefix_of("plan"),
                json.dumps(sorted(record.parties)),
            ]
            return self._run("put_transfer", keys, args, client)

        self._write(put, ("transfer", key))

    def get_transfer(self, key: TransferKey) -> TransferRecord | None:
        return self._transfers([key])[0]

    def delete_transfer(self, key: TransferKey) -> None:
        member = transfer_member(key)
        keys = [self._key("transfer", member), self._key("deadlines"), self._key("transfers")]
        args = [member, self._prefix_of("plan"), self._prefix_of("party")]
        if self._units.unit is not None:
            self._units.unit.transfers[key] = None
        self._write(lambda c: self._run("delete_transfer", keys, args, c), ("transfer", key))

    def _indexed(
        self,
        index: bytes,
        belongs: Callable[[TransferRecord], bool],
        ahead: Iterable[TransferKey] = (),
    ) -> list[TransferKey]:
        """Transfer keys in set ``index``, with this unit's own writes (``belongs``). In a
        unit, the records of ``ahead`` (and the rank losses, if not read yet) are read and
        watched in the same round trip, for :meth:`_transfers` to take."""
        unit = self._units.unit
        reads: list[Command] = [("SMEMBERS", index)]
        ahead = [] if unit is None else [k for k in ahead if k not in unit.transfers]
        hash_keys = [self._key("transfer", transfer_member(k)) for k in ahead]
        reads += [("HGET", k, "m") for k in hash_keys]
        with_losses = unit is not None and bool(ahead) and unit.losses_read is None
        losses = [self._key("losses")] if with_losses else []
        self.expect_engines(k[0] for k in ahead)  # their publishers, read in the same trip
        members, *raws = self._fetch(
            [index, *hash_keys, *losses], [*reads, *(("HGETALL", k) for k in losses)]
        )
        keys = {parse_transfer(m) for m in members}
        if unit is not None:
            if with_losses:
                unit.losses_read = decode_losses(raws.pop())
            unit.read_ahead.update(zip(ahead, raws))
            for key, record in unit.transfers.items():
                if record is None:
                    keys.discard(key)
                elif belongs(record):
                    keys.add(key)
        return sorted(keys)

    def transfers_named(self, transfer_id: str) -> list[TransferKey]:
        index = self._key("named", transfer_id)
        ahead = self._named.get(index) or ()
        keys = self._indexed(index, lambda t: t.transfer_id == transfer_id, ahead)
        self._named.put(index, tuple(keys))
        return keys

    def transfers_of(self, engine_id: str) -> list[TransferKey]:
        return self._indexed(self._key("party", engine_id), lambda t: engine_id in t.parties)

    def transfer_of_plan(self, plan_id: str) -> TransferKey | None:
        if self._units.unit is not None:
            for record in self._units.unit.transfers.values():
                if record is not None and record.plan_by_id(plan_id) is not None:
                    return record.key
        known = self._plan_transfers.get(plan_id)
        if known is not None:  # whether it still exists is for the read of its record
            key, sources = known
            if self._units.unit is not None:  # the ranks its report may release
                self._units.unit.ranks_expected.update((key[0], p) for p in sources)
            return key
        value = self.client.get(self._key("plan", plan_id))
        return None if value is None else parse_transfer(value)

    def due_transfers(self, now_ms: int, limit: int = DUE_PER_CALL) -> list[TransferKey]:
        args = [now_ms, now_ms + REDELIVER_MS, self._prefix_of("transfer"), limit]
        members = self._run("due", [self._key("deadlines")], args, self.client)
        return [parse_transfer(m) for m in members]

    def count_transfers(self) -> int:
        """Stored transfers (in a unit of work, not counting its own writes)."""
        return int(self.client.scard(self._key("transfers")))

    def engine_usage(self, engine_id: str) -> tuple[int, int]:
        transfers, ids = self.client.hmget(self._key("usage", engine_id), "t", "i")
        return int(transfers or 0), int(ids or 0)

    def transfers(self) -> Iterator[TransferRecord]:
        keys = {parse_transfer(m) for m in self.client.smembers(self._key("transfers"))}
        if self._units.unit is not None:
            keys |= set(self._units.unit.transfers)
        ordered = sorted(keys)
        found = self._transfers(ordered, watch=False)
        gone = [
            transfer_member(k) for k, t in zip(ordered, found) if t is None and not self._pending(k)
        ]
        if gone:
            self._write(lambda c: c.srem(self._key("transfers"), *gone))
        return iter([t for t in found if t is not None])

    def _transfers(
        self, keys: list[TransferKey], watch: bool = True
    ) -> list[TransferRecord | None]:
        """The records of ``keys`` (``None`` where missing) in one round trip, plus one for
        the plans blobs whose token is not cached here."""
        unit = self._units.unit
        pending = {} if unit is None else unit.transfers
        ahead = {} if unit is None else unit.read_ahead
        remote = [k for k in keys if k not in pending]
        hash_keys = [self._key("transfer", transfer_member(k)) for k in remote]
        fresh = [h for k, h in zip(remote, hash_keys) if k not in ahead]
        reads: list[Command] = [("HGET", k, "m") for k in fresh]
        watched = fresh if watch else []
        with_losses = bool(fresh) and watch and unit is not None and unit.losses_read is None
        if with_losses:  # the rank losses a change to these records must see, same round trip
            losses = self._key("losses")
            watched, reads = [*watched, losses], [*reads, ("HGETALL", losses)]
        read = self._fetch(watched, reads)
        if with_losses:
            assert unit is not None
            unit.losses_read = decode_losses(read.pop())
        replies = iter(read)
        raws = [ahead[k] if k in ahead else next(replies) for k in remote]
        known = {k: self._written.get(k) for k in remote}  # records as written here
        written = {k: w[1] for k, raw in zip(remote, raws) if (w := known[k]) and w[0] == raw}
        raws = [None if k in written else raw for k, raw in zip(remote, raws)]
        metas = [None if raw is None else codec.plans_token_of(raw) for raw in raws]
        plans = {m[1]: self._plans.get(m[1]) for m in metas if m is not None}
        plans[""] = {}  # no plans yet
        misses = [i for i, m in enumerate(metas) if m is not None and plans[m[1]] is None]
        if misses:
            blobs: list[Command] = [("HMGET", hash_keys[i], "m", "p") for i in misses]
            for i, (raw, blob) in zip(misses, self._fetch([], blobs)):
                # Read again with the blob: a writer may have replaced both meanwhile.
                metas[i] = meta = None if raw is None else codec.plans_token_of(raw)
                if meta is not None and plans.get(meta[1]) is None:
                    plans[meta[1]] = decoded = codec.decode_plans(blob)
                    self._plans.remember(meta[1], decoded)
        found = {
            k: None if m is None else codec.decode_transfer(m[0], plans[m[1]] or {})
            for k, m in zip(remote, metas)
        }
        found.update(written)
        if unit is not None and watch and len(keys) == 1 and (t := found.get(keys[0])):
            unit.near_engines = t.parties  # whose ranks the unit reads next
        return [pending[k] if k in pending else found[k] for k in keys]
