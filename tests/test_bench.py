"""Every benchmark command runs and reports consistent figures (timings are not asserted)."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
from prerequisites import require_binary, require_module

from broker.cli import main
from broker.planner import PairPlanner
from broker.presets import resolve_model
from harness.host_calibration import alone_rate, host_efficiency
from harness.scale_bench import CALLS, lowest_of
from harness.scenarios import build_scenario
from harness.workers_bench import limits


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    """The JSON result of ``pdbroker bench ARGV --json``, whose progress went to stderr."""
    assert main(["bench", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"pdbroker bench {argv[0]} ["), err
    return json.loads(out)


def test_bench_planner_reports_each_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "planner", "--iterations", "3", "--trials", "1", "--no-vllm")[
        "planner"
    ]
    assert {r["name"] for r in result} >= {
        "nemotron-3-nano 32k tp2->tp2",
        "qwen3.5-27b 32k tp1->tp8",
    }
    for r in result:
        assert r["bytes"] == r["optimal_bytes"] <= r["naive_bytes"]
        assert 0 < r["descriptors"] <= r["vllm_descriptors"]
        assert r["warm_median_us"] > 0


def test_bench_planner_times_vllm_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own connector plans the same request; it posts our uncoalesced descriptors
    plus one read per segment of the Mamba page in the region a group's padding layer
    holds (no state), which the planner's vLLM count leaves out."""
    require_module("vllm", "vllm")
    name = "nemotron-3-nano 32k tp2->tp2"
    out = run_json(capsys, "planner", "--iterations", "20", "--trials", "1", "--scenario", name)
    (result,) = out["planner"]
    assert result["vllm_warm_median_us"] > 0 and out["vllm_scope"]
    sc = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 2, 2, 32768)
    uncoalesced = PairPlanner(sc.prefill, sc.decode, coalesce=False).plan_rank(0, sc.request)
    rank = sc.decode.ranks[0]
    padding_reads = sum(
        (rank.num_regions - len(group.layers)) * len(ids) * len(group.segments)
        for group, ids in zip(rank.groups, sc.request.decode_block_ids)
        if not group.is_attention
    )
    assert padding_reads > 0
    assert result["vllm_descriptors"] == uncoalesced.num_descriptors
    assert result["vllm_measured_descriptors"] == uncoalesced.num_descriptors + padding_reads


