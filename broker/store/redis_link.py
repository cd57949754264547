"""How :class:`~broker.store.redis.RedisStateStore` reaches Redis: deadlines on every connect
and reply, outages noticed once and probed in the background, and names of the store that
never carry its credentials.

Every connect has a deadline of ``timeout_ms`` (no retries), and so has every store call as
a whole: each reply is awaited for what is left of its call's deadline
(:class:`CallDeadline`), so a call of several round trips to a stalled or dead Redis fails
within ``timeout_ms`` of its start, not once per round trip. Such a failure raises :class:`~broker.errors.StoreUnavailableError` (gRPC
UNAVAILABLE) naming the store, and from then on every call fails at once, without touching
Redis, until a background thread's ``PING`` is answered again (every
:data:`PROBE_INTERVAL_S`): the event loop is blocked at most once per outage.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from functools import partial, wraps
from types import FunctionType
from typing import Any, TypeVar

import redis
import redis.sentinel
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _HiredisParser
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.utils import SENTINEL

from broker.errors import StoreUnavailableError
from broker.store.turns import waiting

T = TypeVar("T")

#: Default deadline of one connect or reply (ms): a store that takes longer is unavailable.
STORE_TIMEOUT_MS = 1_000
#: Pause between probes of an unavailable store (seconds).
PROBE_INTERVAL_S = 0.1
#: What a store that cannot be reached in time raises.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)

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


class CallDeadline(threading.local):
    """The instant (``time.monotonic``) by which the store call running on this thread must
    be answered (None: no call is running; replies then wait for the socket timeout)."""

    at: float | None = None

    def remaining(self, default: Any) -> Any:
        """Seconds left to the running call (at least 1 ms, so a late reply fails as a
        timeout), else ``default``."""
        return default if self.at is None else max(self.at - time.monotonic(), 0.001)


#: The deadline of the store call running on each thread.
DEADLINE = CallDeadline()


class _Deadlined:
    """A connection whose replies wait no longer than their call's :data:`DEADLINE`, and
    whose connects, sends and replies hand this thread's turn on
    (:func:`~broker.store.turns.waiting`)."""

    def connect(self) -> None:
        waiting(super().connect)  # type: ignore[misc]

    def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        waiting(partial(super().send_packed_command, *args, **kwargs))  # type: ignore[misc]

    def read_response(self, *args: Any, timeout: Any = SENTINEL, **kwargs: Any) -> Any:
        return waiting(
            partial(super().read_response, *args, timeout=DEADLINE.remaining(timeout), **kwargs)  # type: ignore[misc]
        )


def read_replies(connection: Any, count: int) -> list[Any]:
    """The next ``count`` replies on ``connection``, each as its ``read_response`` returns
    it (an error reply raised, an unreadable socket ``redis.ConnectionError``), every socket
    read waiting no longer than its call's :data:`DEADLINE`. With hiredis's parser the
    replies come straight from its reader, the socket read only when it needs more:
    redis-py's layers around each reply cost a store call more CPU than the parsing. Other
    parsers: one ``read_response`` a reply."""
    parser = connection._parser
    reader = getattr(parser, "_reader", None)
    if type(parser) is not _HiredisParser or reader is None:
        return [connection.read_response() for _ in range(count)]
    replies: list[Any] = []
    try:
        while len(replies) < count:
            reply = reader.gets()
            if reply is NOT_ENOUGH_DATA:
                parser.read_from_socket(timeout=DEADLINE.remaining(SENTINEL))
            elif isinstance(reply, redis.ResponseError):
                raise reply
            else:
                replies.append(reply)
    except OSError as e:
        raise redis.ConnectionError(f"Error while reading from Redis: {e.args}") from e
    if connection.health_check_interval:
        connection.next_health_check = time.monotonic() + connection.health_check_interval
    return replies


def client_for(url: str, timeout_ms: int = STORE_TIMEOUT_MS) -> redis.Redis:
    """A client of ``redis://HOST:PORT/DB`` (``rediss://`` for TLS, ``unix://`` too), or of
    the primary that Redis Sentinel names (:data:`SENTINEL_URL`), whose connects time out
    after ``timeout_ms`` and whose replies wait for what is left of their call's deadline
    (:data:`DEADLINE`, else ``timeout_ms``), never retried (the caller gets UNAVAILABLE and
    may go to another replica). ``ValueError`` says what is wrong with ``url``."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_ms / 1000,
        "socket_connect_timeout": timeout_ms / 1000,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
    }
    if url.startswith(SENTINEL_SCHEME):
        client = _sentinel_primary(url, options)
    else:
        client = redis.Redis.from_url(url, **options)
    pool = client.connection_pool
    pool.connection_class = type(
        f"Deadlined{pool.connection_class.__name__}", (_Deadlined, pool.connection_class), {}
    )
    return client


