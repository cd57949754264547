"""The only module that touches NIXL: the :class:`~clients.transport.Transport` of engines,
one agent per rank, its registered memory, and reads.

The broker's packed descriptors are viewed as ``(n, 3)`` arrays
(:func:`~clients.transport.descriptor_array`) and NIXL builds its descriptor list from that
array in C++, so no Python loop runs per descriptor.

Two choices, measured as docs/ARCHITECTURE.md ("Engine-side choices") records:

* **No progress thread.** NIXL's default progress thread spins on idle agents. Agents here
  are created without it and progressed by whoever polls (:meth:`Transfer.poll` on the
  reader, :meth:`NixlAgent.notifications` on the target). A target that never polls never
  finishes the reader's wire-up, so prefill clients poll.
* **One-shot descriptor lists.** Per request the descriptors are new, and ``initialize_xfer``
  with explicit lists costs less than ``prep_xfer_dlist`` on both sides plus
  ``make_prepped_xfer``, which only win when reused; a plan never is. NIXL's copy costs a
  fixed amount per descriptor, so coalesced plans matter.

Not thread-safe: use one agent from one thread (the clients use their event loop's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from clients.transport import (
    DRAM,
    Region,
    TransferError,
    TransferTimeout,
    describe_region,
    read_rows,
)

log = logging.getLogger(__name__)
#: Polls that only yield before :meth:`Transfer.wait_async` starts sleeping between polls.
_SPIN_POLLS = 64


class _XferHandle(Protocol):
    """What :class:`Transfer` uses of NIXL's transfer handle (``nixl_xfer_handle``)."""

    def release(self) -> None: ...


class Transfer:
    """One posted READ. Poll it (that also progresses the agent) until done, then
    :meth:`release` it; a released transfer that was still running is cancelled."""

    def __init__(
        self,
        agent: NixlAgent,
        handle: _XferHandle,
        remote_agent: str,
        nbytes: int,
        num_descriptors: int,
        done: bool,
    ) -> None:
        self._agent = agent
        self._handle: _XferHandle | None = handle
        self.remote_agent = remote_agent
        self.nbytes = nbytes
        self.num_descriptors = num_descriptors
        self._done = done

    def poll(self) -> bool:
        """``True`` once every byte arrived; raises :class:`TransferError` if NIXL failed."""
        if self._done:
            return True
        if self._handle is None:
            raise TransferError(f"read from {self.remote_agent} was released before it completed")
        try:
            state = self._agent._nixl.check_xfer_state(self._handle)
        except Exception as exc:  # NIXL's binding errors share no base class
            raise TransferError(f"read from {self.remote_agent} failed: {exc}") from exc
        if state == "ERR":
            raise TransferError(f"read from {self.remote_agent} failed")
        self._done = state == "DONE"
        return self._done

    def wait(self, timeout_s: float, sleep_s: float = 0.0002) -> None:
        """Block until done; raises :class:`TransferTimeout` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.poll():
            if time.monotonic() > deadline:
                self._timeout(timeout_s)
            time.sleep(sleep_s)

    async def wait_async(self, timeout_s: float, sleep_s: float = 0.0002) -> None:
        """Poll without blocking the event loop: yield for the first polls (a loopback read
        is usually done by then), then sleep ``sleep_s`` between polls."""
        deadline = time.monotonic() + timeout_s
        polls = 0
        while not self.poll():
            if time.monotonic() > deadline:
                self._timeout(timeout_s)
            polls += 1
            await asyncio.sleep(0 if polls < _SPIN_POLLS else sleep_s)

    def _timeout(self, timeout_s: float) -> None:
        self.release()
        raise TransferTimeout(
            f"read of {self.nbytes} bytes from {self.remote_agent} did not "
            f"complete within {timeout_s:g} s"
        )

    def release(self) -> None:
        """Free the NIXL handle (cancelling the transfer if it is still running). Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.release()
            except Exception:  # NIXL keeps a handle it cannot cancel and retries later
                log.warning("cannot cancel the read from %s", self.remote_agent, exc_info=True)


def _nixl_logs_to_stderr() -> None:
    """NIXL's Python logging and UCX's log print to standard output, where a command's results
    (``--json``) go; send both to standard error, beside every other log. A ``UCX_LOG_FILE``
    already set is kept."""
    os.environ.setdefault("UCX_LOG_FILE", "stderr")  # read when NIXL loads UCX
    # NIXL's logging configuration binds its handler to whatever sys.stdout is at import
    with contextlib.redirect_stdout(sys.stderr):
        import nixl._api  # noqa: F401


class UnavailableBackendError(ValueError):
    """A requested NIXL backend that this host's NIXL cannot create; the message starts with
    ``backends:`` and lists the plugins NIXL has installed."""


