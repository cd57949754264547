"""Engine processes of the loopback fleet (:mod:`harness.fleet`): one process per engine hosts
all its ranks, each with its own KV-cache regions (numpy arrays in DRAM), NIXL agent (UCX),
registration and lease, and owns the engine's block allocator, as a serving engine's scheduler
does. It answers the coordinator's commands: prefill fills blocks with :mod:`harness.pattern`
contents and publishes, decode fetches and compares every byte of its memory with what its own
layout says the request must have left there, prefill frees the blocks when each rank's
release arrives. Decode fetches batched (every rank of every transfer it is given in one
``GetTransferPlans`` and one ``ReportTransfers`` call), or rank by rank (``per_rank``).
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import EngineLayout
from broker.tracing import configure_tracing
from harness.scenarios import block_counts

if TYPE_CHECKING:
    from clients.decode import DecodeClient
    from clients.prefill import PrefillClient, Release

#: Longest one request may take from publish to its last release (seconds).
REQUEST_TIMEOUT_S = 60.0


class BlockPool:
    """An engine's free block ids, handed out in a shuffled order (as a busy allocator does)."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        self._free = deque(free)
        self._cond = threading.Condition()

    def allocate(self, counts: Sequence[int], timeout_s: float) -> list[list[int]]:
        """Blocks per group; waits up to ``timeout_s`` for enough to be free."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= sum(counts), timeout_s):
                raise TimeoutError(f"no {sum(counts)} free blocks within {timeout_s} s")
            return [[self._free.popleft() for _ in range(n)] for n in counts]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        with self._cond:
            for ids in block_ids:
                self._free.extend(ids)
            self._cond.notify_all()


def engine_main(
    role: str,
    engine_id: str,
    layout: EngineLayout,
    peer: EngineLayout,
    target: str,
    conn: Connection,
    seed: int,
    security: ChannelSecurity = PLAINTEXT,
    mamba_blocks: int = 1,
    per_rank: bool = False,
) -> None:
    """One engine process (``role`` ``prefill`` or ``decode``); ``peer`` is the other side's
    layout; ``security``: how its client reaches the broker; ``mamba_blocks``: state blocks a
    request takes per Mamba group; ``per_rank``: decode fetches rank by rank, not batched.
    Answers the coordinator's commands on ``conn`` until ``close``; its spans (if tracing is
    on) are exported before it says ``closed``."""
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:  # release callbacks send from the client's loop thread
            conn.send(message)

    try:
        tracer_provider = configure_tracing(engine_id)
        engine = (_PrefillEngine if role == "prefill" else _DecodeEngine)(
            engine_id, layout, peer, seed, send, mamba_blocks
        )
        engine.per_rank = per_rank
        with engine.connect(target, security) as engine.client:
            send(("ready", engine_id))
            while (message := conn.recv())[0] != "close":
                getattr(engine, message[0])(*message[1:])
        if tracer_provider is not None:
            tracer_provider.shutdown()
        send(("closed", engine_id, engine.notifications))
    except BaseException:  # noqa: BLE001 - the coordinator reports it
        send(("error", engine_id, traceback.format_exc()))
        sys.exit(1)


class _Engine:
    """An engine process's state: per rank its KV-cache regions (numpy arrays, registered with
    NIXL as they are), the block allocator, the pattern contents, and its client (set by
    :func:`engine_main`)."""

    def __init__(
        self,
        engine_id: str,
        layout: EngineLayout,
        peer: EngineLayout,
        seed: int,
        send: Callable[[tuple], None],
        mamba_blocks: int,
    ) -> None:
        from harness.pattern import Contents

        self.engine_id, self.layout, self.peer, self.send = engine_id, layout, peer, send
        self.mamba_blocks = mamba_blocks
        self.arrays = {
            rank.tp_rank: [
                np.empty(rank.region_bytes, dtype=np.uint8) for _ in range(rank.num_regions)
            ]
            for rank in layout.ranks
        }
        self.contents = Contents(layout)
        self.pool = BlockPool(layout.ranks[0].num_blocks, seed)
        self.notifications = 0
        self.per_rank = False
        self.client: Any = None

    def allocate(self, num_tokens: int) -> list[list[int]]:
        return self.pool.allocate(
            block_counts(self.layout, num_tokens, self.mamba_blocks), REQUEST_TIMEOUT_S
        )


class _PrefillEngine(_Engine):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.held: dict[str, tuple[list[list[int]], set[int]]] = {}  # blocks, ranks not released

    def connect(self, target: str, security: ChannelSecurity) -> PrefillClient:
        from clients.prefill import PrefillClient

        return PrefillClient(
            target,
            self.engine_id,
            self.layout,
            self.arrays,
            on_release=self.on_release,
            on_notification=self.on_notification,
            security=security,
        )

    def on_release(self, release: Release) -> None:
        """Scrub the rank's pages (a late reader would copy POISON), free the blocks once every
        rank was released; tell the coordinator about each, and about a rank released twice."""
        from harness.pattern import scrub_pages

        held = self.held.get(release.transfer_id)
        if held is None or release.tp_rank not in held[1]:
            self.send(("released_twice", release.transfer_id, release.tp_rank))
            return
        blocks, waiting = held
        scrub_pages(self.layout.ranks[release.tp_rank], self.arrays[release.tp_rank], blocks)
        waiting.discard(release.tp_rank)
        if not waiting:
            del self.held[release.transfer_id]
            self.pool.free(blocks)
        self.send(
            (
                "released",
                release.transfer_id,
                release.tp_rank,
                release.reason.value,
                release.received_at,
            )
        )

    def on_notification(self, tp_rank: int, sender: str, message: bytes) -> None:
        self.notifications += 1

    def publish(self, transfer_id: str, num_tokens: int, salt: int) -> None:
        from harness.pattern import fill_prefill

        blocks = self.allocate(num_tokens)
        started = time.perf_counter()
        for r, regions in self.arrays.items():
            fill_prefill(self.contents, self.layout.ranks[r], regions, blocks, salt)
        self.held[transfer_id] = (blocks, set(self.arrays))
        published_at, filled = time.monotonic(), time.perf_counter()
        self.client.publish(transfer_id, blocks, num_tokens)
        self.send(
            (
                "published",
                transfer_id,
                published_at,
                filled - started,
                time.perf_counter() - filled,
                tuple(len(g) for g in blocks),
            )
        )


class _DecodeEngine(_Engine):
    def __init__(self, *args: Any) -> None:
        from harness.pattern import POISON

        super().__init__(*args)
        for regions in self.arrays.values():
            for region in regions:
                region.fill(POISON)

    def connect(self, target: str, security: ChannelSecurity) -> DecodeClient:
        from clients.decode import DecodeClient

        return DecodeClient(
            target,
            self.engine_id,
            self.layout,
            self.arrays,
            read_timeout_s=REQUEST_TIMEOUT_S,
            security=security,
        )

    def fetch_and_hold(
        self, transfer_id: str, num_tokens: int, salt: int, prefill_pages: Sequence[int]
    ) -> None:
        """Fetch, but let every rank stop once its NIXL reads are posted, before it waits for
        them or reports: each rank tells the coordinator ``reads_posted`` and the process
        hangs there until it is killed (the fault tests' reader dying mid-read)."""
        import asyncio

        async def hold(transfers: Sequence[Any], spans: object, deadline: float) -> None:
            self.send(("reads_posted", transfer_id, sum(t.nbytes for t in transfers)))
            await asyncio.Event().wait()

        self.client._async._wait = hold  # the rank's wait for its posted reads
        self.fetch(transfer_id, num_tokens, salt, prefill_pages)

    def fetch(
        self, transfer_id: str, num_tokens: int, salt: int, prefill_pages: Sequence[int]
    ) -> None:
        """Fetch one transfer (batched, or rank by rank), then check decode's memory."""
        self.fetch_many([(transfer_id, num_tokens, salt, prefill_pages)])

    def fetch_many(self, requests: Sequence[tuple[str, int, int, Sequence[int]]]) -> None:
        """Fetch ``(transfer_id, num_tokens, salt, prefill_pages)`` transfers: all in one
        batched ``fetch_many`` (or each with ``fetch`` rank by rank when ``per_rank``), then
        compare every byte of every hosted rank's memory with the layout: each transfer's
        pages hold its state, every other byte POISON. A failed fetch is reported as such."""
        from clients.decode import FetchAsk, FetchError

        blocks = [self.allocate(num_tokens) for _, num_tokens, _, _ in requests]
        if self.per_rank:
            fetches: list[Any] = []
            for (transfer_id, *_), ids in zip(requests, blocks):
                try:
                    fetches.append(self.client.fetch(transfer_id, ids))
                except FetchError as exc:
                    fetches.append(exc)
        else:
            asks = [FetchAsk(transfer_id, ids) for (transfer_id, *_), ids in zip(requests, blocks)]
            fetches = self.client.fetch_many(asks)
        self._check(requests, blocks, fetches)
        for ids in blocks:
            self.pool.free(ids)

    def _check(
        self,
        requests: Sequence[tuple[str, int, int, Sequence[int]]],
        blocks: Sequence[list[list[int]]],
        fetches: Sequence[Any],
    ) -> None:
        """Tell the coordinator each fetch's outcome: the bytes each moved transfer left in
        its pages (then POISON restored there), and POISON everywhere else once a failed
        fetch's pages are scrubbed, counted against every transfer of the batch (nobody knows
        which one wrote a stray byte). After a failed fetch whatever arrived is overwritten
        with POISON for the next request."""
        from clients.decode import FetchError
        from harness.pattern import POISON, check_decode, decode_limits, scrub_pages, strays

        checked = sum(region.size for regions in self.arrays.values() for region in regions)
        outcomes = []
        for (transfer_id, num_tokens, salt, pages), ids, fetch in zip(requests, blocks, fetches):
            if isinstance(fetch, FetchError):
                self.send(("fetch_failed", transfer_id, str(fetch)))
                for r, regions in self.arrays.items():
                    scrub_pages(self.layout.ranks[r], regions, ids)
                continue
            started = time.perf_counter()
            limits = decode_limits(self.peer, self.layout, num_tokens, pages)
            mismatches = expected = 0
            for r, regions in self.arrays.items():
                rank = self.layout.ranks[r]
                m, e = check_decode(self.contents, rank, regions, ids, salt, limits, rest=False)
                mismatches, expected = mismatches + m, expected + e
            outcomes.append(
                (transfer_id, fetch, mismatches, expected, time.perf_counter() - started)
            )
        stray = sum(strays(regions) for regions in self.arrays.values())
        for transfer_id, fetch, mismatches, expected, verify_s in outcomes:
            ranks = [asdict(rank) for rank in fetch.ranks]
            self.send(
                ("fetched", transfer_id, ranks, mismatches + stray, expected, checked, verify_s)
            )
        if len(outcomes) < len(requests):  # whatever arrived: POISON for the next request
            for regions in self.arrays.values():
                for region in regions:
                    region.fill(POISON)
