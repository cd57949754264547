"""The release queues of :class:`~broker.store.redis.RedisStateStore` (keys ``P releases:R``,
``P cursor:R``, ``P backlog:R``, channel ``P releases``): a mixin over the store's key naming,
queued writes and scripts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import redis

from broker.records import RankKey, ReleaseEvent
from broker.store import codec
from broker.store.redis_link import PROBE_INTERVAL_S, UNREACHABLE, Availability, fails_fast
from broker.store.redis_unit import parse_rank, rank_member


@fails_fast
class RedisReleaseQueues:
    """Release events by prefill rank, for :class:`~broker.store.redis.RedisStateStore`."""

    client: redis.Redis
    prefix: str
    rank_ttl_ms: int
    link: Availability
    #: The store's key naming, queued writes and scripts.
    _key: Callable[..., bytes]
    _write: Callable[..., None]
    _run: Callable[..., Any]

    def release_sequence(self) -> int:
        """0: :meth:`append_release` takes the sequence as the write is applied."""
        return 0

    def append_release(
        self, key: RankKey, event: ReleaseEvent, rank_bytes: int, total_bytes: int
    ) -> None:
        """Queue ``event`` under a sequence taken when the write is applied (so sequences
        grow in commit order across replicas); ``event.sequence`` is not used."""
        member = rank_member(key)
        keys = [
            self._key("releases", member),
            self._key("counter", "release"),
            self._key("backlog", member),
        ]
        args = [
            self.prefix,
            codec.encode_release(event),
            self._key("releases").decode(),
            member,
            self.rank_ttl_ms,
            event.nbytes,
            rank_bytes,
            total_bytes,
        ]
        self._write(lambda c: self._run("append", keys, args, c))

    def compacted_through(self, key: RankKey) -> int:
        value = self.client.hget(self._key("backlog", rank_member(key)), "compacted")
        return 0 if value is None else int(value)

    def releases_after(self, key: RankKey, sequence: int) -> list[ReleaseEvent]:
        stream = self._key("releases", rank_member(key))
        # redis-py types XRANGE for clients of either decode_responses, with None for the
        # deleted entries XCLAIM may return; this client answers bytes, and XRANGE never None
        # (an empty list when there is no stream).
        entries = cast(
            "list[tuple[bytes, dict[bytes, bytes]]]",
            self.client.xrange(stream, f"({sequence}-0", "+"),
        )
        return [
            codec.decode_release(int(entry_id.split(b"-", 1)[0]), fields[b"e"])
            for entry_id, fields in entries
        ]

    def mark_delivered(self, key: RankKey, sequence: int) -> None:
        cursor, ttl = self._key("cursor", rank_member(key)), self.rank_ttl_ms
        self._write(lambda c: self._run("mark", [cursor], [sequence, ttl], c))

    def delivered(self, key: RankKey) -> int:
        value = self.client.get(self._key("cursor", rank_member(key)))
        return 0 if value is None else int(value)

    def trim_releases(self, key: RankKey, keep_delivered: int) -> None:
        member = rank_member(key)
        keys = [self._key("releases", member), self._key("cursor", member)]
        self._write(lambda c: self._run("trim", keys, [self.prefix, member, keep_delivered], c))

    def drop_releases(self, key: RankKey) -> None:
        member = rank_member(key)
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
            **{self._key("releases").decode(): lambda m: callback(parse_rank(m["data"]))}
        )

        def keep_listening(exc: BaseException, *_: Any) -> None:
            if not isinstance(exc, UNREACHABLE):
                raise exc
            time.sleep(PROBE_INTERVAL_S)

        worker = pubsub.run_in_thread(sleep_time=1.0, daemon=True, exception_handler=keep_listening)

        def stop() -> None:
            worker.stop()
            worker.join(5)
            pubsub.close()

        return stop