class NixlAgent:
    """A NIXL agent on ``backends`` (UCX by default) without a progress thread (see the
    module docstring).

    ``name`` must be unique across the fleet: remote agents are addressed by it.
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        backend_params: Mapping[str, str] | None = None,
    ) -> None:
        """``backend_params`` (e.g. ``{"ucx_error_handling_mode": "none", "num_threads":
        "4"}``) are passed to every backend created; None keeps NIXL's defaults. Raises
        :class:`UnavailableBackendError` for a backend NIXL cannot create here (NIXL itself
        would skip one it has no plugin for)."""
        _nixl_logs_to_stderr()
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self._nixl = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        plugins = self._nixl.get_plugin_list()
        for backend in backends:
            if backend not in plugins:
                raise UnavailableBackendError(
                    f"backends: {backend!r} is not an installed NIXL plugin; installed: {plugins}"
                )
            try:
                self._nixl.create_backend(backend, dict(backend_params or {}))
            except Exception as exc:  # NIXL's binding errors share no base class
                raise UnavailableBackendError(
                    f"backends: NIXL cannot create {backend!r} on this host ({exc}: its "
                    f"libraries or devices are missing); installed plugins: {plugins}"
                ) from exc
        self._registered: list[object] = []  # NIXL registration descriptor lists
        self._remotes: dict[str, bytes] = {}

    def register(self, memory: Iterable[object]) -> tuple[Region, ...]:
        """Register tensors, arrays or :class:`Region` s (all of one kind) with NIXL. The
        caller keeps the memory alive until :meth:`close`."""
        regions = tuple(describe_region(m) for m in memory)
        if not regions:
            return ()
        kinds = {r.kind for r in regions}
        if len(kinds) != 1:
            raise ValueError(f"register one memory kind at a time, got {sorted(kinds)}")
        rows = np.array(
            [(r.base_addr, r.length_bytes, r.device_id) for r in regions], dtype=np.int64
        )
        descs = self._nixl.register_memory(rows, regions[0].kind)
        self._registered.append(descs)
        return regions

    @property
    def metadata(self) -> bytes:
        """This agent's metadata, for readers to :meth:`add_remote`."""
        return self._nixl.get_agent_metadata()

    def knows(self, agent_name: str) -> bool:
        return agent_name in self._remotes

    def add_remote(self, agent_name: str, metadata: bytes) -> None:
        """Load ``agent_name``'s metadata; new metadata under a known name (that agent
        restarted) replaces the old. Raises :class:`TransferError` if the metadata is another
        agent's."""
        known = self._remotes.get(agent_name)
        if known == metadata:
            return
        if known is not None:
            self.remove_remote(agent_name)
        loaded = self._nixl.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != agent_name:
            if loaded not in self._remotes:
                self._nixl.remove_remote_agent(loaded)
            raise TransferError(f"metadata for {agent_name!r} belongs to agent {loaded!r}")
        self._remotes[agent_name] = metadata

    def remove_remote(self, agent_name: str) -> None:
        if self._remotes.pop(agent_name, None) is not None:
            self._nixl.remove_remote_agent(agent_name)

    def read(
        self,
        remote_agent: str,
        local: bytes | np.ndarray,
        remote: bytes | np.ndarray,
        local_kind: str = DRAM,
        remote_kind: str = DRAM,
        notification: bytes = b"",
    ) -> Transfer:
        """Post one READ filling ``local`` descriptor *i* from ``remote`` descriptor *i* of
        ``remote_agent``; NIXL sends ``notification`` to that agent when it is done."""
        local_rows, remote_rows = read_rows(local, remote)
        if remote_agent not in self._remotes:
            raise TransferError(f"unknown remote agent {remote_agent!r}: add its metadata first")
        try:
            handle = self._nixl.initialize_xfer(
                "READ",
                self._nixl.get_xfer_descs(local_rows, local_kind),
                self._nixl.get_xfer_descs(remote_rows, remote_kind),
                remote_agent,
                notification,
            )
            state = self._nixl.transfer(handle)
        except Exception as exc:  # NIXL's binding errors share no base class
            raise TransferError(f"cannot read from {remote_agent}: {exc}") from exc
        if state == "ERR":
            handle.release()
            raise TransferError(f"posting the read from {remote_agent} failed")
        return Transfer(
            self,
            handle,
            remote_agent,
            int(local_rows[:, 1].sum()),
            len(local_rows),
            state == "DONE",
        )

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent. Also progresses
        the agent, which a target must do for readers to connect."""
        return self._nixl.get_new_notifs()

    def close(self) -> None:
        """Forget remote agents, deregister memory and drop the agent. Idempotent."""
        nixl = getattr(self, "_nixl", None)
        if nixl is None:
            return
        for name in list(self._remotes):
            self.remove_remote(name)
        for descs in self._registered:
            nixl.deregister_memory(descs)
        self._registered.clear()
        del self._nixl


class NixlTransport:
    """The engines' :class:`~clients.transport.Transport`: a :class:`NixlAgent` per rank, with
    ``backends`` and ``backend_params`` (see :class:`NixlAgent`)."""

    def __init__(
        self,
        backends: Sequence[str] = ("UCX",),
        backend_params: Mapping[str, str] | None = None,
    ) -> None:
        self.backends = tuple(backends)
        self.backend_params = backend_params

    def agent(self, name: str) -> NixlAgent:
        return NixlAgent(name, self.backends, self.backend_params)

    def check(self) -> None:
        """Create and drop one agent: an unavailable backend fails here, before any memory is
        registered (:class:`UnavailableBackendError`)."""
        self.agent(f"pdbroker-check-{os.getpid()}").close()
