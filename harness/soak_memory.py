"""The soak's memory verdict, a function of the broker's RSS samples alone.

A healthy broker's RSS rises while its caches, retained finished transfers and deadline index
fill, then levels off (about 85 s at 200 transfers/s on 2 cores); growth during that warm-up
says nothing about leaks. The warm-up ends at the first sample, no earlier than
:data:`MIN_WARMUP_S`, whose preceding :data:`SETTLE_WINDOW_S` grew less than
:data:`SETTLE_GROWTH_PCT` (a line fitted through the window); a steady leak never levels off,
so RSS that never does is judged from :data:`MAX_WARMUP_S`. The growth of a line fitted
through the samples after the warm-up is judged against :data:`GROWTH_LIMIT_PCT`, if they span
at least :data:`MIN_JUDGED_S`; otherwise memory is not judged and the verdict says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Sliding window (s) over which RSS must grow less than :data:`SETTLE_GROWTH_PCT` to have
#: levelled off.
SETTLE_WINDOW_S = 30.0
SETTLE_GROWTH_PCT = 1.0
#: Shortest warm-up (s): the soak's transfers' TTL (the broker's default, 30 s), for which a
#: finished transfer's deadline-index entry lives on.
MIN_WARMUP_S = 30.0
#: Where RSS that never levels off is judged from (s).
MAX_WARMUP_S = 120.0
#: Shortest span after the warm-up (s) that is judged.
MIN_JUDGED_S = 60.0
#: RSS growth over the judged span at which the soak fails (%).
GROWTH_LIMIT_PCT = 10.0


@dataclass(frozen=True)
class MemoryVerdict:
    """``growth_pct``: growth over the judged span, None when memory was not judged (then
    ``reason`` says why); ``warmup_s``: where the judged span starts, None if RSS never
    levelled off in a run too short for :data:`MAX_WARMUP_S`; ``levelled``: whether RSS
    levelled off by then; ``judged_s``: the span after the warm-up."""

    growth_pct: float | None
    warmup_s: float | None
    levelled: bool
    judged_s: float
    reason: str = ""

    @property
    def grew(self) -> bool:
        """RSS grew past the limit after the warm-up: a failed soak."""
        return self.growth_pct is not None and self.growth_pct >= GROWTH_LIMIT_PCT

    def describe(self) -> str:
        """One line: the growth judged against the limit, or why memory was not judged."""
        if self.growth_pct is None:
            return f"not judged, {self.reason}"
        return (
            f"{self.growth_pct:+.2f}% over {self.judged_s:.0f} s after "
            f"{_warmup_text(self.warmup_s, self.levelled)}; limit {GROWTH_LIMIT_PCT:g}%"
        )


def judge_memory(samples: Sequence[tuple[float, int]]) -> MemoryVerdict:
    """The verdict on ``samples``: (seconds since the load started, RSS bytes), in order."""
    shortest = MIN_WARMUP_S + MIN_JUDGED_S
    if not samples or samples[-1][0] < shortest:
        reason = (
            f"run shorter than {shortest:g} s ({MIN_WARMUP_S:g} s warm-up at least, "
            f"then {MIN_JUDGED_S:g} s judged)"
        )
        return MemoryVerdict(None, None, False, 0.0, reason)
    times = np.array([t for t, _ in samples], dtype=np.float64)
    rss = np.array([b for _, b in samples], dtype=np.float64)
    warmup_s, levelled = _warmup_end(times, rss)
    if warmup_s is None:
        growth = _fitted_growth_pct(*_window(times, rss, times[-1]))
        reason = (
            f"RSS still warming up ({growth:+.1f}% over the last {SETTLE_WINDOW_S:g} s; "
            f"judged from {MAX_WARMUP_S:g} s at the latest, then {MIN_JUDGED_S:g} s)"
        )
        return MemoryVerdict(None, None, False, 0.0, reason)
    after = times >= warmup_s
    judged_s = float(times[-1] - warmup_s)
    if judged_s < MIN_JUDGED_S:
        reason = (
            f"{judged_s:.0f} s of load after {_warmup_text(warmup_s, levelled)}, "
            f"{MIN_JUDGED_S:g} s needed"
        )
        return MemoryVerdict(None, warmup_s, levelled, judged_s, reason)
    growth = round(_fitted_growth_pct(times[after], rss[after]), 2)
    return MemoryVerdict(growth, warmup_s, levelled, judged_s)


def _warmup_text(warmup_s: float | None, levelled: bool) -> str:
    if levelled:
        return f"a {warmup_s:.0f} s warm-up"
    return f"{warmup_s:.0f} s (RSS had not levelled off)"


def _warmup_end(times: np.ndarray, rss: np.ndarray) -> tuple[float | None, bool]:
    """Where the warm-up ends, and whether RSS levelled off there (if it never did,
    :data:`MAX_WARMUP_S`, or None for a run shorter than that)."""
    for t in times[times >= max(MIN_WARMUP_S, times[0] + SETTLE_WINDOW_S)]:
        if _fitted_growth_pct(*_window(times, rss, t)) < SETTLE_GROWTH_PCT:
            return float(t), True
    return (MAX_WARMUP_S, False) if times[-1] >= MAX_WARMUP_S else (None, False)


def _window(times: np.ndarray, rss: np.ndarray, end: float) -> tuple[np.ndarray, np.ndarray]:
    """The samples of the :data:`SETTLE_WINDOW_S` up to ``end``."""
    inside = (times >= end - SETTLE_WINDOW_S) & (times <= end)
    return times[inside], rss[inside]


def _fitted_growth_pct(times: np.ndarray, rss: np.ndarray) -> float:
    """Growth of the least-squares line through the samples from their first time to their
    last, in % of the line's value at the first."""
    if len(times) < 2:
        return 0.0
    slope, intercept = np.polyfit(times, rss, 1)
    start = intercept + slope * times[0]
    return float(100 * slope * (times[-1] - times[0]) / start)