def test_bench_control_plane_times_unary_and_batched_calls_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Batch 1 (unary calls) and the realistic batch (8 transfers x TP2) always run beside
    the batches asked for; every phase plans and reports, its figures per rank-plan; the
    calls a TP8 -> TP8 transfer takes are counted each way."""
    result = run_json(
        capsys,
        "control-plane",
        "--clients", "2",
        "--batch", "4",
        "--seconds", "0.3",
        "--pairs", "2",
        "--no-vllm",
    )["control_plane"]  # fmt: skip
    assert result["realistic_batch"] == 16
    assert [(p["clients"], p["batch"], p["way"]) for p in result["phases"]] == [
        (2, 1, "calls"),
        (2, 4, "calls"),
        (2, 4, "session"),
        (2, 16, "calls"),
        (2, 16, "session"),
    ]
    for phase in result["phases"]:
        assert not phase["ran_out"]
        for stage in ("plan", "report"):
            calls, entries = phase[f"{stage}_calls"], phase[f"{stage}_entries"]
            assert 0 < calls <= entries <= calls * phase["batch"]
            assert 0 < phase[f"{stage}_p50_ms"] <= phase[f"{stage}_p99_ms"]
            assert phase[f"{stage}_per_s"] == pytest.approx(
                entries / phase[f"{stage}_seconds"], rel=0.01
            )
            assert phase[f"{stage}_broker_cpu_us"] > 0 and phase[f"{stage}_client_cpu_us"] > 0
        assert phase["report_entries"] <= phase["plan_entries"]  # reports of the plans got
        assert phase["engine_cpu_us_per_request"] == pytest.approx(
            2 * (phase["plan_client_cpu_us"] + phase["report_client_cpu_us"]), abs=0.2
        )
        unary = result["phases"][0]
        assert phase["plan_speedup"] == pytest.approx(
            phase["plan_per_s"] / unary["plan_per_s"], abs=0.01
        )
    for calls, session in zip(result["phases"][1::2], result["phases"][2::2]):
        compared = session["session_vs_calls"]
        for key in ("plan_per_s", "report_client_cpu_us", "engine_cpu_us_per_request"):
            assert compared[key] == pytest.approx(session[key] / calls[key], abs=0.01)
        assert "session_vs_calls" not in calls
    for way in ("per_rank", "batched"):
        contact = result["first_contact"][way]
        assert len(contact["samples_ms"]) == 2 and 0 < contact["median_ms"] <= contact["max_ms"]
    counted = result["calls_per_transfer"]
    assert counted["per_rank"] == {
        "transfers": 1,
        "calls": {"GetTransferPlan": 8, "PublishBlocks": 1, "ReportTransfer": 8},
        "per_transfer": 17,
    }
    assert counted["batched"]["calls"] == {
        "GetTransferPlans": 1,
        "PublishBlocks": 1,
        "ReportTransfers": 1,
    }
    assert counted["batched_8"]["per_transfer"] == (8 + 2) / 8
    assert result["vllm_decode_us_per_request"] is None
    verdicts = {t["target"]: t["met"] for t in result["targets"]}
    assert len(verdicts) == 6
    assert verdicts["calls per transfer at TP8 -> TP8, batched, one transfer a call"] is True
    engine = (
        "decode engine CPU per request against vLLM's own decode-side work, batch 16, 2 clients"
    )
    assert verdicts[engine] is None  # not measured without vLLM
    batch_16 = result["phases"][3:]
    fastest = max(batch_16, key=lambda p: p["plan_per_s"])
    (rate,) = (t for t in result["targets"] if t["target"] == "rank-plans/s, batch 16, 2 clients")
    assert (rate["measured"], rate["way"]) == (fastest["plan_per_s"], fastest["way"])
    assert result["descriptors_per_plan"] > 0


def test_bench_control_plane_rounds_alternate_the_ways_and_report_medians(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With rounds, every stage runs once a round, the ways in turn first; each figure is
    the median of the rounds' and the rounds are kept."""
    result = run_json(
        capsys,
        "control-plane",
        "--clients", "2",
        "--batch", "16",
        "--seconds", "0.3",
        "--pairs", "1",
        "--rounds", "2",
        "--no-vllm",
    )["control_plane"]  # fmt: skip
    assert result["rounds"] == 2
    order = {(p["batch"], p["way"]): [r["run"] for r in p["runs"]] for p in result["phases"]}
    assert order == {(1, "calls"): [0, 3], (16, "calls"): [1, 5], (16, "session"): [2, 4]}
    for phase in result["phases"]:
        assert phase["clients"] == 2 and not phase["ran_out"]
        for key in (
            "plan_per_s",
            "plan_p99_ms",
            "report_client_cpu_us",
            "engine_cpu_us_per_request",
        ):
            runs = [r[key] for r in phase["runs"]]
            assert min(runs) <= phase[key] <= max(runs)
            assert phase[key] == pytest.approx(statistics.median(runs), abs=1e-3)
    session = result["phases"][2]
    assert session["session_vs_calls"]["plan_per_s"] == pytest.approx(
        session["plan_per_s"] / result["phases"][1]["plan_per_s"], abs=0.01
    )


def test_bench_control_plane_compares_worker_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """Brokers of 1 and 2 workers on a private redis-server: the scaling is against the
    1-worker figure, broker CPU counts every worker, Redis and the host are measured."""
    require_binary("redis-server", "bash scripts/test.sh installs it with apt-get")
    flags = ("--workers", "1,2", "--clients", "2", "--client-procs", "1", "--seconds", "0.5")
    pair = ("--prefill-tp", "1", "--decode-tp", "1", "--tokens", "4096")
    threads = ("--store-threads", "1,3")
    result = run_json(capsys, "control-plane", *flags, *pair, *threads)
    every = result["control_plane_workers"]["phases"]
    assert [(p["store_threads"], p["workers"], p["clients"]) for p in every] == [
        (1, 1, 2), (1, 2, 2), (3, 1, 2), (3, 2, 2)
    ]  # fmt: skip
    # Each thread count scales against its own one-worker phase.
    assert every[2]["scaling"] == 1.0
    assert every[3]["scaling"] == round(every[3]["plan_per_s"] / 2 / every[2]["plan_per_s"], 3)
    phases = every[:2]
    assert phases[0]["scaling"] == 1.0
    assert phases[1]["scaling"] == round(phases[1]["plan_per_s"] / 2 / phases[0]["plan_per_s"], 3)
    for p in every:
        # The turn is held only for service code: never longer than the threads ran calls.
        busy = p["store_thread_busy"] * p["store_threads"]
        assert 0 < p["store_turn"] <= busy + 0.01, p
    for p in phases:
        assert p["plan_calls"] > 0 and p["plan_broker_cpu_us"] > 100  # the workers' CPU
        assert p["redis_commands_per_plan"] > 1 and 0 < p["redis_cpu_of_core"] < 1.5
        full = 0.9e6 / p["redis_cpu_us_per_plan"]  # plans/s at 90% of a core
        assert abs(p["redis_saturated_per_s"] - full) <= 0.01 * full
        assert 0 < p["host_cpu_busy"] <= 1
        assert p["host_processes"] == p["workers"] + 1 + 1  # one client process, Redis
        assert 0 < p["host_efficiency"] <= 1.5 and 0 < p["host_work_efficiency"] <= 1.5
        # Every plan's calls ran on a store thread, for part of the phase, partly waiting.
        assert 0 < p["store_thread_busy"] <= 1.05 and 0 < p["store_thread_waiting"] < 1
        # A call hops from the event loop to a store thread and back: two switches at least.
        assert p["broker_switches_per_plan"] >= 2, p
    for kind in ("", "work_"):  # the host's scaling by each kind of probe, and ours of it
        assert phases[0][f"host_{kind}scaling"] == 1.0
        allowed = phases[1][f"host_{kind}efficiency"] / phases[0][f"host_{kind}efficiency"]
        assert abs(phases[1][f"host_{kind}scaling"] - allowed) <= 0.001
        of_host = phases[1][f"scaling_of_host_{kind}".rstrip("_")]
        assert abs(of_host - phases[1]["scaling"] / allowed) <= 0.002


