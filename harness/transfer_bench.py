"""Transfer throughput through NIXL between two processes, measured side by side in one run.

A prefill process holds one prefill rank's regions (DRAM, or VRAM on a chosen GPU) holding the
request's state as :mod:`harness.pattern` derives it from the prefill layout; this process is
decode rank 0 and reads, through NIXL over UCX:

- ``coalesced``: the broker's plan for a real request (runs merged where contiguous);
- ``per_block``: the same bytes at vLLM's granularity (the planner with coalescing off);
- ``single_desc``: the same number of bytes as one descriptor (NIXL/UCX's own ceiling);
- ``memcpy``: a single-process copy of the same bytes (numpy, or torch on the GPU: the
  machine's limit).

After every read of a plan each byte of decode rank 0's regions is compared with what its own
layout says the request must leave there (:func:`harness.pattern.check_decode`, which never
looks at the plan). Throughput is the median of ``repeats`` reads, each timed from posting the
descriptors to completion.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from broker.console import Progress
from broker.layout import EngineLayout
from broker.planner import PairPlanner, RankPlan
from clients.nixl_transport import NixlAgent
from clients.transport import DRAM, VRAM
from harness.pattern import POISON, Contents, check_decode, decode_limits, fill_prefill
from harness.scenarios import Scenario

#: Salt of the benchmark's request in the pattern.
SALT = 29


def _allocate(nbytes: int, device: str, device_id: int) -> Any:
    """A buffer whose pages are all resident: an untouched ``np.zeros`` maps the kernel's
    shared zero page, which would make reads from it look impossibly fast."""
    if device == "cpu":
        buffer = np.empty(nbytes, dtype=np.uint8)
        buffer.fill(1)
        return buffer
    import torch

    return torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{device_id}")


def _store(buffer: Any, data: np.ndarray) -> None:
    if isinstance(buffer, np.ndarray):
        buffer[:] = data
    else:
        import torch

        buffer.copy_(torch.from_numpy(data))


def _poison(buffer: Any) -> None:
    buffer.fill(POISON) if isinstance(buffer, np.ndarray) else buffer.fill_(POISON)


def _host_bytes(buffer: Any) -> np.ndarray:
    return buffer if isinstance(buffer, np.ndarray) else buffer.cpu().numpy()


def ucx_params_from_env() -> dict[str, str]:
    """UCX backend parameters from ``PDBROKER_UCX_PARAMS`` (``key=value,key=value``)."""
    raw = os.environ.get("PDBROKER_UCX_PARAMS", "")
    return dict(item.split("=", 1) for item in raw.split(",") if item)


def _prefill_target(
    conn: Any,
    name: str,
    layout: EngineLayout,
    tp_rank: int,
    block_ids: tuple[tuple[int, ...], ...],
    single_bytes: int,
    device: str,
    device_id: int,
    params: dict[str, str],
) -> None:
    """Child process: register prefill rank ``tp_rank``'s regions holding the request's
    pattern, hand out metadata, drive progress."""
    agent = NixlAgent(name, backend_params=params or None)
    rank = layout.ranks[tp_rank]
    host = [np.zeros(rank.region_bytes, dtype=np.uint8) for _ in range(rank.num_regions)]
    fill_prefill(Contents(layout), rank, host, block_ids, SALT)
    regions = [_allocate(rank.region_bytes, device, device_id) for _ in host]
    for buffer, data in zip(regions, host):
        _store(buffer, data)
    single = _allocate(single_bytes, device, device_id)
    described = agent.register([*regions, single])
    conn.send((agent.metadata, [(r.base_addr, r.device_id) for r in described]))
    while not conn.poll(0.001):
        agent.notifications()
    agent.close()


@dataclass
class TransferFigures:
    device: str
    bytes: int
    coalesced_descriptors: int
    per_block_descriptors: int
    coalesced_gbps: float
    per_block_gbps: float
    single_desc_gbps: float
    memcpy_gbps: float
    repeats: int
    ucx_env: dict[str, str]
    ucx_params: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _descriptors(
    plan: RankPlan, local_bases: list[tuple[int, int]], remote_bases: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    (source,) = plan.sources
    local_base = np.array([b for b, _ in local_bases], dtype=np.int64)[source.region]
    remote_base = np.array([b for b, _ in remote_bases], dtype=np.int64)[source.region]
    local_dev = np.array([d for _, d in local_bases], dtype=np.int64)[source.region]
    remote_dev = np.array([d for _, d in remote_bases], dtype=np.int64)[source.region]
    local = np.stack([local_base + source.local_offset, source.length, local_dev], axis=1)
    remote = np.stack([remote_base + source.remote_offset, source.length, remote_dev], axis=1)
    return local, remote


class _Checker:
    """What decode rank 0's regions must hold after the request, from its layout alone."""

    def __init__(self, sc: Scenario) -> None:
        self.contents = Contents(sc.decode)
        self.rank = sc.decode.ranks[0]
        self.block_ids = sc.request.decode_block_ids
        self.limits = decode_limits(
            sc.prefill,
            sc.decode,
            sc.request.num_tokens,
            [len(ids) for ids in sc.request.prefill_block_ids],
        )

    def verify(self, mode: str, regions: list[Any], nbytes: int) -> None:
        host = [_host_bytes(r) for r in regions]
        mismatches, expected = check_decode(
            self.contents, self.rank, host, self.block_ids, SALT, self.limits
        )
        if mismatches or expected != nbytes:
            raise AssertionError(
                f"{mode} read: {mismatches} bytes of decode rank 0 differ from "
                f"its layout ({expected} state bytes expected, {nbytes} read)"
            )


