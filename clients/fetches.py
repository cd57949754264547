"""What the decode client (:mod:`clients.decode`) is asked and answers: the transfers and
plans a batched call asks for (:class:`FetchAsk`, :class:`PlanAsk`), the reports it sends
(:class:`PlanReport`), a fetch's outcome (:class:`Fetch` of :class:`RankFetch`, or
:class:`FetchError`) and the error that says a read's data cannot be used
(:class:`TransferEnded`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.v1 import broker_pb2 as pb
from clients.transport import TransferError


@dataclass(frozen=True)
class RankFetch:
    """One decode rank's part of a fetch. Durations in seconds; ``reported_at`` is
    ``time.monotonic()`` just before the report was sent."""

    tp_rank: int
    plan_id: str
    prefill_ranks: tuple[int, ...]
    nbytes: int
    num_descriptors: int
    naive_bytes: int
    vllm_descriptors: int
    plan_s: float
    read_s: float
    report_s: float
    reported_at: float

    @classmethod
    def of(
        cls,
        tp_rank: int,
        plan: pb.GetTransferPlanResponse,
        plan_s: float,
        read_s: float,
        report_s: float,
        reported_at: float,
    ) -> RankFetch:
        """Rank ``tp_rank``'s part, read by ``plan``."""
        return cls(
            tp_rank,
            plan.plan_id,
            tuple(s.prefill_rank for s in plan.sources),
            plan.total_bytes,
            plan.num_descriptors,
            plan.naive_bytes,
            plan.vllm_descriptors,
            plan_s,
            read_s,
            report_s,
            reported_at,
        )


@dataclass(frozen=True)
class Fetch:
    """A completed fetch: every hosted rank read its plan and the broker confirmed it intact."""

    transfer_id: str
    ranks: tuple[RankFetch, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for r in self.ranks)


@dataclass(frozen=True)
class FetchAsk:
    """One transfer of :meth:`~clients.decode.AsyncDecodeClient.fetch_many`: its id, this engine's block ids
    (per group) to read it into and, optionally, the prefill engine that published it."""

    transfer_id: str
    block_ids: Sequence[Sequence[int]]
    prefill_engine_id: str = ""


@dataclass(frozen=True)
class PlanAsk:
    """One hosted rank's plan of a transfer, for :meth:`~clients.decode.AsyncDecodeClient.plans`."""

    tp_rank: int
    transfer_id: str
    block_ids: Sequence[Sequence[int]]
    prefill_engine_id: str = ""


@dataclass(frozen=True)
class PlanReport:
    """One hosted rank's report of a plan, for
    :meth:`~clients.decode.AsyncDecodeClient.report_many`: DONE with ``nbytes`` moved in
    ``duration_s``, or FAILED with ``error`` when one is given; ``traceparent``: the span the
    broker records the report under (the rank's ``decode.report``; '' for the call's)."""

    tp_rank: int
    plan_id: str
    nbytes: int = 0
    duration_s: float = 0.0
    error: str = ""
    traceparent: str = ""


class TransferEnded(TransferError):
    """The broker ended the transfer (expired, aborted, failed) before this rank's report:
    what it read may have been overwritten. Recompute."""


class FetchError(RuntimeError):
    """Some hosted ranks failed a fetch; ``errors`` maps each to its exception. Ranks that
    read their plan reported DONE, the others FAILED (unless the plan itself was refused)."""

    def __init__(self, transfer_id: str, errors: Mapping[int, BaseException]) -> None:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
        super().__init__(f"fetch of {transfer_id} failed: {detail}")
        self.transfer_id = transfer_id
        self.errors = dict(errors)