@pytest.mark.parametrize(("work", "least_per_s"), [("spin", 100_000), ("broker", 100)])
def test_host_calibration_sees_processes_share_the_cores(work: str, least_per_s: int) -> None:
    """One probe per CPU and then twice as many: each of the oversubscribed ones gets at most
    about half of what one alone does, spinning or doing the broker's work."""
    cpus = len(os.sched_getaffinity(0))
    alone = alone_rate(0.5, work)
    assert alone > least_per_s  # iterations/s of the loop; transfers/s of the broker's work
    full = host_efficiency(cpus, alone, 0.5, work)
    over = host_efficiency(2 * cpus, alone, 0.5, work)
    assert 0 < over < 0.8 and over < full <= 1.5, (full, over)


def test_broker_work_completes_transfers() -> None:
    """The broker-work probe publishes, plans both ranks and reports whole transfers: each
    one it counts leaves a finished transfer on its service."""
    from broker.wire import TransferState
    from harness.host_calibration import WARM_TRANSFERS, BrokerWork

    work = BrokerWork()
    done = work(time.time() + 0.3)
    assert done > 10
    counts = work.service.list_transfers().counts
    assert counts == {TransferState.COMPLETED: WARM_TRANSFERS + done}


def test_context_switches_count_every_thread_of_a_process() -> None:
    """A thread that waits switches out each time: 30 waits of another thread of this
    process are counted while it lives (the main thread itself waits once or twice)."""
    import threading
    import time

    from harness.bench_engines import context_switches

    waited, finish = threading.Event(), threading.Event()

    def wait_often() -> None:
        for _ in range(30):
            time.sleep(0.001)
        waited.set()
        finish.wait()  # alive while counted: a thread that ended took its count with it

    before = context_switches(os.getpid())
    waiter = threading.Thread(target=wait_often, daemon=True)
    waiter.start()
    waited.wait()
    try:
        assert context_switches(os.getpid()) - before >= 30
    finally:
        finish.set()


@pytest.mark.parametrize(
    ("redis", "busy", "host", "store", "turn", "named"),
    [
        (0.5, 0.5, (1.0, 1.0), 0.5, 0.5, ""),
        (0.5, 0.5, (0.8, 0.8), 0.89, 0.89, ""),
        (0.5, 0.5, (0.795, 0.9), 0.5, 0.5, "host cores (efficiency 0.795)"),
        (0.5, 0.5, (0.95, 0.79), 0.5, 0.5, "host cores at the broker's work (efficiency 0.790)"),
        (0.9, 0.5, (0.85, 0.85), 0.5, 0.5, "Redis (one core)"),
        (0.89, 0.9, (0.85, 0.85), 0.5, 0.5, "host CPU (16 cores)"),
        (0.5, 0.5, (0.85, 0.85), 0.9, 0.5, "a worker's store threads"),
        (0.5, 0.5, (0.85, 0.85), 0.5, 0.9, "a worker's turn"),
        (
            0.95,
            0.95,
            (0.6, 0.7),
            0.95,
            0.95,
            (
                "Redis (one core); host CPU (16 cores); host cores (efficiency 0.600); "
                "host cores at the broker's work (efficiency 0.700); "
                "a worker's store threads; a worker's turn"
            ),
        ),
    ],
)
def test_a_phase_names_every_limit_it_reached(
    redis: float,
    busy: float,
    host: tuple[float, float],
    store: float,
    turn: float,
    named: str,
) -> None:
    assert limits(redis, busy, host, store, turn, 16) == named


