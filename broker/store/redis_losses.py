"""The rank losses of :class:`~broker.store.redis.RedisStateStore` (hash ``P losses``): a
mixin over the store's key naming, reads and queued writes. A unit of work reads them once,
with the first transfers it reads (:func:`decode_losses` decodes that reply)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

from broker.records import RankLoss
from broker.store.redis_link import fails_fast
from broker.store.redis_unit import Unit, rank_member


@fails_fast
class RedisRankLosses:
    """Rank losses for :class:`~broker.store.redis.RedisStateStore`."""

    transfer_ttl_ms: int
    _unit: Unit | None
    #: The store's key naming, reads and queued writes.
    _key: Callable[..., bytes]
    _fetch: Callable[..., list[Any]]
    _write: Callable[..., None]

    def put_loss(self, loss: RankLoss) -> None:
        key, field = self._key("losses"), _loss_field(loss)
        value, ttl = json.dumps([*loss.key, loss.why, *loss.done_through]), self.transfer_ttl_ms
        if self._unit is not None:
            self._unit.loss_writes[loss.key] = loss
        self._write(lambda c: (c.hset(key, field, value), c.pexpire(key, ttl)), ("loss", loss.key))

    def delete_loss(self, loss: RankLoss) -> None:
        key, field = self._key("losses"), _loss_field(loss)
        if self._unit is not None:
            self._unit.loss_writes[loss.key] = None
        self._write(lambda c: c.hdel(key, field), ("loss", loss.key))

    def losses(self, engine_ids: Collection[str] | None = None) -> list[RankLoss]:
        unit = self._unit
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


def _loss_field(loss: RankLoss) -> str:
    return f"{loss.generation}:{rank_member((loss.engine_id, loss.tp_rank))}"


def decode_losses(raw: Any) -> dict[tuple[str, int, int], RankLoss]:
    """``HGETALL`` of ``P losses`` (fields and values, flat or as a map) by loss key."""
    values = [json.loads(value) for value in (raw.values() if isinstance(raw, dict) else raw[1::2])]
    losses = [RankLoss(e, int(tp), int(gen), why, (pe, pt)) for e, tp, gen, why, pe, pt in values]
    return {loss.key: loss for loss in losses}
