"""Region-relative planner runs → absolute NIXL descriptors ``(addr, len, dev_id)``.

Every descriptor is checked against its region's registered length before it leaves the
broker: no address outside a registered region is ever handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from broker.plan_templates import Bounds, run_bounds

# Reductions called as ufuncs: ``array.min()`` adds a Python wrapper per call, and a plan's
# descriptors take several of these.
_min, _max = np.minimum.reduce, np.maximum.reduce


class OutOfRegionError(AssertionError):
    """A run reaches outside its region: a planner or registration bug, never user input."""


@dataclass(frozen=True)
class RegionTable:
    """One rank's registered regions as descriptors are made from them, derived once per
    registration (:attr:`broker.records.RankRegistration.region_table`).

    ``array`` is ``(3, num_regions)`` int64: base address, length (bytes) and device id per
    region (``base + length`` below 2**63); ``rows`` holds per region the descriptor a run
    starts from, ``(base, 0, device)``; ``shortest`` is the shortest region's length."""

    array: np.ndarray
    rows: np.ndarray
    shortest: int

    @classmethod
    def of(cls, array: np.ndarray) -> RegionTable:
        rows = np.zeros((array.shape[1], 3), dtype=np.int64)
        rows[:, 0], rows[:, 2] = array[0], array[2]
        return cls(array, rows, int(_min(array[1], initial=np.iinfo(np.int64).max)))

    @property
    def size(self) -> int:
        """Number of regions."""
        return int(self.array.shape[1])


def absolute_descriptors(
    table: RegionTable, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str
) -> np.ndarray:
    """``(n, 3)`` int64 rows ``(base[region] + offset, length, device[region])``.

    Raises :class:`OutOfRegionError` unless every region index is in the table, every
    length positive and every run inside ``[0, length_bytes)`` of its region. The checks
    cannot overflow: ``offset <= region_length - length`` with both sides non-negative.
    """
    if not region.size:
        return np.empty((0, 3), dtype=np.int64)
    if int(_min(length)) <= 0:
        raise OutOfRegionError(f"{side}: a descriptor has no length")
    regions, reach = (int(_min(region)), int(_max(region))), int(_max(offset)) + int(_max(length))
    _check_runs(table, region, regions, offset, length, (int(_min(offset)), reach), side)
    return _filled(table, region, offset, length)


def descriptor_pair(
    local_table: RegionTable,
    remote_table: RegionTable,
    region: np.ndarray,
    local_offset: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
    bounds: Bounds | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`absolute_descriptors` of the same runs on both sides, ``(local, remote)``, made
    together; ``bounds``: the runs' :func:`run_bounds` (computed when not given)."""
    if not region.size:
        return np.empty((0, 3), dtype=np.int64), np.empty((0, 3), dtype=np.int64)
    lowest, highest, local_low, local_high, remote_low, remote_high, shortest, longest = (
        bounds or run_bounds(region, local_offset, remote_offset, length)
    )
    if shortest <= 0:
        raise OutOfRegionError("local and remote: a descriptor has no length")
    regions = (lowest, highest)
    reach = (local_low, local_high + longest)
    _check_runs(local_table, region, regions, local_offset, length, reach, "local")
    reach = (remote_low, remote_high + longest)
    _check_runs(remote_table, region, regions, remote_offset, length, reach, "remote")
    return (
        _filled(local_table, region, local_offset, length),
        _filled(remote_table, region, remote_offset, length),
    )


def _check_runs(
    table: RegionTable,
    region: np.ndarray,
    regions: tuple[int, int],
    offset: np.ndarray,
    length: np.ndarray,
    reach: tuple[int, int],
    side: str,
) -> None:
    """Raise :class:`OutOfRegionError` unless every run (all lengths positive) lies in its
    region, given the lowest and highest region index and the lowest offset and furthest
    end a run may have (``reach``)."""
    if regions[0] < 0 or regions[1] >= table.size:
        raise OutOfRegionError(f"{side}: region index outside the {table.size} registered")
    if reach[0] < 0:
        raise OutOfRegionError(f"{side}: a descriptor has a negative offset")
    # Ending within the shortest region is enough; only otherwise look up each one's length.
    if reach[1] > table.shortest and bool((offset > table.array[1][region] - length).any()):
        raise OutOfRegionError(f"{side}: a descriptor leaves its registered region")


def _filled(
    table: RegionTable, region: np.ndarray, offset: np.ndarray, length: np.ndarray
) -> np.ndarray:
    """``(n, 3)`` rows of runs whose regions are checked: each its region's starting row
    (one gather), offset added, length set."""
    out = table.rows.take(region, axis=0)
    out[:, 0] += offset
    out[:, 1] = length
    return out
