"""Tracing, metrics, logs and the operator commands, against real processes where it counts.

A ``pdbroker serve`` process and prefill/decode engine processes (NIXL over loopback) export
their spans over OTLP/gRPC to a receiver this test runs; ``/metrics`` is scraped over HTTP;
``pdbroker status`` and ``pdbroker transfer`` run as processes against a live broker whose
JSON logs are read back. Nothing of ours is mocked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from broker_helpers import FakeClock, hybrid, reap_all, register_engine, register_request
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import StatusCode
from prerequisites import require_module
from prometheus_client.parser import text_string_to_metric_families

from broker.api import PlanQuery, Publication, Report
from broker.config import ServiceConfig
from broker.metrics import BrokerMetrics
from broker.service import BrokerService
from broker.span_tracer import OffloadTracerProvider
from broker.tracing import context_from_traceparent, trace_id_of
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import ReportStatus, Role
from harness.brokers import BrokerProcess, serve_command
from harness.fleet import FleetReport, PairSpec, run_fleet
from harness.scenarios import build_scenario
from harness.trace_receiver import ReceivedSpan, TraceReceiver, span_tree

#: Each decode rank reads from two prefill ranks: two plans, four reads, four releases.
PAIR = PairSpec("P4->D2", hybrid(kv_heads=4), 4, 2, 40, 300)
TRANSFERS = 3
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a ``/metrics`` page, by (name, labels)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(metrics: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return metrics[(name, frozenset(labels.items()))]


@dataclass
class TracedRun:
    report: FleetReport
    spans: list[ReceivedSpan]
    during: dict[tuple[str, frozenset], float]  # scraped while the engines ran
    after: dict[tuple[str, frozenset], float]  # scraped after the last transfer
    traceparents: dict[str, str]  # GetTransfer's traceparent per transfer


@pytest.fixture(scope="module")
def traced() -> Iterator[TracedRun]:
    """``TRANSFERS`` transfers through a broker (with ``/metrics``) and two engine processes,
    every process exporting spans to a receiver in this process."""
    require_module("nixl", "engine")
    during: dict[tuple[str, frozenset], float] = {}
    with TraceReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        for name, value in receiver.environment().items():
            env.setenv(name, value)  # inherited by the broker and the engine processes
        broker = BrokerProcess("--metrics-port", "0")
        try:
            report = run_fleet(
                [PAIR],
                TRANSFERS,
                inflight=1,
                seed=5,
                broker=broker,
                on_progress=lambda _: during or during.update(scrape(broker.metrics_url)),
            )
            after = scrape(broker.metrics_url)
            with grpc.insecure_channel(broker.address) as channel:
                stub = pb_grpc.BrokerStub(channel)
                traceparents = {
                    r.transfer_id: stub.GetTransfer(
                        pb.GetTransferRequest(transfer_id=r.transfer_id), timeout=10
                    ).traceparent
                    for r in report.requests
                }
        finally:
            broker.stop()  # flushes the broker's last spans
        spans = receiver.spans()
    yield TracedRun(report, spans, during, after, traceparents)


# --------------------------------------------------------------------------- traces

#: Parent of each span: its name, and the attribute pair (child's, parent's) that must agree.
PARENTS = {
    "broker.publish": ("prefill.publish", None),
    "broker.plan": ("prefill.publish", None),
    "decode.nixl_read": ("broker.plan", ("pdbroker.decode_rank", "pdbroker.decode_rank")),
    "decode.report": ("broker.plan", ("pdbroker.decode_rank", "pdbroker.decode_rank")),
    "broker.report": ("decode.report", ("pdbroker.decode_rank", "pdbroker.decode_rank")),
    "broker.release": ("broker.report", None),  # its decode rank: checked below
    "prefill.free": ("broker.release", ("pdbroker.prefill_rank", "pdbroker.prefill_rank")),
}


def test_one_trace_per_transfer_with_spans_of_every_process(traced: TracedRun) -> None:
    assert traced.report.problems() == []
    traces: dict[str, list[ReceivedSpan]] = {}
    for s in traced.spans:
        traces.setdefault(s.trace_id, []).append(s)
    assert len(traces) == TRANSFERS  # nothing split off, nothing else traced
    first_plans = 0
    for r in traced.report.requests:
        ids = {
            s.trace_id
            for s in traced.spans
            if s.attributes["pdbroker.transfer_id"] == r.transfer_id
        }
        assert len(ids) == 1, ids
        (trace_id,) = ids
        assert trace_id == trace_id_of(traced.traceparents[r.transfer_id])
        spans = traces[trace_id]
        assert all(s.attributes["pdbroker.transfer_id"] == r.transfer_id for s in spans)
        assert Counter((s.service, s.name) for s in spans) == {
            ("prefill-0", "prefill.publish"): 1,
            ("pdbroker", "broker.publish"): 1,
            ("pdbroker", "broker.plan"): 2,
            ("decode-0", "decode.nixl_read"): 4,
            ("decode-0", "decode.report"): 2,
            ("pdbroker", "broker.report"): 2,
            ("pdbroker", "broker.release"): 4,
            ("prefill-0", "prefill.free"): 4,
        }
        assert not any(s.error for s in spans)
        assert all(s.end_ns > s.start_ns for s in spans)
        by_id = {s.span_id: s for s in spans}
        (root,) = [s for s in spans if not s.parent_id]
        assert root.name == "prefill.publish"
        for s in spans:
            if s is root:
                continue
            parent = by_id[s.parent_id]
            name, same = PARENTS[s.name]
            assert parent.name == name, (s.name, parent.name)
            if same:
                assert s.attributes[same[0]] == parent.attributes[same[1]], s
        for s in spans:  # P4 -> D2: decode rank d reads prefill ranks 2d, 2d+1
            if s.name == "broker.release":
                reporter = by_id[s.parent_id].attributes["pdbroker.decode_rank"]
                assert s.attributes["pdbroker.prefill_rank"] // 2 == reporter
                assert s.attributes["pdbroker.reason"] == "completed"
        fetched = {rank["tp_rank"]: rank for rank in r.ranks}
        for plan in (s for s in spans if s.name == "broker.plan"):
            d = plan.attributes["pdbroker.decode_rank"]
            assert plan.attributes["pdbroker.source_ranks"] == [2 * d, 2 * d + 1]
            assert plan.attributes["pdbroker.bytes"] == fetched[d]["nbytes"] > 0
            assert plan.attributes["pdbroker.descriptors"] == fetched[d]["num_descriptors"]
            first_plans += not plan.attributes["pdbroker.cache_hit"]
            reads = [
                s for s in spans if s.name == "decode.nixl_read" and s.parent_id == plan.span_id
            ]
            assert sorted(s.attributes["pdbroker.prefill_rank"] for s in reads) == [
                2 * d,
                2 * d + 1,
            ]
            assert sum(s.attributes["pdbroker.bytes"] for s in reads) == fetched[d]["nbytes"]
            assert (
                sum(s.attributes["pdbroker.descriptors"] for s in reads)
                == (fetched[d]["num_descriptors"])
            )
    assert first_plans == 1  # only the very first plan built the pair's planner


def test_span_tree_lines(traced: TracedRun) -> None:
    root = next(s for s in traced.spans if s.name == "prefill.publish")
    lines = span_tree(traced.spans, root.trace_id)
    assert len(lines) == 20
    assert lines[0].startswith("prefill-0 prefill.publish ")
    depth = {line.split()[1]: (len(line) - len(line.lstrip())) // 2 for line in lines}
    assert depth == {
        "prefill.publish": 0,
        "broker.publish": 1,
        "broker.plan": 1,
        "decode.nixl_read": 2,
        "decode.report": 2,
        "broker.report": 3,
        "broker.release": 4,
        "prefill.free": 5,
    }
    assert all(float(line.split()[2]) > 0 for line in lines)


#: Kind of each span, and the broker method of an RPC span (OpenTelemetry's RPC conventions).
#: Span name → kind and RPC method, as the fleet runs (decode batched: one plan call and one
#: report call per step, each entry's spans carrying the batched method).
RPC_SPANS = {
    "prefill.publish": ("CLIENT", "PublishBlocks"),
    "broker.publish": ("SERVER", "PublishBlocks"),
    "broker.plan": ("SERVER", "GetTransferPlans"),
    "decode.nixl_read": ("INTERNAL", None),
    "decode.report": ("CLIENT", "ReportTransfers"),
    "broker.report": ("SERVER", "ReportTransfers"),
    "broker.release": ("INTERNAL", None),
    "prefill.free": ("INTERNAL", None),
}


def test_rpc_spans_are_client_and_server_spans_with_rpc_attributes(traced: TracedRun) -> None:
    assert {s.name for s in traced.spans} == set(RPC_SPANS)
    for s in traced.spans:
        kind, method = RPC_SPANS[s.name]
        assert s.kind == kind, s
        rpc = {k: v for k, v in s.attributes.items() if k.startswith("rpc.")}
        if method is None:
            assert rpc == {}, s
        else:
            assert rpc == {
                "rpc.system": "grpc",
                "rpc.service": "pdbroker.v1.Broker",
                "rpc.method": method,
                "rpc.grpc.status_code": 0,
            }, s


def test_the_brokers_offloaded_spans_reach_the_exporter_intact(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The broker's own tracer: spans queued as tuples, exported by its child process (here
    with the console exporter, whose JSON lands on this process's stdout)."""
    provider = OffloadTracerProvider(
        Resource({"service.name": "unit"}), "console", ParentBased(ALWAYS_ON)
    )
    tracer = provider.get_tracer("pdbroker")
    outer = tracer.start_span(
        "outer", context_from_traceparent(TRACEPARENT), attributes={"ranks": [0, 1]}
    )
    with trace.use_span(outer, end_on_exit=True):
        outer.set_attribute("bytes", 42)
        inner = tracer.start_span("inner")  # a child of the current span
        inner.record_exception(ValueError("no such block"))
        inner.set_status(StatusCode.ERROR, "read failed")
        inner.end()
    unsampled = TRACEPARENT[:-2] + "00"
    assert not tracer.start_span("dropped", context_from_traceparent(unsampled)).is_recording()
    provider.shutdown()
    text, decoder, spans = capfd.readouterr().out, json.JSONDecoder(), {}
    while text.strip():
        span, end = decoder.raw_decode(text.lstrip())
        spans[span["name"]] = span
        text = text.lstrip()[end:]
    assert sorted(spans) == ["inner", "outer"]
    o, i = spans["outer"], spans["inner"]
    assert o["context"]["trace_id"] == i["context"]["trace_id"] == "0x" + TRACEPARENT[3:35]
    assert o["parent_id"] == "0x" + TRACEPARENT[36:52]
    assert i["parent_id"] == o["context"]["span_id"]
    assert o["attributes"] == {"ranks": [0, 1], "bytes": 42}
    assert o["resource"]["attributes"]["service.name"] == "unit"
    assert i["status"] == {"status_code": "ERROR", "description": "read failed"}
    assert i["events"][0]["name"] == "exception"
    assert i["events"][0]["attributes"]["exception.message"] == "no such block"


