"""Region-relative planner runs → absolute NIXL descriptors ``(addr, len, dev_id)``.

Every descriptor is checked against its region's registered length before it leaves the
broker: no address outside a registered region is ever handed out.
"""

from __future__ import annotations

import numpy as np

#: Bytes of one packed descriptor: three little-endian int64 (addr, len, dev_id).
DESCRIPTOR_BYTES = 24


class OutOfRegionError(AssertionError):
    """A run reaches outside its region: a planner or registration bug, never user input."""


def absolute_descriptors(
    region_table: np.ndarray, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str
) -> np.ndarray:
    """``(n, 3)`` int64 rows ``(base[region] + offset, length, device[region])``.

    ``region_table`` is ``(3, num_regions)``: base address, length (bytes) and device id
    per region (:attr:`broker.records.RankRegistration.region_table`). Raises
    :class:`OutOfRegionError` if a run starts before its region or ends past
    ``base + length_bytes``; ``region`` must index the table (the planner's regions do).
    """
    out = np.empty((region.size, 3), dtype=np.int64)
    if not region.size:
        return out
    try:
        base, device = region_table[0][region], region_table[2][region]
    except IndexError:
        raise OutOfRegionError(
            f"{side}: region index outside the {region_table.shape[1]} registered"
        ) from None
    end = offset + length
    # Ending within the shortest region is enough; only otherwise look up each one's length.
    if int(offset.min()) < 0 or (
        int(end.max()) > int(region_table[1].min()) and bool((end > region_table[1][region]).any())
    ):
        raise OutOfRegionError(f"{side}: a descriptor leaves its registered region")
    np.add(base, offset, out=out[:, 0])
    out[:, 1] = length
    out[:, 2] = device
    return out


def pack(descriptors: np.ndarray) -> bytes:
    """``(n, 3)`` int64 rows as ``n * 24`` bytes of little-endian int64 triples."""
    return np.ascontiguousarray(descriptors, dtype="<i8").tobytes()


def unpack(data: bytes) -> np.ndarray:
    """Inverse of :func:`pack`; raises ``ValueError`` unless ``len(data)`` is a multiple of 24."""
    if len(data) % DESCRIPTOR_BYTES:
        raise ValueError(
            f"{len(data)} bytes is not a whole number of {DESCRIPTOR_BYTES}-byte descriptors"
        )
    return np.frombuffer(data, dtype="<i8").reshape(-1, 3).astype(np.int64)
