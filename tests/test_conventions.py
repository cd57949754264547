"""Metrics and spans by convention, against a ``pdbroker serve`` process.

The broker counts its calls under go-grpc-prometheus's names and labels, exports
prometheus_client's process metrics and no ``_created`` series; every query of the Grafana
dashboard in ``deploy/`` names a metric it exports. RPC spans follow OpenTelemetry's RPC
conventions on both sides of a failed call: a client process (the client library's helpers,
exporting over OTLP) and the broker export to a receiver in this process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from broker_helpers import hybrid, register_request
from prometheus_client.parser import text_string_to_metric_families

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.brokers import BrokerProcess
from harness.scenarios import build_scenario
from harness.trace_receiver import ReceivedSpan, TraceReceiver

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "pdbroker-dashboard.json"
SERVICE = "pdbroker.v1.Broker"
WAIT_S = 10.0
#: A client process: a failed PublishBlocks (no such engine) and an answered ListEngines, each
#: in a client span of the client library's, exported over OTLP as ``OTEL_*`` says.
CLIENT = """
import asyncio, sys
from broker import tracing
from broker.v1 import broker_pb2 as pb, broker_pb2_grpc as pb_grpc
from clients import protocol

provider = tracing.configure_tracing("client")

async def main(address):
    async with protocol.open_channel(address) as channel:
        stub = pb_grpc.BrokerStub(channel)
        publish = pb.PublishBlocksRequest(
            transfer_id="t", engine_id="nobody", block_ids=[pb.BlockIds(ids=[1])], num_tokens=1
        )
        try:
            with tracing.root_span("client.publish", rpc="PublishBlocks"):
                await protocol.call(stub, "PublishBlocks", publish, 10)
        except protocol.BrokerCallError as exc:
            print(exc.code.name)
        with tracing.root_span("client.list", rpc="ListEngines"):
            await protocol.call(stub, "ListEngines", pb.ListEnginesRequest(), 10)

asyncio.run(main(sys.argv[1]))
provider.shutdown()
"""


@dataclass
class Served:
    text: str  # the /metrics page
    samples: dict[tuple[str, frozenset], float]
    spans: list[ReceivedSpan]


def scrape(url: str) -> tuple[str, dict[tuple[str, frozenset], float]]:
    text = urllib.request.urlopen(url, timeout=WAIT_S).read().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def rpc(method: str, grpc_type: str = "unary", **labels: str) -> frozenset:
    return frozenset(
        {"grpc_type": grpc_type, "grpc_service": SERVICE, "grpc_method": method, **labels}.items()
    )


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """A traced broker with ``/metrics``, after calls that succeed, fail, time out and are
    cancelled, and the client process's calls."""
    with TraceReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        for name, value in receiver.environment().items():
            env.setenv(name, value)  # inherited by the broker and the client process
        broker = BrokerProcess("--metrics-port", "0")
        try:
            with grpc.insecure_channel(broker.address) as channel:
                stub = pb_grpc.BrokerStub(channel)
                stub.ListEngines(pb.ListEnginesRequest(), timeout=WAIT_S)
                with pytest.raises(grpc.RpcError) as missing:
                    stub.GetTransfer(pb.GetTransferRequest(transfer_id="nope"), timeout=WAIT_S)
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                layout = build_scenario(hybrid(), 1, 1, 100).prefill
                stub.RegisterRank(register_request(layout, "P", pb.ROLE_PREFILL, 0))
                watch = pb.WatchReleasesRequest(engine_id="P", tp_rank=0)
                with pytest.raises(grpc.RpcError) as late:
                    next(stub.WatchReleases(watch, timeout=0.2))
                assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                stream = stub.WatchReleases(watch, timeout=WAIT_S)
                time.sleep(0.2)  # under way at the broker
                stream.cancel()
            client = subprocess.run(
                [sys.executable, "-c", CLIENT, broker.address],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert client.returncode == 0, client.stderr
            assert client.stdout.split() == ["NOT_FOUND"]
            ended = [
                ("grpc_server_handled_total", rpc("WatchReleases", "server_stream", grpc_code=code))
                for code in ("DeadlineExceeded", "Canceled")
            ]
            deadline = time.monotonic() + WAIT_S
            while True:  # the broker sees a stream end after its client
                text, samples = scrape(broker.metrics_url)
                if all(samples[k] for k in ended) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            broker.stop()  # flushes the broker's spans
        yield Served(text, samples, receiver.spans())


def test_every_call_is_counted_by_method_type_and_code(served: Served) -> None:
    m = served.samples
    counted = {
        ("ListEngines", "unary", "OK"): 2,  # one of them the client process's
        ("GetTransfer", "unary", "NotFound"): 1,
        ("RegisterRank", "unary", "OK"): 1,
        ("WatchReleases", "server_stream", "DeadlineExceeded"): 1,
        ("WatchReleases", "server_stream", "Canceled"): 1,
        ("PublishBlocks", "unary", "NotFound"): 1,
    }
    for (method, grpc_type, code), calls in counted.items():
        assert m["grpc_server_handled_total", rpc(method, grpc_type, grpc_code=code)] == calls, (
            method,
            code,
        )
    handled = {
        (dict(labels)["grpc_method"], dict(labels)["grpc_code"]): value
        for (name, labels), value in m.items()
        if name == "grpc_server_handled_total" and value
    }
    assert handled == {(method, code): v for (method, _, code), v in counted.items()}
    for described in pb.DESCRIPTOR.services_by_name["Broker"].methods:  # all there from the start
        method = described.name
        streams = ("unary", "server_stream", "client_stream", "bidi_stream")
        grpc_type = streams[described.server_streaming + 2 * described.client_streaming]
        calls = sum(v for (name, code), v in handled.items() if name == method)
        assert m["grpc_server_started_total", rpc(method, grpc_type)] == calls
        assert m["grpc_server_handling_seconds_count", rpc(method, grpc_type)] == calls
        assert m["grpc_server_handled_total", rpc(method, grpc_type, grpc_code="Internal")] == 0
    timed = rpc("WatchReleases", "server_stream")
    assert m["grpc_server_handling_seconds_sum", timed] >= 0.2  # a stream counts until it ends
    assert m["grpc_server_handling_seconds_bucket", timed | {("le", "0.1")}] == 0


def test_process_metrics_are_exported_and_no_series_has_a_created_twin(served: Served) -> None:
    m = {name: value for (name, _), value in served.samples.items()}
    assert m["process_cpu_seconds_total"] > 0
    assert m["process_resident_memory_bytes"] > 10e6
    assert 0 < m["process_open_fds"] < m["process_max_fds"]
    assert "python_gc_collections_total" in m and "python_info" in m
    assert m["pdbroker_serving"] == 1
    assert "_created" not in served.text
    assert "pdbroker_release_latency_seconds" not in served.text


#: PromQL words that are not metric names.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana ``label_values`` query) selects."""
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,[^)]*\)", r"\1", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", "", expr)  # matchers, ranges, variables
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", expr)
    return {w[1] for w in words if w[2] is None and w[1].lower() not in _KEYWORDS}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = list(dashboard["panels"])
    for row in dashboard["panels"]:
        panels += row.get("panels", [])
    queries = [t["expr"] for p in panels for t in p.get("targets", [])]
    variables = dashboard["templating"]["list"]
    queries += [v["query"]["query"] for v in variables if v["type"] == "query"]
    return queries


