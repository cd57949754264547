"""The byte checker the end-to-end tests rely on (:func:`harness.pattern.check_decode`) sees
what it must: a correct transfer checks clean, and one corrupted byte, one dropped run, a stale
Mamba snapshot, snapshots out of order and a write where nothing may be written are each
counted, byte for byte. Transfers are applied as memcpy of the planner's runs, in numpy."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from broker_helpers import hybrid

from broker.models import build_engine_layout
from broker.planner import PairPlanner, RankPlan, TransferRequest
from harness.pattern import POISON, Contents, check_decode, decode_limits, fill_prefill

TOKENS, BLOCK_SIZE, NUM_BLOCKS, SALT = 70, 32, 24, 77
MODEL = hybrid()  # groups: Mamba (m0, m2), attention (a1, a3), Mamba (m4, m5)
PREFILL = build_engine_layout(MODEL, 2, NUM_BLOCKS, BLOCK_SIZE)
DECODE = build_engine_layout(MODEL, 1, NUM_BLOCKS, BLOCK_SIZE)
#: Prefill kept three snapshots of each Mamba group (oldest first), decode takes the newest.
P_IDS = ((5, 2, 9), (0, 7, 3), (11, 4, 8))
D_IDS = ((6,), (1, 10, 13), (12,))
Memory = list[np.ndarray]


class Transfer:
    """Both sides of one request: prefill memory filled with the pattern, decode memory
    POISON, and the plan of decode rank 0 (reading both prefill ranks)."""

    def __init__(self, p_ids=P_IDS, d_ids=D_IDS) -> None:
        self.p_ids, self.d_ids = p_ids, d_ids
        self.prefill = {
            r.tp_rank: [np.zeros(r.region_bytes, np.uint8) for _ in range(r.num_regions)]
            for r in PREFILL.ranks
        }
        contents = Contents(PREFILL)
        for rank in PREFILL.ranks:
            fill_prefill(contents, rank, self.prefill[rank.tp_rank], p_ids, SALT)
        rank = DECODE.ranks[0]
        self.decode = [
            np.full(rank.region_bytes, POISON, np.uint8) for _ in range(rank.num_regions)
        ]
        self.contents = Contents(DECODE)
        self.limits = decode_limits(PREFILL, DECODE, TOKENS, [len(ids) for ids in p_ids])

    def plan(self, p_ids=None) -> RankPlan:
        request = TransferRequest.of(TOKENS, p_ids or self.p_ids, self.d_ids)
        return PairPlanner(PREFILL, DECODE).plan_rank(0, request)

    def runs(self, plan: RankPlan) -> list[tuple[int, int, int, int, int]]:
        """``(prefill rank, region, decode offset, prefill offset, length)`` of every run."""
        return [
            (s.prefill_rank, *run)
            for s in plan.sources
            for run in zip(
                s.region.tolist(),
                s.local_offset.tolist(),
                s.remote_offset.tolist(),
                s.length.tolist(),
            )
        ]

    def copy(self, plan: RankPlan, keep: Callable[[int], bool] = lambda i: True) -> None:
        for i, (p, region, d_off, p_off, length) in enumerate(self.runs(plan)):
            if keep(i):
                self.decode[region][d_off : d_off + length] = self.prefill[p][region][
                    p_off : p_off + length
                ]

    def check(self) -> tuple[int, int]:
        return check_decode(
            self.contents, DECODE.ranks[0], self.decode, self.d_ids, SALT, self.limits
        )

    def page(self, region: int, block: int) -> np.ndarray:
        page_bytes = DECODE.ranks[0].page_bytes
        return self.decode[region][block * page_bytes : (block + 1) * page_bytes]


@pytest.fixture
def transfer() -> Transfer:
    return Transfer()


def test_a_correct_transfer_checks_clean_and_counts_every_state_byte(transfer: Transfer) -> None:
    plan = transfer.plan()
    assert {s.prefill_rank for s in plan.sources} == {0, 1}
    transfer.copy(plan)
    assert transfer.check() == (0, plan.nbytes)
    assert all((region == POISON).all() for region in transfer.decode)  # restored
    # Nothing arrived this time: every state byte that is not POISON by chance differs.
    mismatches, expected = transfer.check()
    assert expected == plan.nbytes and mismatches > 0.99 * expected


def test_one_corrupted_byte_is_one_mismatch(transfer: Transfer) -> None:
    plan = transfer.plan()
    transfer.copy(plan)
    _, region, d_off, _, length = transfer.runs(plan)[len(transfer.runs(plan)) // 2]
    transfer.decode[region][d_off + length // 2] ^= 0x01
    assert transfer.check() == (1, plan.nbytes)


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_dropped_run_is_counted_byte_for_byte(transfer: Transfer, which: str) -> None:
    plan = transfer.plan()
    runs = transfer.runs(plan)
    dropped = {"first": 0, "middle": len(runs) // 2, "last": len(runs) - 1}[which]
    p, region, _, p_off, length = runs[dropped]
    missing = int(np.count_nonzero(transfer.prefill[p][region][p_off : p_off + length] != POISON))
    transfer.copy(plan, keep=lambda i: i != dropped)
    assert missing > 0
    assert transfer.check() == (missing, plan.nbytes)


def test_a_stale_mamba_snapshot_is_seen(transfer: Transfer) -> None:
    """Decode reading prefill's oldest state block instead of its newest: every Mamba state
    byte is wrong (but for chance equality), every attention byte right."""
    good = transfer.plan()
    stale = tuple(ids[:1] if g != 1 else ids for g, ids in enumerate(P_IDS))
    plan = transfer.plan(stale)
    assert plan.nbytes == good.nbytes
    mamba_bytes = sum(run[-1] for run in _group_runs(transfer, plan, (0, 2)))
    transfer.copy(plan)
    mismatches, expected = transfer.check()
    assert expected == good.nbytes
    assert 0.99 * mamba_bytes < mismatches <= mamba_bytes


def test_mamba_snapshots_out_of_order_are_seen() -> None:
    """Decode keeps two blocks per Mamba group: the newest two snapshots, oldest first."""
    d_ids = ((6, 14), D_IDS[1], (12, 15))
    transfer = Transfer(d_ids=d_ids)
    plan = transfer.plan()
    transfer.copy(plan)
    assert transfer.check() == (0, plan.nbytes)
    transfer.copy(plan)
    for region in range(2):  # swap decode's two state blocks of the first Mamba group
        first, second = transfer.page(region, 6).copy(), transfer.page(region, 14).copy()
        transfer.page(region, 6)[:], transfer.page(region, 14)[:] = second, first
    swapped = sum(run[-1] for run in _group_runs(transfer, plan, (0,)))
    mismatches, _ = transfer.check()
    assert 0.99 * swapped < mismatches <= swapped


def test_a_spare_decode_state_block_must_stay_untouched() -> None:
    """Prefill kept one snapshot, decode offered two blocks: only the first receives it."""
    p_ids = ((5,), P_IDS[1], (11,))
    transfer = Transfer(p_ids=p_ids, d_ids=((6, 14), D_IDS[1], (12, 15)))
    plan = transfer.plan()
    transfer.copy(plan)
    assert transfer.check() == (0, plan.nbytes)
    transfer.copy(plan)
    transfer.page(0, 14)[:] = transfer.page(0, 6)  # the state copied into the spare block too
    written = int(np.count_nonzero(transfer.page(0, 14) != POISON))
    assert written > 0
    assert transfer.check() == (written, plan.nbytes)


@pytest.mark.parametrize("where", ["a free block", "padding of a request page"])
def test_a_write_where_nothing_may_be_written_is_seen(transfer: Transfer, where: str) -> None:
    plan = transfer.plan()
    transfer.copy(plan)
    rank = DECODE.ranks[0]
    if where == "a free block":
        transfer.page(1, 20)[17] = 0
    else:  # Mamba pages end in padding
        end = max(s.end for s in rank.groups[0].segments)
        assert end < rank.page_bytes
        transfer.page(0, D_IDS[0][0])[end] = 0
    assert transfer.check() == (1, plan.nbytes)


def _group_runs(transfer: Transfer, plan: RankPlan, wanted: tuple[int, ...]):
    """The plan's runs landing in decode blocks of the groups ``wanted``, in plan order."""
    page_bytes = DECODE.ranks[0].page_bytes
    blocks = {b for g in wanted for b in transfer.d_ids[g]}
    return [run for run in transfer.runs(plan) if run[2] // page_bytes in blocks]
