"""Absolute descriptors: packing, and the region bounds check that guards every plan."""

from __future__ import annotations

import numpy as np
import pytest
from broker_helpers import hybrid

from broker.descriptors import (
    OutOfRegionError,
    RegionTable,
    absolute_descriptors,
    descriptor_pair,
)
from broker.records import MemoryRegion, RankRegistration, region_rows
from broker.wire import MemoryKind, Role, pack, unpack
from harness.scenarios import build_scenario

#: Two regions: 4 KiB at 0x1000 on device 0, 8 KiB at 0x10000 on device 3.
TABLE = RegionTable.of(np.array([[0x1000, 0x10000], [4096, 8192], [0, 3]], dtype=np.int64))


def runs(region: list[int], offset: list[int], length: list[int]) -> tuple[np.ndarray, ...]:
    return tuple(np.array(c, dtype=np.int64) for c in (region, offset, length))


def test_rows_are_base_plus_offset_with_the_region_device() -> None:
    out = absolute_descriptors(TABLE, *runs([0, 1, 1], [0, 4096, 100], [4096, 4096, 8]), "local")
    assert out.tolist() == [[0x1000, 4096, 0], [0x11000, 4096, 3], [0x10064, 8, 3]]
    assert unpack(pack(out)).tolist() == out.tolist()
    assert len(pack(out)) == 3 * 24
    assert absolute_descriptors(TABLE, *runs([], [], []), "local").shape == (0, 3)


@pytest.mark.parametrize(
    "region,offset,length",
    [
        ([0], [4000], [97]),  # one byte past the 4 KiB region
        ([1, 0], [0, -1], [8, 8]),  # before the region start
        ([2], [0], [8]),  # no such region
        ([-1], [0], [8]),  # no such region either (numpy would take the last one)
        ([0], [0], [0]),  # nothing to read
        ([1, 1], [64, 0], [8, -8]),  # a negative length
        ([1], [2**62], [2**62 + 2**61]),  # offset + length wraps around int64
        ([0, 1], [0, 2**63 - 1], [8, 1]),  # so does this one
    ],
)
def test_anything_outside_a_region_is_refused(region, offset, length) -> None:
    with pytest.raises(OutOfRegionError, match="remote"):
        absolute_descriptors(TABLE, *runs(region, offset, length), "remote")


def test_unpack_refuses_a_partial_descriptor() -> None:
    with pytest.raises(ValueError):
        unpack(b"\0" * 25)


def test_a_pair_equals_each_side_alone() -> None:
    remote_table = RegionTable.of(
        np.array([[0x80000, 0x90000], [8192, 8192], [1, 1]], dtype=np.int64)
    )
    region, local_offset, length = runs([0, 1, 1], [0, 4096, 100], [4096, 4096, 8])
    remote_offset = np.array([4096, 0, 8000], dtype=np.int64)
    local, remote = descriptor_pair(
        TABLE, remote_table, region, local_offset, remote_offset, length
    )
    assert local.tolist() == absolute_descriptors(TABLE, region, local_offset, length, "").tolist()
    assert remote.tolist() == [[0x81000, 4096, 1], [0x90000, 4096, 1], [0x91F40, 8, 1]]
    assert [a.shape for a in descriptor_pair(TABLE, TABLE, *runs([], [], []), length[:0])] == [
        (0, 3),
        (0, 3),
    ]


@pytest.mark.parametrize(
    "side,remote_offset",
    [("remote", [0, 8185]), ("remote", [-1, 0]), ("local and remote", None)],
)
def test_a_pair_refuses_either_side_leaving_its_region(side, remote_offset) -> None:
    region, local_offset, length = runs([0, 1], [0, 0], [8, 8])
    if remote_offset is None:  # a run of no length
        length = np.array([8, 0], dtype=np.int64)
        remote_offset = [0, 0]
    with pytest.raises(OutOfRegionError, match=f"^{side}:"):
        descriptor_pair(
            TABLE, TABLE, region, local_offset, np.array(remote_offset, dtype=np.int64), length
        )


def test_a_registration_derives_its_table_once() -> None:
    """A registration's table (made once, kept by every plan's ticket): its regions, the
    descriptor each region starts from, and its shortest length, which spares the look-up of
    each run's own region when the runs end within it but not when one ends past it."""
    regions = tuple(
        MemoryRegion(int(base), int(size), int(device), MemoryKind.VRAM)
        for base, size, device in TABLE.array.T
    )
    layout = build_scenario(hybrid(), 1, 1, 100).decode.ranks[0]
    table = RankRegistration(
        "D", Role.DECODE, 1, 0, "D-0", b"", region_rows(regions), layout, "t"
    ).region_table
    assert table.array.tolist() == TABLE.array.tolist() and table.shortest == 4096
    assert table.rows.tolist() == [[0x1000, 0, 0], [0x10000, 0, 3]]
    region, offset, length = runs([1, 0], [4096, 4000], [4096, 97])  # region 0 ends at 4096
    with pytest.raises(OutOfRegionError, match="^local:"):
        descriptor_pair(table, table, region, offset, offset, length)
    region = np.array([1, 1], dtype=np.int64)
    local, remote = descriptor_pair(table, table, region, offset, offset, length)
    assert local.tolist() == remote.tolist() == [[0x11000, 4096, 3], [0x10FA0, 97, 3]]
    assert table.rows.tolist() == [[0x1000, 0, 0], [0x10000, 0, 3]]  # never written