# --------------------------------------------------------------------------- metrics


def test_metrics_scraped_over_http_count_the_transfers(traced: TracedRun) -> None:
    ranks = [rank for r in traced.report.requests for rank in r.ranks]
    plans = TRANSFERS * PAIR.decode_tp
    releases = TRANSFERS * PAIR.prefill_tp
    m = traced.after
    assert len(ranks) == plans
    assert sample(m, "pdbroker_plans_total", cache="miss") == 1
    assert sample(m, "pdbroker_plans_total", cache="hit") == plans - 1
    assert sample(m, "pdbroker_plan_latency_seconds_count") == plans
    assert 0 < sample(m, "pdbroker_plan_latency_seconds_sum") < plans
    assert sample(m, "pdbroker_plan_descriptors_count") == plans
    assert sample(m, "pdbroker_plan_descriptors_sum") == sum(x["num_descriptors"] for x in ranks)
    assert sample(m, "pdbroker_planned_bytes_total") == sum(x["nbytes"] for x in ranks)
    assert sample(m, "pdbroker_saved_bytes_total") == sum(
        x["naive_bytes"] - x["nbytes"] for x in ranks
    )
    assert sample(m, "pdbroker_transfers_total", state="completed") == TRANSFERS
    for state in ("failed", "expired", "aborted"):
        assert sample(m, "pdbroker_transfers_total", state=state) == 0
    assert sample(m, "pdbroker_transfers_in_flight") == 0
    assert sample(m, "pdbroker_releases_total", reason="completed") == releases
    assert sample(m, "pdbroker_blocks_held_seconds_count") == releases
    assert sample(m, "pdbroker_release_delivery_seconds_count") == releases
    rpc = {"grpc_type": "unary", "grpc_service": "pdbroker.v1.Broker"}

    def calls(method: str) -> float:
        handled = sample(m, "grpc_server_handled_total", **rpc, grpc_method=method, grpc_code="OK")
        timed = sample(m, "grpc_server_handling_seconds_count", **rpc, grpc_method=method)
        assert handled == timed, method
        return handled

    # Decode fetches batched: a plan call and a report call per step of one or more transfers.
    steps = calls("GetTransferPlans")
    assert calls("PublishBlocks") == TRANSFERS and 1 <= steps <= TRANSFERS
    assert calls("ReportTransfers") == steps
    assert calls("GetTransferPlan") == calls("ReportTransfer") == 0
    assert sample(m, "pdbroker_serving") == 1
    assert sample(m, "pdbroker_lease_expiries_total") == 0
    during = traced.during  # after the first transfer, engines still registered
    assert sample(during, "pdbroker_live_ranks", role="prefill") == PAIR.prefill_tp
    assert sample(during, "pdbroker_live_ranks", role="decode") == PAIR.decode_tp
    for role in ("prefill", "decode", "both"):  # the engines deregistered when they closed
        assert sample(m, "pdbroker_live_ranks", role=role) == 0


