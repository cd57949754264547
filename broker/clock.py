"""The broker's notion of time, injectable so tests can drive expiry by hand."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch; never decreases."""


class SystemClock:
    """Wall-clock milliseconds anchored once, then advanced by the monotonic clock, so a
    wall-clock step cannot expire leases or transfers early."""

    def __init__(self) -> None:
        self._wall_ns = time.time_ns()
        self._mono_ns = time.monotonic_ns()

    def now_ms(self) -> int:
        return (self._wall_ns + time.monotonic_ns() - self._mono_ns) // 1_000_000