def _memcpy_gbps(
    nbytes: int, device: str, prefill_device: int, decode_device: int, repeats: int
) -> float:
    src = _allocate(nbytes, device, prefill_device)
    dst = _allocate(nbytes, device, decode_device)
    times = []
    for _ in range(repeats + 1):
        if device == "cpu":
            start = time.perf_counter()
            np.copyto(dst, src)
        else:
            import torch

            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


def run_transfer_bench(
    sc: Scenario,
    progress: Progress,
    device: str = "cpu",
    prefill_device: int = 0,
    decode_device: int = 0,
    repeats: int = 5,
    timeout_s: float = 120.0,
) -> TransferFigures:
    """Measure one scenario whose decode rank 0 reads from a single prefill rank."""
    plans = {
        mode: PairPlanner(sc.prefill, sc.decode, coalesce=mode == "coalesced").plan_rank(
            0, sc.request
        )
        for mode in ("coalesced", "per_block")
    }
    if len(plans["coalesced"].sources) != 1:
        raise ValueError("the transfer bench needs a decode rank 0 that reads one prefill rank")
    source_rank = plans["coalesced"].sources[0].prefill_rank
    d_rank = sc.decode.ranks[0]
    checker = _Checker(sc)
    nbytes = plans["coalesced"].nbytes
    kind = DRAM if device == "cpu" else VRAM
    params = ucx_params_from_env()
    # UCX settings as the caller gave them, before the agents add their log destination
    ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}

    progress.phase(f"starting the prefill process ({device})")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(
        target=_prefill_target,
        daemon=True,
        args=(
            child,
            f"bench-prefill-{os.getpid()}",
            sc.prefill,
            source_rank,
            sc.request.prefill_block_ids,
            nbytes,
            device,
            prefill_device,
            params,
        ),
    )
    target.start()
    agent = NixlAgent(f"bench-decode-{os.getpid()}", backend_params=params or None)
    try:
        regions = [
            _allocate(d_rank.region_bytes, device, decode_device) for _ in range(d_rank.num_regions)
        ]
        single = _allocate(nbytes, device, decode_device)
        described = agent.register([*regions, single])
        local_bases = [(r.base_addr, r.device_id) for r in described]
        if not parent.poll(timeout_s):
            raise TimeoutError("the prefill process did not start")
        metadata, remote_bases = parent.recv()
        remote_name = f"bench-prefill-{os.getpid()}"
        agent.add_remote(remote_name, metadata)

        def timed_read(local: np.ndarray, remote: np.ndarray) -> float:
            start = time.perf_counter()
            transfer = agent.read(remote_name, local, remote, kind, kind)
            transfer.wait(timeout_s)
            elapsed = time.perf_counter() - start
            transfer.release()
            return elapsed

        reads = {
            mode: _descriptors(plan, local_bases[:-1], remote_bases[:-1])
            for mode, plan in plans.items()
        }
        reads["single_desc"] = (
            np.array([[local_bases[-1][0], nbytes, local_bases[-1][1]]], dtype=np.int64),
            np.array([[remote_bases[-1][0], nbytes, remote_bases[-1][1]]], dtype=np.int64),
        )
        times: dict[str, list[float]] = {mode: [] for mode in reads}
        for n in range(repeats + 1):  # modes interleaved; round 0 also opens the connection
            progress.update(f"reads, round {n + 1}/{repeats + 1}: {', '.join(reads)}")
            for mode, (local, remote) in reads.items():
                if mode in plans:
                    for r in regions:
                        _poison(r)
                times[mode].append(timed_read(local, remote))
                if mode in plans:
                    checker.verify(mode, regions, plans[mode].nbytes)
        gbps = {mode: nbytes / statistics.median(t[1:]) / 1e9 for mode, t in times.items()}
    finally:
        agent.close()
        parent.send("stop")
        target.join(timeout=30)
    progress.phase("memcpy in one process")
    memcpy = _memcpy_gbps(nbytes, device, prefill_device, decode_device, repeats)
    return TransferFigures(
        device=device if device == "cpu" else f"cuda:{prefill_device}->cuda:{decode_device}",
        bytes=nbytes,
        coalesced_descriptors=plans["coalesced"].num_descriptors,
        per_block_descriptors=plans["per_block"].num_descriptors,
        coalesced_gbps=round(gbps["coalesced"], 3),
        per_block_gbps=round(gbps["per_block"], 3),
        single_desc_gbps=round(gbps["single_desc"], 3),
        memcpy_gbps=round(memcpy, 3),
        repeats=repeats,
        ucx_env=ucx_env,
        ucx_params=params,
    )