def test_metrics_follow_failures_expiry_and_lost_leases() -> None:
    """The service feeding :class:`BrokerMetrics` in-process, driven by a hand clock."""
    metrics, clock = BrokerMetrics(), FakeClock()
    service = BrokerService(
        clock=clock,
        config=ServiceConfig(default_ttl_ms=1_000, lease_ttl_ms=60_000),
        observer=metrics,
    )
    sc = build_scenario(hybrid(), 1, 1, 100)
    register_engine(service, sc.prefill, "P", Role.PREFILL, 0)
    register_engine(service, sc.decode, "D", Role.DECODE, 1)

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels)

    assert value("pdbroker_live_ranks", role="prefill") == 1
    for t in ("failing", "expiring", "aborted"):
        service.publish(Publication(t, "P", sc.request.prefill_block_ids, 100))
    assert value("pdbroker_transfers_in_flight") == 3
    plan = service.get_plan(PlanQuery("failing", "D", 0, sc.request.decode_block_ids))
    service.report(Report(plan.plan_id, "D", 0, ReportStatus.FAILED, error="boom"))
    service.abort("aborted", "operator")
    clock.advance(1_000)
    reap_all(service)
    assert value("pdbroker_transfers_total", state="failed") == 1
    assert value("pdbroker_transfers_total", state="expired") == 1
    assert value("pdbroker_transfers_total", state="aborted") == 1
    assert value("pdbroker_transfers_in_flight") == 0
    assert value("pdbroker_releases_total", reason="consumer_failed") == 1
    assert value("pdbroker_releases_total", reason="expired") == 1
    assert value("pdbroker_releases_total", reason="aborted") == 1
    assert value("pdbroker_blocks_held_seconds_sum") == 1.0  # only expiry waited, 1 s
    clock.advance(60_000)
    reap_all(service)
    assert value("pdbroker_lease_expiries_total") == 2
    assert value("pdbroker_live_ranks", role="prefill") == 0
    assert value("pdbroker_live_ranks", role="decode") == 0