def test_metric_names_are_found_in_promql() -> None:
    assert metric_names(
        "histogram_quantile(0.99, sum by (le, grpc_method) (rate(grpc_server_handling_seconds"
        '_bucket{job=~"$job", grpc_type="unary"}[$__rate_interval]))) / on(job) group_left '
        "up offset 5m and 1e-3 * process_max_fds"
    ) == {"grpc_server_handling_seconds_bucket", "up", "process_max_fds"}
    assert metric_names("label_values(pdbroker_serving, job)") == {"pdbroker_serving"}


def test_every_dashboard_query_names_metrics_the_broker_exports(served: Served) -> None:
    exported = {name for name, _ in served.samples}
    queries = dashboard_queries()
    assert len(queries) >= 20
    used: set[str] = set()
    for query in queries:
        names = metric_names(query)
        assert names, query
        assert names <= exported, (query, names - exported)
        used |= names
    for family in ("grpc_server_handled_total", "grpc_server_handling_seconds_bucket",
                   "process_cpu_seconds_total", "process_resident_memory_bytes",
                   "pdbroker_transfers_in_flight", "pdbroker_releases_total",
                   "pdbroker_blocks_held_seconds_bucket", "pdbroker_serving"):  # fmt: skip
        assert family in used, family


def test_a_failed_call_carries_its_status_on_the_client_and_the_server_span(
    served: Served,
) -> None:
    spans = {s.name: s for s in served.spans}
    assert set(spans) == {"client.publish", "broker.publish", "client.list"}
    client, server = spans["client.publish"], spans["broker.publish"]
    assert (client.service, client.kind, server.service, server.kind) == (
        "client", "CLIENT", "pdbroker", "SERVER",
    )  # fmt: skip
    assert server.parent_id == client.span_id
    for s in (client, server):
        assert s.attributes["rpc.system"] == "grpc"
        assert s.attributes["rpc.service"] == SERVICE
        assert s.attributes["rpc.method"] == "PublishBlocks"
        assert s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
        assert s.error
    listed = spans["client.list"]
    assert listed.kind == "CLIENT" and not listed.error
    assert (listed.attributes["rpc.method"], listed.attributes["rpc.grpc.status_code"]) == (
        "ListEngines",
        0,
    )
