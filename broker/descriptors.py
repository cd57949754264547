"""Region-relative planner runs → absolute NIXL descriptors ``(addr, len, dev_id)``.

Every descriptor is checked against its region's registered length before it leaves the
broker: no address outside a registered region is ever handed out.
"""

from __future__ import annotations

import numpy as np

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
    return _absolute(
        region_table, region, (int(_min(region)), int(_max(region))), offset, length,
        int(_max(length)), side,
    )  # fmt: skip


def descriptor_pair(
    local_table: np.ndarray,
    remote_table: np.ndarray,
    region: np.ndarray,
    local_offset: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`absolute_descriptors` of the same runs on both sides, ``(local, remote)``; what
    the sides share (region indices, lengths) is checked once."""
    if not region.size:
        return np.empty((0, 3), dtype=np.int64), np.empty((0, 3), dtype=np.int64)
    if int(_min(length)) <= 0:
        raise OutOfRegionError("local and remote: a descriptor has no length")
    regions, longest = (int(_min(region)), int(_max(region))), int(_max(length))
    return (
        _absolute(local_table, region, regions, local_offset, length, longest, "local"),
        _absolute(remote_table, region, regions, remote_offset, length, longest, "remote"),
    )


def _absolute(
    region_table: np.ndarray,
    region: np.ndarray,
    regions: tuple[int, int],
    offset: np.ndarray,
    length: np.ndarray,
    longest: int,
    side: str,
) -> np.ndarray:
    """:func:`absolute_descriptors` given the lowest and highest region index and the longest
    length (all lengths known positive)."""
    if regions[0] < 0 or regions[1] >= region_table.shape[1]:
        raise OutOfRegionError(
            f"{side}: region index outside the {region_table.shape[1]} registered"
        )
    if int(_min(offset)) < 0:
        raise OutOfRegionError(f"{side}: a descriptor has a negative offset")
    # Ending within the shortest region is enough; only otherwise look up each one's length.
    if int(_max(offset)) + longest > int(_min(region_table[1])) and bool(
        (offset > region_table[1][region] - length).any()
    ):
        raise OutOfRegionError(f"{side}: a descriptor leaves its registered region")
    out = np.empty((region.size, 3), dtype=np.int64)
    np.add(region_table[0][region], offset, out=out[:, 0])
    out[:, 1] = length
    out[:, 2] = region_table[2][region]
    return out