# --------------------------------------------------------------------------- operator CLI


def pdbroker(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_and_transfer_commands_against_a_live_broker(tmp_path: Path) -> None:
    """Two engines registered, one transfer completed (with a traceparent), one in flight;
    the broker logs JSON lines at DEBUG, each about a transfer carrying its ids."""
    log_path = tmp_path / "broker.log"
    with log_path.open("w") as log_file:
        serve = subprocess.Popen(
            serve_command("--log-level", "DEBUG", "--log-format", "json"),
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    try:
        # With JSON logs the start-up line is a JSON object too.
        listening = json.loads(serve.stdout.readline())
        assert (listening["level"], listening["logger"]) == ("INFO", "broker.serve")
        address = listening["message"].removeprefix("listening on ")
        sc = build_scenario(hybrid(), 2, 1, 100)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            for r in range(2):
                stub.RegisterRank(register_request(sc.prefill, "P", pb.ROLE_PREFILL, r, 0))
            stub.RegisterRank(register_request(sc.decode, "D", pb.ROLE_DECODE, 0, 1))
            ids = [pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids]
            stub.PublishBlocks(
                pb.PublishBlocksRequest(
                    transfer_id="done", engine_id="P", block_ids=ids, num_tokens=100
                ),
                metadata=[("traceparent", TRACEPARENT)],
            )
            stub.PublishBlocks(
                pb.PublishBlocksRequest(
                    transfer_id="open", engine_id="P", block_ids=ids, num_tokens=100
                )
            )
            plan = stub.GetTransferPlan(
                pb.GetTransferPlanRequest(
                    transfer_id="done",
                    engine_id="D",
                    tp_rank=0,
                    block_ids=[pb.BlockIds(ids=g) for g in sc.request.decode_block_ids],
                )
            )
            assert plan.traceparent == TRACEPARENT  # the broker does not trace: the publisher's
            stub.ReportTransfer(
                pb.ReportTransferRequest(
                    plan_id=plan.plan_id, engine_id="D", tp_rank=0, status=pb.REPORT_STATUS_DONE
                )
            )
            release = next(
                stub.WatchReleases(pb.WatchReleasesRequest(engine_id="P", tp_rank=1), timeout=10)
            )
            assert (release.transfer_id, release.traceparent) == ("done", TRACEPARENT)

        status = pdbroker("status", "--broker", address, "--json")
        assert status.returncode == 0, status.stderr
        s = json.loads(status.stdout)
        assert [
            (e["engine_id"], e["role"], e["complete"], len(e["ranks"])) for e in s["engines"]
        ] == [
            ("D", "decode", True, 1),
            ("P", "prefill", True, 2),
        ]
        assert all(0 < r["lease_left_ms"] <= 10_000 for e in s["engines"] for r in e["ranks"])
        t = s["transfers"]
        assert t["counts"] == {"published": 1, "completed": 1} and t["in_flight"] == 1
        assert t["oldest_in_flight"]["transfer_id"] == "open"
        assert 0 <= t["oldest_in_flight"]["age_ms"] < 60_000
        text = pdbroker("status", "--broker", address)
        assert text.returncode == 0, text.stderr
        assert "engines: 2, ranks: 3" in text.stdout
        assert "transfers in flight: 1 (1 published); oldest open" in text.stdout
        assert "finished, kept for queries: 1 completed" in text.stdout

        done = pdbroker("transfer", "done", "--broker", address, "--json")
        assert done.returncode == 0, done.stderr
        d = json.loads(done.stdout)
        assert d["state"] == "completed" and d["decode_engine_id"] == "D"
        assert d["trace_id"] == trace_id_of(TRACEPARENT)
        assert [e["event"] for e in d["timeline"]] == [
            "published",
            "claimed",
            "planned",
            "reported",
            "released",
            "released",
            "completed",
        ]
        assert all(e["after_ms"] >= 0 for e in d["timeline"])
        assert [(p["decode_rank"], p["prefill_ranks"], p["status"]) for p in d["plans"]] == [
            (0, [0, 1], "done")
        ]
        assert [(r["prefill_rank"], r["reason"]) for r in d["releases"]] == [
            (0, "completed"),
            (1, "completed"),
        ]
        text = pdbroker("transfer", "done", "--broker", address)
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith("transfer done: completed\n")
        assert f"trace {trace_id_of(TRACEPARENT)}" in text.stdout
        assert "prefill rank 1: completed (readers: 0)" in text.stdout
        missing = pdbroker("transfer", "nope", "--broker", address)
        assert missing.returncode == 1
        assert "NOT_FOUND: transfer_id: no transfer 'nope'" in missing.stderr
        named = pdbroker("transfer", "done", "--prefill-engine", "P", "--broker", address, "--json")
        assert json.loads(named.stdout)["state"] == "completed"
        elsewhere = pdbroker("transfer", "done", "--prefill-engine", "D", "--broker", address)
        assert elsewhere.returncode == 1 and "NOT_FOUND: transfer_id" in elsewhere.stderr
    finally:
        serve.terminate()
        assert serve.wait(10) == 0
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    about = [r for r in records if r.get("logger") == "broker.service"]
    assert {(r["transfer_id"], r["message"].split(":")[0]) for r in about} >= {
        ("done", "published"),
        ("done", "planned"),
        ("done", "completed"),
        ("open", "published"),
    }
    assert all(
        r["trace_id"] == trace_id_of(TRACEPARENT) for r in about if r["transfer_id"] == "done"
    )
    assert all("trace_id" not in r for r in about if r["transfer_id"] == "open")


def test_commands_are_registered_without_grpc() -> None:
    """``pdbroker plan`` stays light: registering every command imports no gRPC."""
    probe = (
        "import sys; from broker.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'prometheus_client')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