def test_bench_scale_sweeps_both_stores(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A tiny sweep on real brokers, in memory and on a private redis-server: every call of
    every point measured, ratios of the last point over the first, the plot written."""
    require_binary("redis-server", "bash scripts/test.sh installs it with apt-get")
    flags = ("--engines", "2,4", "--held", "3,30", "--tp", "1,2", "--samples", "4")
    # Leases of 2 s: a sweep late with its keep-alives under load must not lose ranks
    # before their bytes are measured.
    timing = ("--expiries", "2", "--lease-ttl-ms", "2000", "--tokens", "2048")
    result = run_json(capsys, "scale", *flags, *timing, "--out", str(tmp_path))["scale"]
    points = result["points"]
    assert [(p["store"], p["engines"], p["ranks"], p["held"]) for p in points] == [
        (store, *shape)
        for store in ("memory", "redis")
        for shape in ((2, 2, 3), (4, 4, 3), (4, 4, 30))
    ]
    for p in points:
        assert list(p["calls"]) == list(CALLS)
        for call, c in p["calls"].items():
            assert 0 < c["p50_ms"] <= c["p99_ms"] < 5_000, (call, c)
            assert c["cpu_us"] > 0 or call == "lease expiry", (call, c)
        assert 0 < p["longest_stall_ms"] < 5_000
    assert points[-1]["redis_bytes_per_transfer_held"] > 100  # records, not noise, at 30 held
    assert points[-1]["redis_bytes_per_rank"] > 1_000  # a registration, its regions, metadata
    for row in result["ratios"]:
        first, last = (
            [p for p in points if p["store"] == row["store"]][i]["calls"].get(row["call"])
            for i in (0, -1)
        )
        if first is not None:
            assert row["p99_ratio"] == round(last["p99_ms"] / first["p99_ms"], 2), row
    assert len(result["ratios"]) == 2 * (len(CALLS) + 1)
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert json.loads((tmp_path / "scale.json").read_text())["scale"]["points"] == points


def test_bench_scale_keeps_each_figure_lowest_of_its_trials() -> None:
    runs = [
        {"store": "redis", "held": 10, "calls": {"KeepAlive": {"p99_ms": 2.0, "cpu_us": 50.0}}},
        {"store": "redis", "held": 10, "calls": {"KeepAlive": {"p99_ms": 1.5, "cpu_us": 70.0}}},
    ]
    assert lowest_of(runs) == {
        "store": "redis",
        "held": 10,
        "calls": {"KeepAlive": {"p99_ms": 1.5, "cpu_us": 50.0}},
    }


def test_bench_bytes_plan_never_exceeds_naive(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    result = run_json(capsys, "bytes", "--out", str(tmp_path))["bytes"]
    for series in result:
        for point in series["points"]:
            assert point["plan_bytes"] == point["optimal_bytes"] <= point["naive_bytes"]
    assert (tmp_path / "bytes.png").stat().st_size > 0


def test_bench_descriptors_homogeneous_tp_beats_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "descriptors")["descriptors"]
    homogeneous = [
        r for r in rows if r["name"] == "qwen3.5-27b tp4->tp4" and r["allocation"] == "contiguous"
    ]
    assert homogeneous[0]["descriptors"] * 10 <= homogeneous[0]["vllm_descriptors"]


def test_bench_transfer_moves_verified_bytes_and_prints_json_alone() -> None:
    """Run as a process with NIXL and UCX logging at INFO: standard output, file descriptor
    and all, holds the JSON alone; their lines go to standard error."""
    require_module("nixl", "engine")
    # UCX settings an earlier test's imports left in this process (vLLM sets some) stay out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(NIXL_LOG_LEVEL="INFO", UCX_LOG_LEVEL="info")
    argv = ["transfer", "--tokens", "2048", "--repeats", "1", "--kernel-block-size", "16"]
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "bench", *argv, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "NIXL INFO" in done.stderr and "UCX  INFO" in done.stderr
    figures = json.loads(done.stdout)["transfer"]
    assert figures["bytes"] > 0 and figures["ucx_env"] == {"UCX_LOG_LEVEL": "info"}
    assert figures["coalesced_descriptors"] < figures["per_block_descriptors"]
    for key in ("coalesced_gbps", "per_block_gbps", "single_desc_gbps", "memcpy_gbps"):
        assert figures[key] > 0


def test_bench_clients_fake_memory_stays_apart_and_in_range() -> None:
    """Hundreds of decode clients each get fake regions of their own (disjoint, positive
    addresses); more engines than the fake address space holds are refused naming
    ``--clients``, not failed later inside a client."""
    from broker.errors import UsageError
    from clients.transport import fake_memory
    from harness.bench_clients import client_specs

    sc = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 8, 8, 32768)
    specs = client_specs("p", ["t"], 8, 384, warm=False, batch=16)
    spans = sorted(
        (region.base_addr, region.base_addr + region.length_bytes)
        for spec in specs
        for regions in fake_memory(sc.decode, spec.first_addr).values()
        for region in regions
    )
    assert spans[0][0] > 0 and all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    with pytest.raises(UsageError, match="--clients"):
        client_specs("p", ["t"], 2, 4096, warm=False, batch=16)
