"""The seam between the clients and the memory a rank registers and reads.

A :class:`Transport` makes one :class:`Agent` per hosted rank. The clients use an agent's
name and metadata (they go to the broker with the registration), :meth:`Agent.register` (the
rank's regions), remote agents' metadata from plans (:meth:`Agent.add_remote`), one read per
source of a plan (:meth:`Agent.read`, awaited to completion) and the notifications readers
send (:meth:`Agent.notifications`, polled by prefill clients). Two transports:
:class:`~clients.nixl_transport.NixlTransport` moves bytes with NIXL (engines);
:class:`NoMemoryTransport` moves none (load on the control plane: ``pdbroker soak``, the
benchmarks), so those drive the same client code as engines.

Descriptors travel as the broker packs them: bytes of little-endian int64 ``(addr, len,
dev_id)`` triples. :func:`descriptor_array` views them as an ``(n, 3)`` array without copying.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from broker.layout import EngineLayout

#: Memory kinds: host memory and device memory (NIXL's segment kinds).
DRAM = "DRAM"
VRAM = "VRAM"
_DESCRIPTOR_DTYPE = np.dtype("<i8")
# Reductions called as ufuncs, without the Python wrapper of ``array.min()``/``.all()``: a
# plan's check makes several on a few dozen rows, where the wrapper costs as much as the work.
_min, _max, _all = np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce
#: Bytes between two fake regions of :func:`fake_memory`.
FAKE_REGION_GAP = 1 << 20


class TransferError(RuntimeError):
    """A transport reported an error for a read, or refused to start it."""


class TransferTimeout(TransferError):
    """A read did not complete within its timeout (it was cancelled)."""


@dataclass(frozen=True)
class Region:
    """A contiguous memory range: ``length_bytes`` from ``base_addr`` on ``device_id``
    (0 for DRAM), of ``kind`` :data:`DRAM` or :data:`VRAM`."""

    base_addr: int
    length_bytes: int
    device_id: int = 0
    kind: str = DRAM

    def __post_init__(self) -> None:
        if self.kind not in (DRAM, VRAM):
            raise ValueError(f"kind must be {DRAM!r} or {VRAM!r}, got {self.kind!r}")
        if self.base_addr <= 0 or self.length_bytes <= 0:
            raise ValueError("a region needs a positive base address and length")


def describe_region(memory: object) -> Region:
    """The :class:`Region` of a contiguous torch tensor, a C-contiguous numpy array, or a
    :class:`Region` (returned as is). torch is never imported here: a tensor can only exist
    if its caller already imported it."""
    if isinstance(memory, Region):
        return memory
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(memory, torch.Tensor):
        if not memory.is_contiguous():
            raise ValueError("tensor regions must be contiguous")
        device = memory.get_device()
        return Region(
            memory.data_ptr(),
            memory.numel() * memory.element_size(),
            max(device, 0),
            DRAM if device < 0 else VRAM,
        )
    if isinstance(memory, np.ndarray):
        if not memory.flags.c_contiguous:
            raise ValueError("numpy regions must be C-contiguous")
        return Region(memory.ctypes.data, memory.nbytes)
    raise TypeError(f"cannot register {type(memory).__name__}: pass a tensor, an array or a Region")


def fake_memory(layout: EngineLayout, first_addr: int) -> dict[int, tuple[Region, ...]]:
    """Regions for every rank of ``layout`` that no memory backs, for
    :class:`NoMemoryTransport`: each exactly ``region_bytes`` long, all disjoint and
    :data:`FAKE_REGION_GAP` apart from ``first_addr`` on; rank *r*'s are :data:`VRAM` on
    device *r*."""
    memory, addr = {}, first_addr
    for rank in layout.ranks:
        stride = rank.region_bytes + FAKE_REGION_GAP
        memory[rank.tp_rank] = tuple(
            Region(addr + i * stride, rank.region_bytes, rank.tp_rank, VRAM)
            for i in range(rank.num_regions)
        )
        addr += rank.num_regions * stride
    return memory


def descriptor_array(packed: bytes | np.ndarray) -> np.ndarray:
    """``(n, 3)`` int64 ``(addr, len, dev_id)`` rows; packed bytes are viewed, not copied."""
    if isinstance(packed, np.ndarray):
        return np.asarray(packed, dtype=np.int64).reshape(-1, 3)
    if len(packed) % (3 * _DESCRIPTOR_DTYPE.itemsize):
        raise ValueError(f"{len(packed)} bytes is not a whole number of 24-byte descriptors")
    return np.frombuffer(packed, dtype=_DESCRIPTOR_DTYPE).reshape(-1, 3)


class RegionIndex:
    """Regions by memory kind and device, sorted by address: :meth:`covers` checks any number
    of descriptors against them with a few numpy calls (built once per rank)."""

    def __init__(self, regions: Iterable[Region]) -> None:
        self.regions = tuple(regions)
        kinds = (None, *sorted({r.kind for r in self.regions}))
        self._spans = {
            kind: _device_spans([r for r in self.regions if kind in (None, r.kind)])
            for kind in kinds
        }

    def covers(self, descriptors: np.ndarray, kind: str | None = None) -> bool:
        """Whether every ``(addr, len, dev_id)`` row lies inside one region (of ``kind``;
        None: of any kind) on the row's device."""
        if not len(descriptors):
            return True
        spans = self._spans.get(kind, ())
        addr, length, device = descriptors[:, 0], descriptors[:, 1], descriptors[:, 2]
        if not spans or int(_min(length)) <= 0:
            return False
        if len(spans) == 1:
            device_id, starts, ends = spans[0]
            return int(_min(device)) == int(_max(device)) == device_id and bool(
                _all(_within(addr, length, starts, ends))
            )
        placed = np.zeros(len(descriptors), dtype=bool)
        for device_id, starts, ends in spans:
            on = (device == device_id).nonzero()[0]
            placed[on] = _within(addr[on], length[on], starts, ends)
        return bool(placed.all())


