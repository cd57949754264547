"""The pure work of a plan request, done outside the broker's units of work.

Answering ``GetTransferPlan`` takes two kinds of work: deciding (which transfer, claimed by
whom, which plan is handed out: the service, inside one unit of work) and computing (planning
every decode rank of a transfer, and turning a plan's region-relative runs into absolute
descriptors: pure numpy over as many runs as the request has blocks). The service hands the
computing out as values — a :class:`PlanWork` when it needs plans it does not have, a
:class:`PlanTicket` once it handed a plan out — so the server can run large ones on another
thread while its event loop keeps serving, and a direct caller runs them in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import numpy as np

from broker.api import PlanResult, SourceDescriptors
from broker.descriptors import descriptor_pair
from broker.engines import Engine, PairPlanning
from broker.errors import LimitExceededError, PdbrokerError, PreconditionError, RequestError
from broker.limits import LIMITS
from broker.planner import RankPlan, SourceReads, TransferRequest
from broker.records import PlanRecord, RankRegistration
from broker.wire import DESCRIPTOR_BYTES, MemoryKind


@dataclass(frozen=True)
class PlanWork:
    """Plans the service needs: every decode rank's (``decode_rank`` None: a claim) or one
    rank's, for ``request``. ``basis`` names what they are valid for (the transfer, both
    engines' generations, the decode block ids); ``started`` is when the request came
    (``time.perf_counter()``) and ``cache_hit`` whether the planner of the pair's layouts was cached."""

    pair: PairPlanning
    request: TransferRequest
    decode_rank: int | None
    basis: Hashable
    started: float
    cache_hit: bool

    @property
    def block_ids(self) -> int:
        """Block ids of the request on both sides: what the work grows with."""
        return sum(len(g) for g in self.request.prefill_block_ids) + sum(
            len(g) for g in self.request.decode_block_ids
        )

    def run(self) -> Planned:
        """Plan (any thread; one at a time per planner: its cache is not thread-safe)."""
        with self.pair.lock:
            return self._plan()

    def run_if_free(self) -> Planned | None:
        """Plan here unless another thread is planning for the same pair."""
        if not self.pair.lock.acquire(blocking=False):
            return None
        try:
            return self._plan()
        finally:
            self.pair.lock.release()

    def _plan(self) -> Planned:
        planner = self.pair.planner
        try:
            if self.decode_rank is None:
                plans = planner.plan(self.request).ranks
            else:
                plans = (planner.plan_rank(self.decode_rank, self.request),)
        except RequestError as exc:
            raise _planning_error(exc) from None
        return Planned(self, plans)


@dataclass(frozen=True)
class Planned:
    """The plans :class:`PlanWork` made, to hand back to the service."""

    work: PlanWork
    plans: tuple[RankPlan, ...]


@dataclass(frozen=True)
class SourceAgent:
    """What decode needs to know of one prefill rank it reads from."""

    prefill_rank: int
    #: Its registration: agent name, regions and where they live.
    registration: RankRegistration
    #: Its NIXL agent metadata when this is the decode rank's first contact with it (or the
    #: decode rank asked for it again), else empty.
    agent_metadata: bytes

    @property
    def agent_name(self) -> str:
        return self.registration.agent_name

    @property
    def memory_kind(self) -> MemoryKind:
        return self.registration.memory_kind


@dataclass(frozen=True)
class PlanTicket:
    """A plan handed out to a decode rank, ready to be turned into descriptors."""

    plan_id: str
    transfer_id: str
    rank_plan: RankPlan
    #: The decode rank's registration: its regions and where they live.
    registration: RankRegistration
    sources: tuple[SourceAgent, ...]
    expires_at_ms: int
    traceparent: str

    @property
    def num_descriptors(self) -> int:
        return self.rank_plan.num_descriptors

    @property
    def memory_kind(self) -> MemoryKind:
        return self.registration.memory_kind

    def descriptors(self) -> Iterator[tuple[SourceReads, SourceAgent, np.ndarray, np.ndarray]]:
        """Per source: its reads, its agent, and the absolute local and remote descriptors,
        each checked to lie in its registered region (any thread)."""
        table = self.registration.region_table
        for reads, agent in zip(self.rank_plan.sources, self.sources):
            local, remote = descriptor_pair(
                table,
                agent.registration.region_table,
                reads.region,
                reads.local_offset,
                reads.remote_offset,
                reads.length,
                reads.bounds,
            )
            yield reads, agent, local, remote

    def notification(self, prefill_rank: int) -> bytes:
        """The NIXL notification of the reads from ``prefill_rank``."""
        return f"pdbroker:{self.transfer_id}:{self.plan_id}:{prefill_rank}".encode()

    def result(self) -> PlanResult:
        """Absolute descriptors, each checked to lie in its registered region (any thread)."""
        sources = tuple(
            SourceDescriptors(
                reads.prefill_rank,
                agent.agent_name,
                agent.agent_metadata,
                local,
                remote,
                reads.nbytes,
                self.notification(reads.prefill_rank),
                self.memory_kind,
                agent.memory_kind,
            )
            for reads, agent, local, remote in self.descriptors()
        )
        return PlanResult(
            self.plan_id,
            sources,
            self.rank_plan.naive_bytes,
            self.rank_plan.vllm_descriptors,
            self.expires_at_ms,
            self.traceparent,
        )


def _planning_error(exc: RequestError) -> PdbrokerError:
    """A planner error as the service's: bad decode block ids name ``block_ids``; a
    published request that cannot be planned fails the transfer's precondition."""
    if exc.field.startswith("decode_block_ids"):
        return RequestError("block_ids" + exc.field.removeprefix("decode_block_ids"), exc.detail)
    return PreconditionError("transfer_id", f"published request cannot be planned: {exc}")


def answer_size(plan: PlanRecord, prefill: Engine) -> int:
    """What ``plan`` answered in one message counts against a limit: its descriptors on both
    sides and its sources' agent metadata."""
    return 2 * DESCRIPTOR_BYTES * plan.rank_plan.num_descriptors + sum(
        len(prefill.ranks[p].registration.agent_metadata) for p in plan.prefill_ranks
    )


def answer_bound(plan: PlanRecord, prefill: Engine) -> int:
    """At least the serialized size of ``plan``'s answer: :func:`answer_size` and, per
    message and per source, room for its ids (UTF-8), counts and tags."""
    per_id = 4 * LIMITS.max_id_chars + 8
    sources = len(plan.prefill_ranks)
    return answer_size(plan, prefill) + 4 * per_id + 256 + sources * (5 * per_id + 128)


def check_answer_size(plan: PlanRecord, prefill: Engine, limit: int) -> None:
    """RESOURCE_EXHAUSTED naming ``plan`` when ``plan`` answered in one message could pass
    ``limit`` bytes (:func:`answer_size`)."""
    size = answer_size(plan, prefill)
    if size > limit:
        raise LimitExceededError(
            "plan",
            f"the plan of decode rank {plan.decode_rank} is {size} bytes, more than one "
            f"answer carries ({limit}): ask StreamTransferPlan for it",
        )