#: The scheme of a store found through Redis Sentinel, and the form of its URL.
SENTINEL_SCHEME = "redis+sentinel://"
SENTINEL_URL = f"{SENTINEL_SCHEME}[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]"


def _sentinel_primary(url: str, options: dict[str, Any]) -> redis.Redis:
    """A client of the primary named ``PRIMARY`` by the sentinels of ``url``
    (:data:`SENTINEL_URL`; the password is the primary's, the sentinels take none): each new
    connection asks the sentinels where it is, so after a failover calls reach the new one."""
    parts = urllib.parse.urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = (urllib.parse.unquote(p) for p in userinfo.partition(":"))
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"expected {SENTINEL_URL}")
    sentinels = []
    for address in hosts.split(","):
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"sentinel {address!r} is not HOST:PORT")
        sentinels.append((host.strip("[]"), int(port)))
    sentinel = redis.sentinel.Sentinel(sentinels, sentinel_kwargs=options)
    return sentinel.master_for(
        path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=user or None,
        password=password or None,
        **options,
    )


def store_name(client: redis.Redis) -> str:
    """``redis://HOST:PORT/DB`` (or ``unix://PATH``, or the sentinels and primary of a
    :data:`SENTINEL_URL`) of ``client``'s server, without credentials."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        hosts = ",".join(
            f"{s.connection_pool.connection_kwargs['host']}:{s.connection_pool.connection_kwargs['port']}"
            for s in pool.sentinel_manager.sentinels
        )
        return f"{SENTINEL_SCHEME}{hosts}/{pool.service_name}/{kwargs.get('db', 0)}"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"{scheme}://{host}:{port}/{db}"


class Availability:
    """Whether Redis is known to be unreachable, and the probe that notices its return."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        #: How errors name the store: its address, never its credentials.
        self.name = store_name(client)
        #: How long one store call may take (seconds): the client's reply timeout.
        self.timeout_s: float = (
            client.connection_pool.connection_kwargs.get("socket_timeout")
            or STORE_TIMEOUT_MS / 1000
        )
        #: Why the store is unavailable (None: it is not known to be); set by the call that
        #: could not reach it, cleared by the probe that got an answer.
        self.outage: str | None = None
        self._lock = threading.Lock()

    def unavailable(self, why: str | None = None) -> StoreUnavailableError:
        """The error of a call that could not reach the store (``why``: the outage's cause)."""
        why = why or self.outage
        return StoreUnavailableError("store", f"Redis store {self.name} is unavailable: {why}")

    def lost(self, exc: Exception) -> StoreUnavailableError:
        """Record an outage (``exc`` says why) and start probing, unless already probing."""
        why = " ".join(str(exc).split()) or type(exc).__name__
        with self._lock:
            if self.outage is None:
                self.outage = why
                threading.Thread(target=self._probe, name="store-probe", daemon=True).start()
        return self.unavailable(why)

    def _probe(self) -> None:
        """``PING`` every :data:`PROBE_INTERVAL_S` until Redis answers; then end the outage."""
        while True:
            time.sleep(PROBE_INTERVAL_S)
            try:
                self.client.ping()
            except redis.RedisError:
                continue
            with self._lock:
                self.outage = None
            return


def fails_fast(cls: type[T]) -> type[T]:
    """Every public method of ``cls`` (which has an :class:`Availability` as ``link``):
    while the store is known to be unavailable, raise :class:`StoreUnavailableError` at
    once; when Redis cannot be reached in time, raise it and start probing. The outermost
    such call on a thread sets its :data:`DEADLINE` (``link.timeout_s`` from its start)."""

    def guard(method: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            link: Availability = self.link
            if link.outage is not None:
                raise link.unavailable()
            outermost = DEADLINE.at is None
            if outermost:
                DEADLINE.at = time.monotonic() + link.timeout_s
            try:
                return method(self, *args, **kwargs)
            except UNREACHABLE as exc:
                raise link.lost(exc) from None
            finally:
                if outermost:
                    DEADLINE.at = None

        return guarded

    for name, method in list(vars(cls).items()):
        if isinstance(method, FunctionType) and not name.startswith("_"):
            setattr(cls, name, guard(method))
    return cls
