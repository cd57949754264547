"""End to end with real processes: a ``pdbroker serve`` process, prefill and decode engine
processes whose ranks each own a NIXL agent (UCX over loopback, DRAM), requests moved by real
reads. Every byte of decode memory is compared with what decode's own layout says the request
must have left there (:mod:`harness.pattern`, independent of the plan); every prefill rank
must receive its release, strictly after every decode rank that read it reported; nothing may
stay registered. Pairs where prefill keeps several Mamba state blocks per group (distinct
snapshots) prove decode receives the newest ones, in order. Nothing is mocked."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prerequisites import require_module

require_module("nixl", "engine")

from broker.layout import GroupKind
from broker.models import AttentionParams, MambaParams, ModelSpec
from broker.wire import ReleaseReason
from harness.brokers import BrokerProcess
from harness.fleet import FleetReport, PairSpec, run_fleet
from harness.pattern import (
    POISON,
    Contents,
    check_decode,
    decode_limits,
    fill_prefill,
    host_memory,
    scrub_pages,
)
from harness.scenarios import block_counts

ROOT = Path(__file__).resolve().parent.parent
REQUESTS_PER_PAIR = 3
MAMBA2 = MambaParams(
    "mamba2",
    conv_kernel=4,
    intermediate_size=128,
    num_heads=8,
    head_dim=16,
    n_groups=2,
    state_size=16,
)
GDN = MambaParams("gdn", conv_kernel=4, num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=16)


def hybrid(name: str, mamba: MambaParams, kv_heads: int) -> ModelSpec:
    """Two Mamba groups around one attention group, three regions per rank."""
    return ModelSpec(
        name,
        (
            (GroupKind.MAMBA, ("m0", "m1", "m3")),
            (GroupKind.ATTENTION, ("a2", "a5", "a8")),
            (GroupKind.MAMBA, ("m4", "m6")),
        ),
        AttentionParams(kv_heads, 32),
        mamba,
    )


PAIRS = (
    PairSpec("FA+Mamba2 P2->D2 (homogeneous)", hybrid("m2", MAMBA2, 4), 2, 2, 40, 300),
    PairSpec(
        "FA+Mamba2 P1->D2 (D>P, a spare decode state block)",
        hybrid("m2", MAMBA2, 4),
        1,
        2,
        40,
        300,
        decode_mamba_blocks=2,
    ),
    PairSpec(
        "FA+Mamba2 P4->D2 (P>D, 3 prefill snapshots: the newest moves)",
        hybrid("m2", MAMBA2, 4),
        4,
        2,
        40,
        300,
        prefill_mamba_blocks=3,
    ),
    PairSpec("FA+GDN P2->D1 (P>D)", hybrid("gdn", GDN, 2), 2, 1, 40, 300),
    PairSpec(
        "FA+GDN P1->D2 (D>P, kernel blocks of 16, 3 snapshots: the newest 2 move)",
        hybrid("gdn", GDN, 2),
        1,
        2,
        40,
        300,
        16,
        prefill_mamba_blocks=3,
        decode_mamba_blocks=2,
    ),
    PairSpec(
        "FA+Mamba2 P1->D4 (replicated KV heads and B/C groups)",
        hybrid("m2", MAMBA2, 2),
        1,
        4,
        40,
        300,
    ),
)


@pytest.fixture(scope="module")
def fleet() -> FleetReport:
    """One run over every pair: one broker, twelve engine processes, 24 NIXL agents."""
    return run_fleet(PAIRS, REQUESTS_PER_PAIR * len(PAIRS), inflight=2, seed=11)


def test_the_run_has_no_problems(fleet: FleetReport) -> None:
    assert fleet.problems() == []
    assert fleet.ok and fleet.completed == len(fleet.requests)


@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=[p.label for p in PAIRS])
def test_every_decode_byte_matches_the_expected_layout(fleet: FleetReport, pair: int) -> None:
    requests = [r for r in fleet.requests if r.pair == pair]
    spec = PAIRS[pair]
    assert len(requests) == REQUESTS_PER_PAIR
    for r in requests:
        assert r.fetched and not r.error
        assert r.mismatches == 0
        assert r.nbytes == r.expected_bytes > 0  # the plan moved exactly the state decode needs
        assert sorted(rank["tp_rank"] for rank in r.ranks) == list(range(spec.decode_tp))
        decode_memory = sum(
            rank.region_bytes * rank.num_regions for rank in fleet.layouts[pair][1].ranks
        )
        assert r.checked_bytes == decode_memory  # every byte of every decode region, every request
        sources = [
            list(rank["prefill_ranks"]) for rank in sorted(r.ranks, key=lambda x: x["tp_rank"])
        ]
        if spec.prefill_tp > spec.decode_tp:  # each decode rank gathers from k prefill ranks
            k = spec.prefill_tp // spec.decode_tp
            assert [sorted(s) for s in sources] == [
                list(range(d * k, d * k + k)) for d in range(spec.decode_tp)
            ]
        else:  # each decode rank reads from its one vLLM partner
            assert sources == [
                [d * spec.prefill_tp // spec.decode_tp] for d in range(spec.decode_tp)
            ]


def test_prefill_receives_its_release_for_every_transfer(fleet: FleetReport) -> None:
    """Completed, and only after every decode rank reading that prefill rank reported (times
    are one host's CLOCK_MONOTONIC, shared by the engine processes)."""
    for r in fleet.requests:
        p_tp = PAIRS[r.pair].prefill_tp
        assert {p: why for p, (why, _) in r.releases.items()} == {
            p: "completed" for p in range(p_tp)
        }
        for p, (_, released_at) in r.releases.items():
            reports = [rank["reported_at"] for rank in r.ranks if p in rank["prefill_ranks"]]
            assert reports, f"{r.transfer_id}: nobody read prefill rank {p}"
            assert r.published_at < max(reports) < released_at < max(reports) + 30


def test_nixl_notifications_reach_prefill(fleet: FleetReport) -> None:
    assert fleet.notifications == fleet.expected_notifications > 0


def test_nothing_left_registered(fleet: FleetReport) -> None:
    assert fleet.leftover_engines == ()


@pytest.mark.parametrize("flags", [(), ("--per-rank",)], ids=["batched", "per-rank"])
def test_demo_command_verifies_real_models_and_prints_a_trace(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """``pdbroker demo --trace``: Nemotron-3-Nano P2→D2 and Qwen3.5-0.8B P1→D2, real preset
    layouts; the span tree of the first transfer (P2→D2) gathered from all three processes,
    the same whether decode fetches batched (the default: each report of a batched call
    names its rank's span) or rank by rank. torch and vLLM do not import in any of its
    processes, as where ``scripts/demo.sh`` installed only what the demo needs."""
    for package in ("torch", "vllm"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            f"raise ImportError('the demo imported {package}')\n"
        )
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "demo", "--requests", "2", "--trace", *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    match = re.fullmatch(r"demo: 2 transfers, ([\d,]+) bytes verified, 0 mismatches", lines[-1])
    assert match and int(match.group(1).replace(",", "")) > 0, lines[-1]
    assert "releases: 3/3 completed" in done.stdout
    heading = next(i for i, line in enumerate(lines) if line.startswith("trace "))
    assert re.fullmatch(
        r"trace [0-9a-f]{32} of req-00000-[0-9a-f]{8}: 14 spans from 3 processes "
        r"\(durations in ms\)",
        lines[heading],
    ), lines[heading]
    tree = [re.fullmatch(r"( *)(\S+) (\S+) (\d+\.\d{3})", line) for line in lines[heading + 1 : -1]]
    assert all(tree), lines[heading + 1 : -1]
    shape = [(len(m.group(1)) // 2, m.group(2), m.group(3)) for m in tree]
    per_decode_rank = [
        (1, "pdbroker", "broker.plan"),
        (2, "decode-0", "decode.nixl_read"),
        (2, "decode-0", "decode.report"),
        (3, "pdbroker", "broker.report"),
        (4, "pdbroker", "broker.release"),
        (5, "prefill-0", "prefill.free"),
    ]
    assert shape == [
        (0, "prefill-0", "prefill.publish"),
        (1, "pdbroker", "broker.publish"),
        *per_decode_rank,
        *per_decode_rank,
    ]


def demo_json(*args: str) -> dict:
    """``pdbroker demo --json`` with ``args``: it succeeds and stdout is one JSON object."""
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "demo", "--json", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_the_demo_runs_again_against_the_same_broker() -> None:
    """Two runs with the same seed against one running broker: each its own run id, so its
    own transfer ids; the same requests, so the same bytes verified."""
    broker = BrokerProcess()
    try:
        first, second = (demo_json("--requests", "1", "--broker", broker.address) for _ in "12")
        assert broker.list_engines() == ()
    finally:
        broker.stop()
    assert first["run_id"] != second["run_id"]
    for run in (first, second):
        assert run["ok"] and run["problems"] == []
        assert (run["requests"], run["transfers"], run["mismatches"]) == (1, 1, 0)
        assert run["releases_completed"] == run["releases"] == 2  # prefill TP2
        assert run["pairs"][0]["transfers"] == 1 and run["pairs"][1]["transfers"] == 0
        assert run["stages"]["read"]["n"] == 2  # decode TP2
    assert first["bytes_verified"] == second["bytes_verified"] == first["pairs"][0]["bytes"] > 0


def test_demo_trace_says_when_the_running_broker_sends_no_spans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``demo --trace --broker ADDR`` against a broker that does not trace: the engines' spans,
    and one line saying why the broker's are missing."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    broker = BrokerProcess()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "broker.cli", "demo", "--requests", "1", "--trace",
             "--broker", broker.address],
            check=False, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        broker.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("trace "))
    assert "spans from 2 processes" in lines[heading]
    assert lines[-2] == (
        f"no spans from the broker at {broker.address}: it exports spans only when started "
        "with OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER) set, to that collector"
    )
    services = {line.split()[0] for line in lines[heading + 1 : -2]}
    assert services == {"prefill-0", "decode-0"}


def test_async_clients_and_expiry() -> None:
    """The async clients in one process against a broker process: a hetero-TP transfer moves
    real bytes; a transfer nobody reads is released EXPIRED and then refused."""
    from clients.decode import AsyncDecodeClient, FetchError
    from clients.prefill import AsyncPrefillClient, Release
    from clients.protocol import BrokerCallError

    spec = PAIRS[3]  # FA+GDN P2 -> D1
    prefill, decode = spec.layouts(inflight=2)
    contents_p, contents_d = Contents(prefill), Contents(decode)
    p_mem = host_memory(prefill)
    d_mem = host_memory(decode, POISON)
    tokens = 200
    counts = block_counts(prefill, tokens)
    blocks = [list(range(sum(counts[:g]), sum(counts[: g + 1]))) for g in range(len(counts))]
    releases: list[Release] = []
    broker = BrokerProcess()

    async def scenario() -> None:
        async with (
            AsyncPrefillClient(
                broker.address, "p", prefill, p_mem, on_release=releases.append
            ) as p,
            AsyncDecodeClient(broker.address, "d", decode, d_mem) as d,
        ):
            for rank in prefill.ranks:
                fill_prefill(contents_p, rank, p_mem[rank.tp_rank], blocks, salt=5)
            await p.publish("moved", blocks, tokens)
            fetch = await d.fetch("moved", blocks)
            assert [r.prefill_ranks for r in fetch.ranks] == [(0, 1)]
            limits = decode_limits(prefill, decode, tokens, [len(ids) for ids in blocks])
            assert check_decode(contents_d, decode.ranks[0], d_mem[0], blocks, 5, limits) == (
                0,
                fetch.nbytes,
            )

            await p.publish("ignored", blocks, tokens, ttl_ms=300)
            deadline = time.monotonic() + 10
            while len(releases) < 4:
                assert time.monotonic() < deadline, releases
                await asyncio.sleep(0.01)
            with pytest.raises(FetchError) as refused:
                await d.fetch("ignored", blocks)
            error = refused.value.errors[0]
            assert isinstance(error, BrokerCallError)
            assert (error.code.name, error.field) == ("FAILED_PRECONDITION", "transfer_id")

    try:
        asyncio.run(scenario())
        assert broker.list_engines() == ()
    finally:
        broker.stop()
    assert sorted((r.transfer_id, r.tp_rank, r.reason) for r in releases) == [
        ("ignored", 0, ReleaseReason.EXPIRED),
        ("ignored", 1, ReleaseReason.EXPIRED),
        ("moved", 0, ReleaseReason.COMPLETED),
        ("moved", 1, ReleaseReason.COMPLETED),
    ]


def test_fetch_many_moves_several_transfers_with_batched_calls() -> None:
    """One GetTransferPlans and one ReportTransfers for every rank of several transfers: each
    transfer's bytes land where decode's layout says, a transfer the broker refuses fails
    alone, and every prefill rank of the moved ones is released COMPLETED."""
    from clients.decode import AsyncDecodeClient, FetchAsk, FetchError
    from clients.prefill import AsyncPrefillClient, Release
    from clients.protocol import BrokerCallError

    spec = PAIRS[5]  # FA+Mamba2 P1 -> D4
    prefill, decode = spec.layouts(inflight=2)
    contents_p, contents_d = Contents(prefill), Contents(decode)
    p_mem = host_memory(prefill)
    d_mem = host_memory(decode, POISON)
    tokens = 200
    counts = block_counts(prefill, tokens)
    first = [list(range(sum(counts[:g]), sum(counts[: g + 1]))) for g in range(len(counts))]
    second = [[i + sum(counts) for i in ids] for ids in first]
    releases: list[Release] = []
    broker = BrokerProcess()

    async def scenario() -> None:
        async with (
            AsyncPrefillClient(
                broker.address, "p", prefill, p_mem, on_release=releases.append
            ) as p,
            AsyncDecodeClient(broker.address, "d", decode, d_mem) as d,
        ):
            for salt, blocks in ((5, first), (6, second)):
                for rank in prefill.ranks:
                    fill_prefill(contents_p, rank, p_mem[rank.tp_rank], blocks, salt=salt)
                await p.publish(f"t{salt}", blocks, tokens)
            asks = [FetchAsk("t5", first), FetchAsk("nope", first), FetchAsk("t6", second, "p")]
            moved_a, refused, moved_b = await d.fetch_many(asks)
            assert isinstance(refused, FetchError) and sorted(refused.errors) == [
                r.tp_rank for r in decode.ranks
            ]
            for error in refused.errors.values():
                assert isinstance(error, BrokerCallError) and error.code.name == "NOT_FOUND"
            limits = decode_limits(prefill, decode, tokens, [len(ids) for ids in first])
            landed = {r: [region.copy() for region in d_mem[r]] for r in d_mem}
            for fetch, blocks, other, salt in (
                (moved_a, first, second, 5),
                (moved_b, second, first, 6),
            ):
                assert not isinstance(fetch, FetchError), fetch
                assert [r.tp_rank for r in fetch.ranks] == [r.tp_rank for r in decode.ranks]
                checks = []
                for rank in decode.ranks:  # one transfer's pages, the rest POISON
                    regions = [region.copy() for region in landed[rank.tp_rank]]
                    scrub_pages(rank, regions, other)
                    checks.append(check_decode(contents_d, rank, regions, blocks, salt, limits))
                assert [c[0] for c in checks] == [0] * len(decode.ranks)
                assert sum(c[1] for c in checks) == fetch.nbytes > 0
            deadline = time.monotonic() + 10
            while len(releases) < 2:
                assert time.monotonic() < deadline, releases
                await asyncio.sleep(0.01)

    try:
        asyncio.run(scenario())
    finally:
        broker.stop()
    assert sorted((r.transfer_id, r.tp_rank, r.reason) for r in releases) == [
        ("t5", 0, ReleaseReason.COMPLETED),
        ("t6", 0, ReleaseReason.COMPLETED),
    ]
