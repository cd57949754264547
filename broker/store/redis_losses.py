"""The rank losses (hash ``P losses``) and agent contacts (sets ``P contacts:R``) of
:class:`~broker.store.redis.RedisStateStore`: mixins over the store's key naming, reads and
queued writes. A unit of work reads the losses once, with the first transfers it reads
(:func:`decode_losses` decodes that reply)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

import redis

from broker.records import RankKey, RankLoss
from broker.store.redis_link import fails_fast
from broker.store.redis_unit import Recent, ThreadUnits, rank_member


@fails_fast
class RedisRankLosses:
    """Rank losses for :class:`~broker.store.redis.RedisStateStore`."""

    transfer_ttl_ms: int
    _units: ThreadUnits
    #: The store's key naming, reads and queued writes.
    _key: Callable[..., bytes]
    _fetch: Callable[..., list[Any]]
    _write: Callable[..., None]

    def put_loss(self, loss: RankLoss) -> None:
        key, field = self._key("losses"), _loss_field(loss)
        value, ttl = json.dumps([*loss.key, loss.why, *loss.done_through]), self.transfer_ttl_ms
        if self._units.unit is not None:
            self._units.unit.loss_writes[loss.key] = loss
        self._write(lambda c: (c.hset(key, field, value), c.pexpire(key, ttl)), ("loss", loss.key))

    def delete_loss(self, loss: RankLoss) -> None:
        key, field = self._key("losses"), _loss_field(loss)
        if self._units.unit is not None:
            self._units.unit.loss_writes[loss.key] = None
        self._write(lambda c: c.hdel(key, field), ("loss", loss.key))

    def losses(self, engine_ids: Collection[str] | None = None) -> list[RankLoss]:
        unit = self._units.unit
        read = None if unit is None else unit.losses_read
        if read is None:
            key = self._key("losses")
            (raw,) = self._fetch([key], [("HGETALL", key)])
            read = decode_losses(raw)
            if unit is not None:
                unit.losses_read = read
        found: dict[tuple[str, int, int], RankLoss | None] = dict(read)
        if unit is not None:
            found.update(unit.loss_writes)
        return [
            loss
            for _, loss in sorted(found.items())
            if loss is not None and (engine_ids is None or loss.engine_id in engine_ids)
        ]


@fails_fast
class RedisContacts:
    """The agents each decode rank was given metadata for, for
    :class:`~broker.store.redis.RedisStateStore`."""

    client: redis.Redis
    rank_ttl_ms: int
    _units: ThreadUnits
    _key: Callable[..., bytes]
    _fetch: Callable[..., list[Any]]
    _write: Callable[..., None]
    #: Contacts known to have been given, by (decode rank, its generation, agent): a contact
    #: stays known to that generation of the rank, so a later plan of the pair asks Redis
    #: nothing.
    _known_contacts: Recent[tuple[RankKey, int, str], bool]

    def add_contact(self, decode: RankKey, generation: int, agent: str) -> bool:
        contact = (decode, generation, agent)
        if self._known_contacts.get(contact):
            return False
        key = self._key("contacts", rank_member(decode))
        if self._units.unit is None:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.sadd(key, agent)
                pipe.pexpire(key, self.rank_ttl_ms)
                added, _ = pipe.execute()
            self._known_contacts.put(contact, True)
            return bool(added)
        unit = self._units.unit
        (known,) = self._fetch([key], [("SISMEMBER", key, agent)])
        if (decode, agent) in unit.contacts:
            return False
        if known:
            self._known_contacts.put(contact, True)
            return False
        unit.contacts.add((decode, agent))
        ttl = self.rank_ttl_ms
        self._write(lambda c: (c.sadd(key, agent), c.pexpire(key, ttl)))
        unit.on_commit.append(lambda: self._known_contacts.put(contact, True))
        return True

    def drop_contacts(self, decode: RankKey) -> None:
        key = self._key("contacts", rank_member(decode))
        self._write(lambda c: c.delete(key))


def _loss_field(loss: RankLoss) -> str:
    return f"{loss.generation}:{rank_member((loss.engine_id, loss.tp_rank))}"


def decode_losses(raw: Any) -> dict[tuple[str, int, int], RankLoss]:
    """``HGETALL`` of ``P losses`` (fields and values, flat or as a map) by loss key."""
    values = [json.loads(value) for value in (raw.values() if isinstance(raw, dict) else raw[1::2])]
    losses = [RankLoss(e, int(tp), int(gen), why, (pe, pt)) for e, tp, gen, why, pe, pt in values]
    return {loss.key: loss for loss in losses}
