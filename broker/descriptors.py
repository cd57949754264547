"""Region-relative planner runs → absolute NIXL descriptors ``(addr, len, dev_id)``.

Every descriptor is checked against its region's registered length before it leaves the
broker: no address outside a registered region is ever handed out.
"""

from __future__ import annotations

import numpy as np

from broker.plan_templates import Bounds, run_bounds

# Reductions called as ufuncs: ``array.min()`` adds a Python wrapper per call, and a plan's
# descriptors take several of these.
_min, _max = np.minimum.reduce, np.maximum.reduce


class OutOfRegionError(AssertionError):
    """A run reaches outside its region: a planner or registration bug, never user input."""


def absolute_descriptors(
    region_table: np.ndarray, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str
) -> np.ndarray:
    """``(n, 3)`` int64 rows ``(base[region] + offset, length, device[region])``.

    ``region_table`` is ``(3, num_regions)``: base address, length (bytes) and device id
    per region (:attr:`broker.records.RankRegistration.region_table`; ``base + length`` below
    2**63). Raises :class:`OutOfRegionError` unless every region index is in the table, every
    length positive and every run inside ``[0, length_bytes)`` of its region. The checks
    cannot overflow: ``offset <= region_length - length`` with both sides non-negative.
    """
    if not region.size:
        return np.empty((0, 3), dtype=np.int64)
    if int(_min(length)) <= 0:
        raise OutOfRegionError(f"{side}: a descriptor has no length")
    regions, reach = (int(_min(region)), int(_max(region))), int(_max(offset)) + int(_max(length))
    reach_of = (int(_min(offset)), reach)
    floor = _shortest(region_table)
    _check_runs(region_table, region, regions, offset, length, reach_of, floor, side)
    out = np.empty((region.size, 3), dtype=np.int64)
    out[:, 1] = length
    _fill(out, region_table, region, offset)
    return out


def descriptor_pair(
    local_table: np.ndarray,
    remote_table: np.ndarray,
    region: np.ndarray,
    local_offset: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
    bounds: Bounds | None = None,
    shortest_regions: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`absolute_descriptors` of the same runs on both sides, ``(local, remote)``, made
    together; ``bounds``: the runs' :func:`run_bounds`, ``shortest_regions``: the length of
    each table's shortest region (each computed when not given)."""
    if not region.size:
        return np.empty((0, 3), dtype=np.int64), np.empty((0, 3), dtype=np.int64)
    lowest, highest, local_low, local_high, remote_low, remote_high, shortest, longest = (
        bounds or run_bounds(region, local_offset, remote_offset, length)
    )
    if shortest <= 0:
        raise OutOfRegionError("local and remote: a descriptor has no length")
    regions = (lowest, highest)
    local_floor, remote_floor = shortest_regions or (
        _shortest(local_table),
        _shortest(remote_table),
    )
    reach = (local_low, local_high + longest)
    _check_runs(local_table, region, regions, local_offset, length, reach, local_floor, "local")
    reach = (remote_low, remote_high + longest)
    _check_runs(remote_table, region, regions, remote_offset, length, reach, remote_floor, "remote")
    out = np.empty((2, region.size, 3), dtype=np.int64)
    out[:, :, 1] = length
    _fill(out[0], local_table, region, local_offset)
    _fill(out[1], remote_table, region, remote_offset)
    return out[0], out[1]


def _check_runs(
    region_table: np.ndarray,
    region: np.ndarray,
    regions: tuple[int, int],
    offset: np.ndarray,
    length: np.ndarray,
    reach: tuple[int, int],
    floor: int,
    side: str,
) -> None:
    """Raise :class:`OutOfRegionError` unless every run (all lengths positive) lies in its
    region, given the lowest and highest region index, the lowest offset and furthest end a
    run may have (``reach``) and the length of the table's shortest region (``floor``)."""
    if regions[0] < 0 or regions[1] >= region_table.shape[1]:
        raise OutOfRegionError(
            f"{side}: region index outside the {region_table.shape[1]} registered"
        )
    if reach[0] < 0:
        raise OutOfRegionError(f"{side}: a descriptor has a negative offset")
    # Ending within the shortest region is enough; only otherwise look up each one's length.
    if reach[1] > floor and bool((offset > region_table[1][region] - length).any()):
        raise OutOfRegionError(f"{side}: a descriptor leaves its registered region")


def _shortest(region_table: np.ndarray) -> int:
    """The length of the table's shortest region."""
    return int(_min(region_table[1]))


def _fill(
    out: np.ndarray, region_table: np.ndarray, region: np.ndarray, offset: np.ndarray
) -> None:
    """Write the address and device columns of ``(n, 3)`` rows ``out`` (regions checked)."""
    rows = region_table.take(region, axis=1)
    np.add(rows[0], offset, out=out[:, 0])
    out[:, 2] = rows[2]
