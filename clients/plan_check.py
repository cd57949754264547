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
#: Bytes of one packed ``(addr, len, dev_id)`` descriptor.
_ROW_BYTES = 24
#: Memory kind names by protobuf value (others: unknown).
_KIND_NAMES = {
    value: MEMORY_KIND.from_proto(value, "memory_kind").name
    for value in pb.MemoryKind.values()
    if value != pb.MEMORY_KIND_UNSPECIFIED
}


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


#: A plan checked: its reads, or its refusal.
Checked = list[SourceRead] | PlanRejected


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
        sums = _source_sums(local[:, 1], [len(r.local) for r in reads])
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


def check_plans(
    plans: Sequence[pb.GetTransferPlanResponse],
    regions: Sequence[Region] | RegionIndex,
    tp_rank: int,
) -> list[Checked]:
    """:func:`check_plan` of each of decode rank ``tp_rank``'s ``plans`` (a step's), with
    the checks run over all of them at once: each plan's reads, or the refusal of that plan
    alone (the others stand). Plans failing any check together are checked again one by
    one, so each refusal names what :func:`check_plan` names."""
    index = regions if isinstance(regions, RegionIndex) else RegionIndex(regions)
    together = _checked_together(plans, index) if len(plans) > 1 else None
    if together is not None:
        return together
    checked: list[Checked] = []
    for plan in plans:
        try:
            checked.append(check_plan(plan, index, tp_rank))
        except PlanRejected as refused:
            checked.append(refused)
    return checked


def check_each(
    plans: Sequence[tuple[pb.GetTransferPlanResponse, RegionIndex, int]],
) -> list[Checked]:
    """Each ``(plan, decode rank's regions, decode rank)`` checked, every rank's plans at
    once (:func:`check_plans`), in order."""
    by_rank: dict[int, list[int]] = {}
    for i, (_, _, tp_rank) in enumerate(plans):
        by_rank.setdefault(tp_rank, []).append(i)
    checked: dict[int, Checked] = {}
    for tp_rank, mine in by_rank.items():
        index = plans[mine[0]][1]
        checked.update(zip(mine, check_plans([plans[i][0] for i in mine], index, tp_rank)))
    return [checked[i] for i in range(len(plans))]


def _checked_together(
    plans: Sequence[pb.GetTransferPlanResponse], index: RegionIndex
) -> list[Checked] | None:
    """Every plan's reads when all of ``plans`` pass every check of :func:`check_plan`;
    None otherwise (check them one by one)."""
    local_bytes: list[bytes] = []
    remote_bytes: list[bytes] = []
    sources: list[pb.SourcePlan] = []
    counts: list[int] = []
    kinds: list[tuple[str, str]] = []
    for plan in plans:
        for source in plan.sources:
            packed_local, packed_remote = source.local_descriptors, source.remote_descriptors
            count = len(packed_local) // _ROW_BYTES
            local_kind = _KIND_NAMES.get(source.local_memory_kind)
            remote_kind = _KIND_NAMES.get(source.remote_memory_kind)
            if (
                not count
                or len(packed_local) % _ROW_BYTES
                or len(packed_remote) != len(packed_local)
                or count != source.num_descriptors
                or local_kind is None
                or remote_kind is None
            ):
                return None
            local_bytes.append(packed_local)
            remote_bytes.append(packed_remote)
            sources.append(source)
            counts.append(count)
            kinds.append((local_kind, remote_kind))
    if not sources:
        return None
    local = descriptor_array(b"".join(local_bytes))
    remote = descriptor_array(b"".join(remote_bytes))
    if _any(local[:, 1] != remote[:, 1]):
        return None
    reads, row = [], 0
    for source, count, (local_kind, remote_kind) in zip(sources, counts, kinds):
        end = row + count
        reads.append(SourceRead(source, local[row:end], remote[row:end], local_kind, remote_kind))
        row = end
    if not all(index.covers(rows, kind) for kind, rows in _by_kind(reads, local)):
        return None
    per_plan = [len(plan.sources) for plan in plans]
    if _overlap(local, np.repeat(np.repeat(np.arange(len(plans)), per_plan), counts)):
        return None
    # Inside the regions and disjoint: every sum below is bounded by the registered bytes.
    sums = _source_sums(local[:, 1], counts)
    if any(nbytes != source.total_bytes for nbytes, source in zip(sums, sources)):
        return None
    checked: list[Checked] = []
    first = 0
    for plan, n in zip(plans, per_plan):
        mine, first = reads[first : first + n], first + n
        if sum(r.source.total_bytes for r in mine) != plan.total_bytes:
            return None
        checked.append(mine)
    return checked


def _source_sums(lengths: np.ndarray, counts: Sequence[int]) -> list[int]:
    """The sum of each run of ``counts`` consecutive ``lengths``."""
    if len(counts) == 1:
        return [int(_sum(lengths))]
    starts = np.zeros(len(counts), dtype=np.intp)
    np.cumsum(counts[:-1], out=starts[1:])
    return np.add.reduceat(lengths, starts).tolist()


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


def _overlap(writes: np.ndarray, plan: np.ndarray | None = None) -> bool:
    """Whether two ``(addr, len, dev_id)`` rows (inside registered regions: no sum wraps)
    share a byte of one device; with ``plan`` (each row's plan), two rows of one plan."""
    if len(writes) < 2:
        return False
    device = writes[:, 2]
    if plan is None and _min(device) == _max(device):  # one device: by address
        addr = writes[:, 0]
        order = addr.argsort()
        start = addr[order]
        end = start + writes[:, 1][order]
        return bool(_any(start[1:] < end[:-1]))
    keys = (writes[:, 0], device) if plan is None else (writes[:, 0], device, plan)
    order = np.lexsort(keys)  # by plan, device, then address
    writes = writes[order]
    together = writes[1:, 2] == writes[:-1, 2]
    if plan is not None:
        together &= plan[order][1:] == plan[order][:-1]
    return bool(_any(together & (writes[1:, 0] < writes[:-1, 0] + writes[:-1, 1])))
