"""Several store threads, one service: the calls of a broker process on a shared store run
on a few threads, but only the thread holding the process's turn runs service code (the
service and the store's caches are not thread-safe); a thread hands the turn on while it
waits for Redis (:func:`waiting`, around every exchange on a Redis connection), so one
call's round trips overlap the others' work and round trips. Each call is still one unit of
work, checked by Redis (``WATCH``) against every other, as the calls of other processes are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _Holding(threading.local):
    """The turns this thread holds (None: it holds none), its seconds waiting in the call
    that holds them, and the seconds the last such call held them."""

    turns: Turns | None = None
    waited: float = 0.0
    held: float = 0.0


_HOLDING = _Holding()


class Turns:
    """The turn to run service code in one process: one thread holds it at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` holding the turn, except while it waits for Redis (the
        seconds it held the turn: :func:`last_held`)."""
        holding = _HOLDING
        self._lock.acquire()
        acquired = time.perf_counter()
        holding.turns, holding.waited = self, 0.0
        try:
            return function(*args)
        finally:
            holding.turns = None
            holding.held = time.perf_counter() - acquired - holding.waited
            self._lock.release()


def last_held() -> float:
    """Seconds the last :meth:`Turns.run` on this thread held the turn."""
    return _HOLDING.held


def waiting(io: Callable[..., T], *args: Any) -> T:
    """``io(*args)`` (a wait for Redis) with the turn handed on, if this thread holds one."""
    holding = _HOLDING
    turns = holding.turns
    if turns is None:
        return io(*args)
    holding.turns = None
    turns._lock.release()
    started = time.perf_counter()
    try:
        return io(*args)
    finally:
        turns._lock.acquire()
        holding.waited += time.perf_counter() - started
        holding.turns = turns
