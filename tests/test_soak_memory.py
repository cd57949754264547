"""The soak's memory verdict on synthetic RSS series: one sample a second, MiB with noise."""

from __future__ import annotations

import numpy as np

from harness.soak_memory import (
    GROWTH_LIMIT_PCT,
    MAX_WARMUP_S,
    MIN_JUDGED_S,
    MIN_WARMUP_S,
    SETTLE_WINDOW_S,
    MemoryVerdict,
    judge_memory,
)

MIB = 2**20


def series(seconds: int, mib_at, noise_mib: float = 0.2, seed: int = 0) -> list[tuple[float, int]]:
    """(t, bytes) every second from 1 s to ``seconds``: ``mib_at(t)`` plus uniform noise."""
    rng = np.random.default_rng(seed)
    return [
        (float(t), int((mib_at(t) + rng.uniform(-noise_mib, noise_mib)) * MIB))
        for t in range(1, seconds + 1)
    ]


def warming(t: float) -> float:
    """A healthy broker as measured at 200 transfers/s: 64 MiB rising to 86 MiB by 80 s, flat
    after."""
    return 64 + 22 * min(t, 80) / 80


def test_a_flat_series_is_judged_from_the_shortest_warm_up() -> None:
    verdict = judge_memory(series(600, lambda t: 85.0))
    # The first sample with a whole settling window behind it (samples start at 1 s).
    assert verdict.levelled and verdict.warmup_s == SETTLE_WINDOW_S + 1 >= MIN_WARMUP_S
    assert verdict.growth_pct is not None and abs(verdict.growth_pct) < 1
    assert not verdict.grew
    assert verdict.describe() == (
        f"{verdict.growth_pct:+.2f}% over 569 s after a 31 s warm-up; limit 10%"
    )


def test_warming_then_flat_is_judged_only_after_rss_levelled_off() -> None:
    verdict = judge_memory(series(240, warming))
    assert verdict.levelled and 80 <= verdict.warmup_s <= 110
    assert verdict.growth_pct is not None and abs(verdict.growth_pct) < 1
    assert not verdict.grew
    # What the old fixed warm-up (a fifth of the run) measured: the tail of the rise.
    early = [(t, b) for t, b in series(240, warming) if t >= 48]
    assert 100 * (early[-1][1] - early[0][1]) / early[0][1] > 2


def test_a_steady_leak_never_levels_off_and_fails() -> None:
    verdict = judge_memory(series(600, lambda t: 80 + 3 * t / 60))  # +3 MiB a minute
    assert not verdict.levelled and verdict.warmup_s == MAX_WARMUP_S
    assert verdict.growth_pct is not None and verdict.growth_pct > GROWTH_LIMIT_PCT
    assert verdict.grew
    assert "had not levelled off" in verdict.describe()


def test_a_slow_leak_passes_for_levelled_and_still_fails_over_a_long_run() -> None:
    verdict = judge_memory(series(600, lambda t: 80 * (1 + 0.015 * t / 60)))  # 1.5%/min
    assert verdict.levelled and verdict.warmup_s == SETTLE_WINDOW_S + 1
    assert verdict.grew


def test_a_run_shorter_than_warm_up_and_judged_span_is_not_judged() -> None:
    for seconds in (5, 15, 60, int(MIN_WARMUP_S + MIN_JUDGED_S) - 1):
        verdict = judge_memory(series(seconds, warming))
        assert verdict == MemoryVerdict(None, None, False, 0.0, verdict.reason)
        assert not verdict.grew
        assert verdict.describe() == (
            "not judged, run shorter than 90 s (30 s warm-up at least, then 60 s judged)"
        )


def test_rss_still_rising_in_a_short_run_is_not_judged() -> None:
    verdict = judge_memory(series(110, lambda t: 60 + 0.3 * t))  # rising all along
    assert verdict.growth_pct is None and verdict.warmup_s is None and not verdict.grew
    assert verdict.describe().startswith("not judged, RSS still warming up (+")


def test_too_little_load_after_the_warm_up_is_not_judged() -> None:
    verdict = judge_memory(series(130, warming))
    assert verdict.growth_pct is None and not verdict.grew
    assert verdict.levelled and verdict.judged_s < MIN_JUDGED_S
    assert f"{MIN_JUDGED_S:g} s needed" in verdict.describe()


def test_a_slow_warm_up_is_judged_once_it_levelled_off() -> None:
    """Warming until 200 s (a loaded machine), flat after: judged from there, not from the
    fallback for RSS that never levels off."""
    verdict = judge_memory(series(600, lambda t: 60 + 26 * min(t, 200) / 200))
    assert verdict.levelled and 200 <= verdict.warmup_s <= 230 and verdict.warmup_s > MAX_WARMUP_S
    assert not verdict.grew
