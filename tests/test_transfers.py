"""The transfer state machine alone (no store, no broker): random event sequences checked
against its invariants, and one test per row of its transition table."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker import transfers
from broker.api import Report
from broker.errors import (
    AbortedError,
    AlreadyExistsError,
    PermissionDeniedError,
    PreconditionError,
    RequestError,
)
from broker.planner import RankPlan, SourceReads
from broker.records import PlanRecord, TransferRecord
from broker.transfers import (
    Abort,
    Claim,
    Extend,
    HandOut,
    LoseRank,
    Release,
    Replan,
    Rules,
    Tick,
)
from broker.wire import ReleaseReason, ReportStatus, TransferState

TTL_MS = 30_000
#: Extensions reach the cap within a few random events.
MAX_TTL_MS = TTL_MS + 15_000
RULES = Rules(retention_ms=1_000, max_read_ms=5_000, max_ttl_ms=MAX_TTL_MS)
BLOCKS = ((1, 2), (3,))
BYTES = 16  # every source reads one run of 16 bytes


def rank_plan(decode_rank: int, sources: frozenset[int]) -> RankPlan:
    one = np.array([0], dtype=np.int64)
    reads = tuple(
        SourceReads(p, one, one, one, np.array([BYTES], dtype=np.int64)) for p in sorted(sources)
    )
    return RankPlan(decode_rank, reads, 0, 0)


def published(p_tp: int, now: int = 0, allowed: frozenset[str] = frozenset()) -> TransferRecord:
    step = transfers.publish("t", "P", 1, p_tp, 10, BLOCKS, allowed, now, TTL_MS)
    assert step.record is not None
    return step.record


def claim(readers: list[frozenset[int]]) -> Claim:
    return Claim(
        "D",
        2,
        tuple(PlanRecord(f"c-{d}", d, ((7,),), rank_plan(d, s)) for d, s in enumerate(readers)),
    )


def report(t: TransferRecord, d: int, status: ReportStatus = ReportStatus.DONE) -> Report:
    plan = t.plans[d]
    return Report(plan.plan_id, "D", d, status, plan.rank_plan.nbytes, 5, "")


@dataclass
class Run:
    """A transfer driven through events, with every release its steps emitted."""

    record: TransferRecord | None
    now: int = 0
    releases: list[tuple[int, ReleaseReason]] = field(default_factory=list)
    steps: list[transfers.Step] = field(default_factory=list)

    def apply(self, event: transfers.Event) -> transfers.Step:
        assert self.record is not None
        before = self.record
        step = transfers.step(before, event, self.now, RULES)
        self.steps.append(step)
        self.releases += [
            (e.prefill_rank, e.reason) for e in step.effects if isinstance(e, Release)
        ]
        check(before, event, step, self.now)
        self.record = step.record
        return step


def check(before: TransferRecord, event: transfers.Event, step: transfers.Step, now: int) -> None:
    """The invariants that hold after every step."""
    t = step.record
    if t is None:  # forgotten: only a finished transfer whose every rank was released
        assert before.state.terminal and all(before.released) and before.deadline_ms <= now
        return
    released_now = [e.prefill_rank for e in step.effects if isinstance(e, Release)]
    assert len(released_now) == len(set(released_now))
    for p in released_now:
        assert before.released[p] is None, f"prefill rank {p} released twice"
        assert t.released[p] is not None
    # Never released while a live plan may read it.
    for p, readers in t.consumers.items():
        if t.released[p] is not None:
            assert not any(t.plans[d].live for d in readers), (p, t.plans)
    # A first DONE report is intact exactly when the transfer had not ended (nor expired by
    # now); DONE after the end is refused ABORTED, its repetitions too.
    if isinstance(event, Report) and event.status is ReportStatus.DONE:
        plan, earlier = t.plan_by_id(event.plan_id), before.plan_by_id(event.plan_id)
        assert plan is not None and earlier is not None
        if earlier.status is None and plan.status is not None:
            live = not before.state.terminal and now < before.expires_at_ms
            assert plan.intact == live
        if plan.status is ReportStatus.DONE:
            assert isinstance(step.refusal, AbortedError) == (not plan.intact)
    if t.state is TransferState.COMPLETED:
        assert all(p.status is ReportStatus.DONE for p in t.plans)
    if t.block_ids == ():
        assert t.state.terminal and all(t.released)
    if not t.state.terminal:
        assert t.deadline_ms == t.expires_at_ms
    # Extensions never shorten a transfer's life nor carry it past publication + max_ttl_ms.
    assert before.expires_at_ms <= t.expires_at_ms <= t.published_at_ms + RULES.max_ttl_ms
    if isinstance(event, Extend) and step.refusal is None:
        assert t.expires_at_ms == min(now + TTL_MS, t.published_at_ms + RULES.max_ttl_ms)


@given(p_tp=st.integers(1, 3), d_tp=st.integers(1, 3), data=st.data())
def test_random_event_sequences_keep_the_invariants(p_tp: int, d_tp: int, data) -> None:
    """Each step draws among the events that apply to the transfer as it stands (reports
    only for plans handed out, hand-outs only once claimed), so sequences go deep: claims,
    hand-outs, reports before and after the end, aborts, expiries, lost ranks, read
    timeouts; then time runs on until the record is forgotten."""
    run = Run(published(p_tp))
    readers = [
        data.draw(st.frozensets(st.integers(0, p_tp - 1), max_size=p_tp), label=f"reads {d}")
        for d in range(d_tp)
    ]
    for _ in range(data.draw(st.integers(0, 30), label="events")):
        t = run.record
        if t is None:
            break
        run.now += data.draw(st.sampled_from([0, 1, 500, 4_000, 12_000]), label="ms passing")
        unreported = [p.decode_rank for p in t.plans if p.live]
        choices = ["tick", "tick", "abort", "lose", "extend", "extend"]
        choices += ["claim"] * 4 if not t.plans else []
        choices += ["hand_out"] * 4 + ["replan"] if t.plans else []
        choices += ["done"] * 6 + ["failed"] if unreported else []
        kind = data.draw(st.sampled_from(choices), label="event")
        if kind == "claim":
            run.apply(claim(readers))
        elif kind == "hand_out":
            d = data.draw(st.integers(0, d_tp - 1), label="decode rank")
            run.apply(HandOut(d, t.plans[d].block_ids))
        elif kind in ("done", "failed"):
            d = data.draw(st.sampled_from(unreported), label="reporting rank")
            status = ReportStatus.DONE if kind == "done" else ReportStatus.FAILED
            run.apply(report(t, d, status))
        elif kind == "extend":
            run.apply(Extend(data.draw(st.sampled_from(["D", "X"]), label="extending engine")))
        elif kind == "abort":
            run.apply(Abort("user left", data.draw(st.booleans(), label="held by decode")))
        elif kind == "tick":
            run.apply(Tick())
        elif kind == "lose":
            side = data.draw(st.sampled_from(["P", "D"]), label="side")
            tp = p_tp if side == "P" else d_tp
            run.apply(LoseRank(side, data.draw(st.integers(0, tp - 1)), 1, "deregistered"))
        else:
            d = data.draw(st.integers(0, d_tp - 1), label="decode rank")
            sources = data.draw(st.frozensets(st.integers(0, p_tp - 1), max_size=p_tp))
            run.apply(Replan(d, ((8,),), rank_plan(d, sources)))
    # Time runs on: every prefill rank is released exactly once, then the record forgotten.
    for _ in range(10):
        if run.record is None:
            break
        run.now += 10 * TTL_MS
        run.apply(Tick())
    assert run.record is None
    assert sorted(p for p, _ in run.releases) == list(range(p_tp))


# --------------------------------------------------------------------------- the table, row by row


def test_claim_releases_the_ranks_nobody_reads() -> None:
    run = Run(published(2))
    step = run.apply(claim([frozenset({0})]))
    assert step.record.state is TransferState.IN_PROGRESS
    assert run.releases == [(1, ReleaseReason.COMPLETED)]


def test_events_stepped_together_act_as_in_turn_and_stop_at_a_refusal() -> None:
    t, readers = published(3), [frozenset({0}), frozenset({1})]  # prefill rank 2: unread
    one_by_one = transfers.step(t, claim(readers), 5, RULES)
    assert one_by_one.record is not None
    one_by_one_then = transfers.step(one_by_one.record, HandOut(0, ((7,),)), 5, RULES)
    together = transfers.step(t, (claim(readers), HandOut(0, ((7,),))), 5, RULES)
    assert together.refusal is None
    assert together.record == one_by_one_then.record
    assert together.effects == one_by_one.effects + one_by_one_then.effects
    assert any(isinstance(e, Release) for e in together.effects)
    # A refused event ends the step: what came before it stands, nothing after it runs.
    refused = transfers.step(
        t, (claim(readers), HandOut(0, ((8,),)), HandOut(1, ((7,),))), 5, RULES
    )
    assert isinstance(refused.refusal, PreconditionError)
    assert refused.record == one_by_one.record
    assert not refused.record.plans[1].handed_out


def test_hand_out_makes_a_plan_live_and_a_second_hand_out_changes_nothing() -> None:
    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    run.now = 5
    first = run.apply(HandOut(0, ((7,),)))
    assert first.record.plans[0].live and first.record.plans[0].handed_out_at_ms == 5
    again = run.apply(HandOut(0, ((7,),)))
    assert again.record is first.record and again.effects == ()


def test_hand_out_for_other_block_ids_is_refused_once_handed_out() -> None:
    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    run.apply(HandOut(0, ((7,),)))
    assert isinstance(run.apply(HandOut(0, ((9,),))).refusal, AlreadyExistsError)
    assert isinstance(
        run.apply(Replan(0, ((9,),), rank_plan(0, frozenset({0})))).refusal, AlreadyExistsError
    )


def test_replan_before_hand_out_replaces_the_plan() -> None:
    run = Run(published(2))
    run.apply(claim([frozenset({0, 1})]))
    step = run.apply(Replan(0, ((9,),), rank_plan(0, frozenset({0}))))
    assert step.record.plans[0].block_ids == ((9,),)
    assert step.record.consumers == {0: frozenset({0}), 1: frozenset()}


def test_done_reports_release_their_sources_then_complete() -> None:
    run = Run(published(2))
    run.apply(claim([frozenset({0}), frozenset({1})]))
    for d in range(2):
        run.apply(HandOut(d, ((7,),)))
    step = run.apply(report(run.record, 0))
    assert run.releases == [(0, ReleaseReason.COMPLETED)] and not step.record.state.terminal
    step = run.apply(report(run.record, 1))
    assert step.record.state is TransferState.COMPLETED
    assert run.releases == [(0, ReleaseReason.COMPLETED), (1, ReleaseReason.COMPLETED)]
    assert step.record.block_ids == ()


def test_a_failed_report_fails_the_transfer_and_fences_live_readers() -> None:
    run = Run(published(2))
    run.apply(claim([frozenset({0}), frozenset({1})]))
    for d in range(2):
        run.apply(HandOut(d, ((7,),)))
    step = run.apply(report(run.record, 0, ReportStatus.FAILED))
    assert step.record.state is TransferState.FAILED
    assert run.releases == [(0, ReleaseReason.CONSUMER_FAILED)]  # rank 1 fenced: plan 1 live
    late = run.apply(report(run.record, 1))
    assert isinstance(late.refusal, AbortedError) and not late.record.plans[1].intact
    assert run.releases[-1] == (1, ReleaseReason.CONSUMER_FAILED)


def test_extend_moves_the_expiry_by_the_ttl_up_to_publication_plus_max_ttl() -> None:
    run = Run(published(1))
    for now, expires in ((5_000, 35_000), (10_000, 40_000), (20_000, MAX_TTL_MS)):
        run.now = now
        step = run.apply(Extend("D"))
        assert step.refusal is None and step.effects == ()
        assert (step.record.expires_at_ms, step.record.deadline_ms) == (expires, expires)
    run.now = MAX_TTL_MS - 1
    assert run.apply(Extend("D")).record is run.record  # at the cap: nothing changes
    run.now = MAX_TTL_MS
    step = run.apply(Extend("D"))
    assert isinstance(step.refusal, PreconditionError) and step.refusal.field == "transfer_id"
    assert step.record.state is TransferState.EXPIRED
    assert run.releases == [(0, ReleaseReason.EXPIRED)]


def test_extend_never_shortens_a_transfer() -> None:
    """A broker restarted with a lower ``max_ttl_ms`` keeps the expiry it promised."""
    record = published(1)
    rules = Rules(RULES.retention_ms, RULES.max_read_ms, max_ttl_ms=TTL_MS // 3)
    step = transfers.step(record, Extend("D"), 5_000, rules)
    assert step.refusal is None and step.record.expires_at_ms == TTL_MS


def test_extend_is_for_the_decode_engine_that_may_read_and_only_while_live() -> None:
    run = Run(published(1, allowed=frozenset({"D"})))
    run.now = 1_000
    step = run.apply(Extend("X"))
    assert isinstance(step.refusal, PermissionDeniedError) and "'D'" not in str(step.refusal)
    assert step.record.expires_at_ms == TTL_MS
    run.apply(claim([frozenset({0})]))
    assert run.apply(Extend("D")).record.expires_at_ms == 1_000 + TTL_MS  # claimed: still D's

    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    step = run.apply(Extend("X"))  # any decode engine could claim it, but D did
    assert isinstance(step.refusal, PermissionDeniedError) and "'D'" not in str(step.refusal)
    run.apply(Abort("user left"))
    step = run.apply(Extend("D"))
    assert isinstance(step.refusal, PreconditionError) and step.effects == ()


def test_a_transfer_decode_holds_already_completes_without_a_read() -> None:
    run = Run(published(2))
    step = run.apply(Abort("held", held_by_decode=True))
    assert step.record.state is TransferState.COMPLETED and step.record.end_detail == "held"
    assert sorted(run.releases) == [(0, ReleaseReason.COMPLETED), (1, ReleaseReason.COMPLETED)]
    assert run.apply(Abort("again", held_by_decode=True)).effects == ()

    # Once a decode engine claimed it, reads may be under way: a plain abort.
    run = Run(published(2))
    run.apply(claim([frozenset({0}), frozenset({1})]))
    step = run.apply(Abort("held", held_by_decode=True))
    assert step.record.state is TransferState.ABORTED
    assert sorted(run.releases) == [(0, ReleaseReason.ABORTED), (1, ReleaseReason.ABORTED)]


def test_abort_and_expiry_release_what_no_live_plan_reads() -> None:
    run = Run(published(2))
    step = run.apply(Abort(""))
    assert step.record.state is TransferState.ABORTED and step.record.end_detail == "aborted"
    assert sorted(run.releases) == [(0, ReleaseReason.ABORTED), (1, ReleaseReason.ABORTED)]
    assert run.apply(Abort("again")).effects == ()

    run = Run(published(1))
    run.now = TTL_MS
    step = run.apply(HandOut(0, ()))  # noticed before the event: refused, expiry kept
    assert isinstance(step.refusal, PreconditionError)
    assert step.record.state is TransferState.EXPIRED
    assert run.releases == [(0, ReleaseReason.EXPIRED)]


def test_a_live_plan_holds_its_sources_until_max_read_ms() -> None:
    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    run.now = handed_out = TTL_MS - 1_000
    run.apply(HandOut(0, ((7,),)))
    run.now = TTL_MS
    step = run.apply(Tick())
    assert step.record.state is TransferState.EXPIRED and run.releases == []
    assert step.record.deadline_ms == handed_out + RULES.max_read_ms
    run.now = handed_out + RULES.max_read_ms - 1
    assert run.apply(Tick()).record is run.record  # not due yet
    run.now += 1
    step = run.apply(Tick())
    assert step.record.plans[0].status is ReportStatus.FAILED
    assert run.releases == [(0, ReleaseReason.CONSUMER_FAILED)]
    run.now += RULES.retention_ms
    assert run.apply(Tick()).record is None


@pytest.mark.parametrize(
    "side,reason", [("P", ReleaseReason.ABORTED), ("D", ReleaseReason.CONSUMER_FAILED)]
)
def test_a_lost_rank_fails_the_transfer(side: str, reason: ReleaseReason) -> None:
    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    step = run.apply(LoseRank(side, 0, 1, "deregistered"))
    assert step.record.state is TransferState.FAILED
    assert run.releases == [(0, reason)]
    # A rank of a later registration (generation 3 > 2 and > 1) concerns it no more.
    assert run.apply(LoseRank(side, 0, 3, "deregistered")).effects == ()


def test_a_reader_lost_after_the_end_frees_what_its_live_plan_held() -> None:
    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    run.apply(HandOut(0, ((7,),)))
    run.apply(Abort("user left"))
    assert run.releases == []
    step = run.apply(LoseRank("D", 0, 2, "lease expired"))
    assert step.record.plans[0].error == "decode rank 0 lease expired"
    assert run.releases == [(0, ReleaseReason.CONSUMER_FAILED)]  # its reader failed


def test_reports_are_checked_against_their_plan() -> None:
    run = Run(published(1))
    run.apply(claim([frozenset({0})]))
    run.apply(HandOut(0, ((7,),)))
    plan = run.record.plans[0]
    for event, name in (
        (Report(plan.plan_id, "X", 0, ReportStatus.DONE), "engine_id"),
        (Report(plan.plan_id, "D", 1, ReportStatus.DONE), "tp_rank"),
        (Report(plan.plan_id, "D", 0, ReportStatus.DONE, BYTES + 1), "bytes_moved"),
    ):
        step = run.apply(event)
        assert isinstance(step.refusal, RequestError) and step.refusal.field == name
        assert step.record is run.record
    first = run.apply(report(run.record, 0))
    again = run.apply(report(first.record, 0, ReportStatus.FAILED))  # the first report wins
    assert again.record.plans[0].status is ReportStatus.DONE and again.effects == ()


@pytest.mark.parametrize(
    "record", [published(2), PlanRecord("t-0", 0, BLOCKS, rank_plan(0, frozenset({0})))]
)
def test_evolve_copies_every_field_and_applies_the_changes(record: object) -> None:
    """The state machine's copies: each field of the class set (a copier missing one would
    leave it unset), the changes applied, the original untouched."""
    from dataclasses import fields

    from broker.records import evolve

    names = [f.name for f in fields(record)]  # type: ignore[arg-type]
    same = evolve(record)
    assert same is not record and type(same) is type(record)
    assert all(getattr(same, n) is getattr(record, n) for n in names)
    for name in names:
        value = ("changed",)
        copy = evolve(record, **{name: value})
        assert getattr(copy, name) is value and getattr(record, name) is not value
        assert all(getattr(copy, n) is getattr(record, n) for n in names if n != name)
    with pytest.raises(KeyError):
        evolve(record, no_such_field=1)