def _device_spans(regions: Sequence[Region]) -> tuple[tuple[int, np.ndarray, np.ndarray], ...]:
    """Per device of ``regions``: its regions' starts and ends, sorted by start."""
    spans = []
    for device_id in sorted({r.device_id for r in regions}):
        mine = sorted((r for r in regions if r.device_id == device_id), key=lambda r: r.base_addr)
        starts = np.array([r.base_addr for r in mine], dtype=np.int64)
        ends = starts + np.array([r.length_bytes for r in mine], dtype=np.int64)
        spans.append((device_id, starts, ends))
    return tuple(spans)


def _within(
    addr: np.ndarray, length: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """Per run of positive ``length``, whether it lies inside one of the sorted spans."""
    index = starts.searchsorted(addr, side="right") - 1
    # ends - addr cannot wrap (addr >= its region's start > 0); addr + length could. Index -1
    # (before the first span) reads the last span's end, and is refused by ``index >= 0``.
    return (index >= 0) & (length <= ends[index] - addr)


def inside(descriptors: np.ndarray, regions: Sequence[Region]) -> bool:
    """Whether every descriptor lies inside one of ``regions`` on the descriptor's device."""
    return RegionIndex(regions).covers(descriptors)


def read_rows(
    local: bytes | np.ndarray, remote: bytes | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Both sides of a read as ``(n, 3)`` rows; :class:`TransferError` unless they pair one
    to one with equal lengths and there is something to read."""
    local_rows, remote_rows = descriptor_array(local), descriptor_array(remote)
    if local_rows.shape != remote_rows.shape:
        raise TransferError(f"{len(local_rows)} local descriptors for {len(remote_rows)} remote")
    if not len(local_rows):
        raise TransferError("nothing to read")
    if not np.array_equal(local_rows[:, 1], remote_rows[:, 1]):
        raise TransferError("local and remote descriptor lengths differ")
    return local_rows, remote_rows


class Read(Protocol):
    """One posted read: ``nbytes`` in ``num_descriptors`` descriptors from ``remote_agent``
    (read-only: a frozen dataclass is a read too)."""

    @property
    def remote_agent(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def num_descriptors(self) -> int: ...

    async def wait_async(self, timeout_s: float) -> None:
        """Return once every byte arrived; :class:`TransferError` if it failed,
        :class:`TransferTimeout` (the read cancelled) after ``timeout_s``."""
        ...

    def release(self) -> None:
        """Free the read (cancelling it if still running). Idempotent."""
        ...


class Agent(Protocol):
    """One rank's endpoint: its registered memory, the remote agents it knows, its reads.
    Used from one thread (the client's event loop)."""

    name: str

    @property
    def metadata(self) -> bytes:
        """What readers need to reach this agent (:meth:`add_remote`)."""
        ...

    def register(self, memory: Iterable[object]) -> tuple[Region, ...]:
        """Register tensors, arrays or :class:`Region` s (all of one kind); the caller keeps
        the memory alive until :meth:`close`."""
        ...

    def knows(self, agent_name: str) -> bool: ...

    def add_remote(self, agent_name: str, metadata: bytes) -> None:
        """Load ``agent_name``'s metadata (new metadata replaces the old); raises
        :class:`TransferError` if the metadata is another agent's."""
        ...

    def read(
        self,
        remote_agent: str,
        local: bytes | np.ndarray,
        remote: bytes | np.ndarray,
        local_kind: str = DRAM,
        remote_kind: str = DRAM,
        notification: bytes = b"",
    ) -> Read:
        """Post one read filling ``local`` descriptor *i* from ``remote`` descriptor *i* of
        ``remote_agent``, which gets ``notification`` when it is done."""
        ...

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender; also progresses the agent
        (a target must poll for readers to connect)."""
        ...

    def close(self) -> None:
        """Forget remote agents, deregister memory. Idempotent."""
        ...


class Transport(Protocol):
    """Makes the agent of each hosted rank; ``name`` is unique across the fleet."""

    def agent(self, name: str) -> Agent: ...


# --------------------------------------------------------------------------- no memory


@dataclass(frozen=True)
class CompletedRead:
    """A read of :class:`NoMemoryAgent`: complete when posted."""

    remote_agent: str
    nbytes: int
    num_descriptors: int

    async def wait_async(self, timeout_s: float) -> None:
        return None

    def release(self) -> None:
        return None


class NoMemoryTransport:
    """Agents that move no bytes and touch no memory: they register any regions (fake ones
    from :func:`fake_memory`), check reads as NIXL would (descriptors paired, lengths equal,
    the remote agent's metadata loaded) and complete them at once. A read's notification
    reaches its target when that agent was made by this transport (the same process),
    else it is dropped. ``metadata_bytes``: the size of each agent's metadata, what a real
    agent sends readers (NIXL's is a few KiB)."""

    def __init__(self, metadata_bytes: int = 256) -> None:
        self.metadata_bytes = metadata_bytes
        self._agents: dict[str, NoMemoryAgent] = {}

    def agent(self, name: str) -> NoMemoryAgent:
        agent = NoMemoryAgent(name, self)
        self._agents[name] = agent
        return agent

    def _deliver(self, target: str, sender: str, message: bytes) -> None:
        agent = self._agents.get(target)
        if agent is not None:
            agent.inbox.setdefault(sender, []).append(message)

    def _forget(self, agent: NoMemoryAgent) -> None:
        if self._agents.get(agent.name) is agent:
            del self._agents[agent.name]


class NoMemoryAgent:
    """An :class:`Agent` of :class:`NoMemoryTransport`; its metadata is its name, padded."""

    def __init__(self, name: str, transport: NoMemoryTransport) -> None:
        self.name = name
        self._transport = transport
        encoded = name.encode()
        self.metadata = encoded + b"\0" * max(0, transport.metadata_bytes - len(encoded))
        self.regions: tuple[Region, ...] = ()
        self.inbox: dict[str, list[bytes]] = {}
        self._remotes: dict[str, bytes] = {}

    def register(self, memory: Iterable[object]) -> tuple[Region, ...]:
        regions = tuple(describe_region(m) for m in memory)
        self.regions += regions
        return regions

    def knows(self, agent_name: str) -> bool:
        return agent_name in self._remotes

    def add_remote(self, agent_name: str, metadata: bytes) -> None:
        owner = metadata.split(b"\0", 1)[0].decode(errors="replace")
        if owner != agent_name:
            raise TransferError(f"metadata for {agent_name!r} belongs to agent {owner!r}")
        self._remotes[agent_name] = metadata

    def read(
        self,
        remote_agent: str,
        local: bytes | np.ndarray,
        remote: bytes | np.ndarray,
        local_kind: str = DRAM,
        remote_kind: str = DRAM,
        notification: bytes = b"",
    ) -> CompletedRead:
        local_rows, _ = read_rows(local, remote)
        if remote_agent not in self._remotes:
            raise TransferError(f"unknown remote agent {remote_agent!r}: add its metadata first")
        if notification:
            self._transport._deliver(remote_agent, self.name, notification)
        return CompletedRead(remote_agent, int(local_rows[:, 1].sum()), len(local_rows))

    def notifications(self) -> dict[str, list[bytes]]:
        inbox, self.inbox = self.inbox, {}
        return inbox

    def close(self) -> None:
        self._remotes.clear()
        self.regions = ()
        self._transport._forget(self)
