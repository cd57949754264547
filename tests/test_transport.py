"""The transport seam without NIXL: packed descriptor arrays, region checks, fake memory, and
the no-memory transport the soak and the benchmarks drive the clients with."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from broker_helpers import hybrid

from broker.models import build_engine_layout
from broker.wire import pack
from clients.transport import (
    FAKE_REGION_GAP,
    VRAM,
    NoMemoryTransport,
    Region,
    TransferError,
    descriptor_array,
    fake_memory,
    inside,
)


def test_descriptor_arrays() -> None:
    rows = np.array([[4096, 100, 0], [8192, 8, 1]], dtype=np.int64)
    view = descriptor_array(pack(rows))
    assert np.array_equal(view, rows) and not view.flags.writeable  # a view, not a copy
    with pytest.raises(ValueError, match="24-byte"):
        descriptor_array(b"x" * 25)
    regions = [Region(4096, 200, 0), Region(8192, 8, 1)]
    assert inside(rows, regions)
    assert not inside(rows + np.array([[0, 101, 0], [0, 0, 0]]), regions)  # runs past its region
    assert not inside(rows + np.array([[0, 0, 0], [0, 0, 1]]), regions)  # wrong device
    assert not inside(np.array([[100, 1, 0]]), regions)  # before every region


def test_fake_memory_is_disjoint_and_sized_by_the_layout() -> None:
    layout = build_engine_layout(hybrid(), 2, 8, 64)
    memory = fake_memory(layout, 1 << 40)
    assert sorted(memory) == [0, 1]
    regions = sorted((r for rank in memory.values() for r in rank), key=lambda r: r.base_addr)
    assert regions[0].base_addr == 1 << 40
    for rank in layout.ranks:
        assert len(memory[rank.tp_rank]) == rank.num_regions
        for region in memory[rank.tp_rank]:
            assert (region.length_bytes, region.device_id, region.kind) == (
                rank.region_bytes,
                rank.tp_rank,
                VRAM,
            )
    for before, after in itertools.pairwise(regions):
        assert after.base_addr == before.base_addr + before.length_bytes + FAKE_REGION_GAP


def test_no_memory_reads_complete_at_once_and_notify_in_process() -> None:
    transport = NoMemoryTransport(metadata_bytes=4096)
    target, reader = transport.agent("prefill.rank0"), transport.agent("decode.rank0")
    assert len(target.metadata) == 4096
    assert reader.register([Region(1 << 40, 1 << 20)]) == (Region(1 << 40, 1 << 20),)
    rows = np.array([[1 << 40, 4096, 0], [(1 << 40) + 8192, 100, 0]], dtype=np.int64)
    with pytest.raises(TransferError, match="unknown remote agent"):
        reader.read(target.name, rows, rows)
    with pytest.raises(TransferError, match="belongs to agent"):
        reader.add_remote("someone-else", target.metadata)
    reader.add_remote(target.name, target.metadata)
    assert reader.knows(target.name)
    with pytest.raises(TransferError, match="lengths differ"):
        reader.read(target.name, rows, rows * np.array([1, 2, 1]))
    with pytest.raises(TransferError, match="nothing to read"):
        reader.read(target.name, b"", b"")
    read = reader.read(target.name, pack(rows), pack(rows), VRAM, VRAM, b"t1:done")
    asyncio.run(read.wait_async(0.0))
    read.release()
    assert (read.nbytes, read.num_descriptors) == (4196, 2)
    assert target.notifications() == {"decode.rank0": [b"t1:done"]}
    assert target.notifications() == {}
    target.close()
    reader.read(target.name, rows, rows, notification=b"t2:done")  # a closed target: dropped
    assert target.notifications() == {}


def test_notifications_to_another_process_are_dropped() -> None:
    here, elsewhere = NoMemoryTransport(), NoMemoryTransport()
    reader, target = here.agent("decode.rank0"), elsewhere.agent("prefill.rank0")
    reader.add_remote(target.name, target.metadata)
    rows = np.array([[4096, 8, 0]], dtype=np.int64)
    reader.read(target.name, rows, rows, notification=b"t1:done")
    assert target.notifications() == {}
