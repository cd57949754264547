"""NIXL over UCX between two real processes: registered DRAM (numpy and torch) read with the
broker's packed descriptors, completion notifications, and the transport's refusals."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from prerequisites import require_module

require_module("nixl", "engine")
import torch

from broker.wire import pack
from clients.nixl_transport import NixlAgent, NixlTransport, UnavailableBackendError
from clients.transport import Region, TransferError, describe_region

SIZE = 4 << 20
WAIT_S = 30.0


def source_bytes(seed: int, size: int = SIZE) -> np.ndarray:
    """What the target process holds in its region ``seed``: recomputable anywhere."""
    return ((np.arange(size, dtype=np.uint64) * 2654435761 + seed * 40503) >> np.uint64(7)).astype(
        np.uint8
    )


def _target(conn) -> None:
    """The remote process: registers a numpy array and a torch tensor, answers ``notes`` with
    the notifications received so far (polling meanwhile, which readers need), stops on ``stop``."""
    agent = NixlAgent(f"target-{os.getpid()}")
    array = source_bytes(0)
    tensor = torch.from_numpy(source_bytes(1).copy())
    regions = agent.register([array]) + agent.register([tensor])
    conn.send((agent.name, agent.metadata, [r.base_addr for r in regions]))
    notes: list[bytes] = []
    while True:
        for messages in agent.notifications().values():
            notes.extend(messages)
        if conn.poll(0.001):
            command = conn.recv()
            if command == "stop":
                break
            if command == "die":  # no goodbye: the peer learns it from UCX
                os._exit(0)
            conn.send(list(notes))
    agent.close()


@dataclass
class Target:
    name: str
    metadata: bytes
    bases: list[int]
    conn: object

    def notes(self) -> list[bytes]:
        self.conn.send("notes")
        return self.conn.recv()


def start_target() -> tuple[Target, mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_target, args=(child,), daemon=True)
    process.start()
    assert parent.poll(60), "the target process did not start"
    return Target(*parent.recv(), parent), process


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    remote, process = start_target()
    yield remote
    remote.conn.send("stop")
    process.join(10)
    assert process.exitcode == 0


def scattered(base_local: int, base_remote: int, count: int, seed: int) -> tuple[np.ndarray, ...]:
    """``count`` runs of varied length: run *i* comes from slot *i* of the remote region and
    lands in a shuffled slot of the local one; descriptors in shuffled order."""
    rng = np.random.default_rng(seed)
    width = SIZE // count
    lengths = rng.integers(1, width + 1, count)
    remote_off = np.arange(count, dtype=np.int64) * width + rng.integers(0, width, count) % (
        width - lengths + 1
    )
    local_off = rng.permutation(count).astype(np.int64) * width
    order = rng.permutation(count)
    lengths, remote_off, local_off = lengths[order], remote_off[order], local_off[order]
    zeros = np.zeros(count, dtype=np.int64)
    local = np.stack([base_local + local_off, lengths, zeros], axis=1)
    remote = np.stack([base_remote + remote_off, lengths, zeros], axis=1)
    return local, remote, local_off, remote_off, lengths


def expected_after(
    source: np.ndarray, local_off: np.ndarray, remote_off: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    out = np.zeros(SIZE, dtype=np.uint8)
    for lo, ro, n in zip(local_off.tolist(), remote_off.tolist(), lengths.tolist()):
        out[lo : lo + n] = source[ro : ro + n]
    return out


def test_read_moves_real_bytes_between_processes(target: Target) -> None:
    agent = NixlAgent(f"reader-{os.getpid()}-sync")
    try:
        dst = np.zeros(SIZE, dtype=np.uint8)
        agent.register([dst])
        agent.add_remote(target.name, target.metadata)
        local, remote, local_off, remote_off, lengths = scattered(
            dst.ctypes.data, target.bases[0], 1000, 7
        )
        transfer = agent.read(
            target.name, pack(local), pack(remote), notification=b"pdbroker:t1:p1:0"
        )
        assert (transfer.nbytes, transfer.num_descriptors) == (int(lengths.sum()), 1000)
        transfer.wait(WAIT_S)
        transfer.release()
        assert np.array_equal(dst, expected_after(source_bytes(0), local_off, remote_off, lengths))
        deadline = time.monotonic() + WAIT_S
        while b"pdbroker:t1:p1:0" not in target.notes():
            assert time.monotonic() < deadline, "the notification never reached the target"
            time.sleep(0.01)
    finally:
        agent.close()


def test_async_read_into_a_torch_tensor(target: Target) -> None:
    agent = NixlTransport().agent(f"reader-{os.getpid()}-async")
    try:
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        (region,) = agent.register([dst])
        assert region == Region(dst.data_ptr(), SIZE, 0, "DRAM") == describe_region(dst)
        agent.add_remote(target.name, target.metadata)
        agent.add_remote(target.name, target.metadata)  # the same metadata again is a no-op
        local, remote, local_off, remote_off, lengths = scattered(
            dst.data_ptr(), target.bases[1], 64, 3
        )
        transfer = agent.read(target.name, local, remote)
        asyncio.run(transfer.wait_async(WAIT_S))
        transfer.release()
        transfer.release()
        assert np.array_equal(
            dst.numpy(), expected_after(source_bytes(1), local_off, remote_off, lengths)
        )
    finally:
        agent.close()
        agent.close()


def test_read_from_a_dead_process_fails_fast() -> None:
    remote, process = start_target()
    agent = NixlAgent(f"reader-{os.getpid()}-dead")
    try:
        dst = np.zeros(SIZE, dtype=np.uint8)
        agent.register([dst])
        agent.add_remote(remote.name, remote.metadata)
        remote.conn.send("die")
        process.join(10)
        started = time.monotonic()
        with pytest.raises(TransferError):
            local, remote_rows, *_ = scattered(dst.ctypes.data, remote.bases[0], 8, 1)
            agent.read(remote.name, local, remote_rows).wait(WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2
    finally:
        agent.close()


def test_refusals(target: Target) -> None:
    agent = NixlAgent(f"reader-{os.getpid()}-bad")
    try:
        dst = np.zeros(1024, dtype=np.uint8)
        agent.register([dst])
        row = np.array([[dst.ctypes.data, 16, 0]], dtype=np.int64)
        with pytest.raises(TransferError, match="unknown remote agent"):
            agent.read(target.name, row, row)
        with pytest.raises(TransferError, match="belongs to agent"):
            agent.add_remote("someone-else", target.metadata)
        agent.add_remote(target.name, target.metadata)
        with pytest.raises(TransferError, match="lengths differ"):
            agent.read(target.name, row, row * np.array([1, 2, 1]))
        with pytest.raises(TransferError, match="nothing to read"):
            agent.read(target.name, b"", b"")
    finally:
        agent.close()


def test_a_ucx_agent_with_worker_threads_moves_real_bytes(target: Target) -> None:
    """Backends named explicitly, with the UCX thread setting the vLLM connector passes for
    ``num_threads``: the agent runs UCX with those threads, and a read arrives intact."""
    agent = NixlTransport(("UCX",), {"num_threads": "2"}).agent(f"reader-{os.getpid()}-threads")
    try:
        assert agent._nixl.get_backend_params("UCX")["num_threads"] == "2"
        dst = np.zeros(SIZE, dtype=np.uint8)
        agent.register([dst])
        agent.add_remote(target.name, target.metadata)
        local, remote, local_off, remote_off, lengths = scattered(
            dst.ctypes.data, target.bases[0], 256, 11
        )
        transfer = agent.read(target.name, local, remote)
        asyncio.run(transfer.wait_async(WAIT_S))
        transfer.release()
        assert np.array_equal(dst, expected_after(source_bytes(0), local_off, remote_off, lengths))
    finally:
        agent.close()


def test_a_backend_nixl_cannot_load_is_refused() -> None:
    """NIXL itself only warns about a backend it has no plugin for; the agent refuses it,
    naming the plugins that are installed."""
    with pytest.raises(
        UnavailableBackendError,
        match=r"^backends: 'NOPE' is not an installed NIXL plugin; installed: \[.*'UCX'",
    ):
        NixlAgent(f"reader-{os.getpid()}-nope", ("UCX", "NOPE"))
    with pytest.raises(UnavailableBackendError, match="^backends: 'NOPE'"):
        NixlTransport(("NOPE",)).check()
    NixlTransport(("UCX",)).check()
