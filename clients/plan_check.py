"""What a decode rank checks of a plan before it posts any read (:func:`check_plan`): the
plan comes from the broker, and a plan that wrote outside the rank's memory, or a byte twice,
would corrupt it; the client refuses such a plan whole (:class:`PlanRejected`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from broker.errors import InvalidFieldError
from broker.v1 import broker_pb2 as pb
from broker.wire import MEMORY_KIND
from clients.transport import Region, RegionIndex, TransferError, descriptor_array

# Reductions called as ufuncs (no Python wrapper per call: a plan's rows are few).
_min, _max, _sum, _any = np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.logical_or.reduce


class PlanRejected(TransferError):
    """A plan this rank refuses to execute; nothing of it was posted to NIXL."""


@dataclass(frozen=True)
class SourceRead:
    """One checked source of a plan: ``(n, 3)`` descriptor rows of both sides, memory kinds."""

    source: pb.SourcePlan
    local: np.ndarray
    remote: np.ndarray
    local_kind: str
    remote_kind: str


def check_plan(
    plan: pb.GetTransferPlanResponse, regions: Sequence[Region] | RegionIndex, tp_rank: int
) -> list[SourceRead]:
    """Parse and check every source of ``plan`` before anything is posted: descriptors whole
    and paired one to one with equal lengths, every local one inside ``regions`` (decode rank
    ``tp_rank``'s registered memory; a rank keeps them as a :class:`RegionIndex`), no local
    byte written twice, and the lengths adding up to each source's and the plan's
    ``total_bytes``; a source's local memory kind is the kind of the regions it writes. The
    checks run over all sources at once; the refusal names the first source that fails one.
    Raises :class:`PlanRejected`."""
    index = regions if isinstance(regions, RegionIndex) else RegionIndex(regions)
    reads = [_parsed(plan, i, source) for i, source in enumerate(plan.sources)]
    if reads:
        local = reads[0].local if len(reads) == 1 else np.concatenate([r.local for r in reads])
        remote = reads[0].remote if len(reads) == 1 else np.concatenate([r.remote for r in reads])
        if _any(local[:, 1] != remote[:, 1]):
            i = next(
                i for i, r in enumerate(reads) if not np.array_equal(r.local[:, 1], r.remote[:, 1])
            )
            raise PlanRejected(f"{_where(plan, i)}: local and remote descriptor lengths differ")
        for kind, rows in _by_kind(reads, local):
            if not index.covers(rows, kind):
                i = next(i for i, r in enumerate(reads) if not index.covers(r.local, r.local_kind))
                raise PlanRejected(
                    f"{_where(plan, i)} writes outside rank {tp_rank}'s registered regions"
                )
        if _overlap(local):
            raise PlanRejected(f"plan {plan.plan_id} writes some bytes of rank {tp_rank} twice")
        # Inside the regions and disjoint: every sum below is bounded by the registered bytes.
        lengths = local[:, 1]
        if len(reads) == 1:
            sums = [int(_sum(lengths))]
        else:
            starts = np.cumsum([0] + [len(r.local) for r in reads[:-1]])
            sums = np.add.reduceat(lengths, starts).tolist()
        for i, (read, nbytes) in enumerate(zip(reads, sums)):
            if nbytes != read.source.total_bytes:
                raise PlanRejected(
                    f"plan {plan.plan_id} source {i}'s descriptors add up to {nbytes} "
                    f"bytes, not its total_bytes {read.source.total_bytes}"
                )
    nbytes = sum(r.source.total_bytes for r in reads)
    if nbytes != plan.total_bytes:
        raise PlanRejected(
            f"plan {plan.plan_id}'s descriptors add up to {nbytes} bytes, not its "
            f"total_bytes {plan.total_bytes}"
        )
    return reads


def _where(plan: pb.GetTransferPlanResponse, i: int) -> str:
    return f"plan {plan.plan_id} source {i} (prefill rank {plan.sources[i].prefill_rank})"


def _parsed(plan: pb.GetTransferPlanResponse, i: int, source: pb.SourcePlan) -> SourceRead:
    """Source ``i``'s descriptors, whole, as many on both sides as it says, and its kinds."""
    try:
        local = descriptor_array(source.local_descriptors)
        remote = descriptor_array(source.remote_descriptors)
        kinds = (
            MEMORY_KIND.from_proto(source.local_memory_kind, "local_memory_kind").name,
            MEMORY_KIND.from_proto(source.remote_memory_kind, "remote_memory_kind").name,
        )
    except InvalidFieldError as exc:
        raise PlanRejected(f"{_where(plan, i)}: unknown memory kind: {exc}") from None
    except ValueError as exc:
        raise PlanRejected(f"{_where(plan, i)}: {exc}") from None
    if not len(local):
        raise PlanRejected(f"{_where(plan, i)}: no descriptors")
    if local.shape != remote.shape:
        raise PlanRejected(
            f"{_where(plan, i)}: {len(local)} local descriptors for {len(remote)} remote"
        )
    if len(local) != source.num_descriptors:
        raise PlanRejected(
            f"{_where(plan, i)}: {len(local)} descriptors, not its num_descriptors "
            f"{source.num_descriptors}"
        )
    return SourceRead(source, local, remote, *kinds)


def _by_kind(reads: list[SourceRead], local: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The local rows of ``reads`` (``local``: all of them) by memory kind."""
    kinds = sorted({r.local_kind for r in reads})
    if len(kinds) == 1:
        return [(kinds[0], local)]
    return [(k, np.concatenate([r.local for r in reads if r.local_kind == k])) for k in kinds]


def _overlap(writes: np.ndarray) -> bool:
    """Whether two ``(addr, len, dev_id)`` rows (inside registered regions: no sum wraps)
    share a byte of one device."""
    if len(writes) < 2:
        return False
    device = writes[:, 2]
    if _min(device) == _max(device):  # one device: by address
        addr = writes[:, 0]
        order = addr.argsort()
        start = addr[order]
        end = start + writes[:, 1][order]
        return bool(_any(start[1:] < end[:-1]))
    writes = writes[np.lexsort((writes[:, 0], device))]  # by device, then address
    same_device = writes[1:, 2] == writes[:-1, 2]
    return bool((same_device & (writes[1:, 0] < writes[:-1, 0] + writes[:-1, 1])).any())
