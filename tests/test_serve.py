"""``pdbroker serve`` as a real process: configuration from flags and environment."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import grpc
from broker_helpers import hybrid, register_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.scenarios import build_scenario
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc


def serve(*flags: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--insecure", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | env,
    )


def test_serve_takes_the_environment_and_stops_cleanly_on_sigterm() -> None:
    proc = serve(PDBROKER_LISTEN="127.0.0.1:0", PDBROKER_LEASE_TTL_MS="1234")
    try:
        line = proc.stdout.readline()
        address = re.search(r"listening on (127\.0\.0\.1:\d+)", line).group(1)
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pdbroker.v1.Broker"), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            layout = build_scenario(hybrid(), 1, 1, 100).prefill
            lease = pb_grpc.BrokerStub(channel).RegisterRank(
                register_request(layout, "P", pb.ROLE_PREFILL, 0), timeout=10
            )
            assert lease.ttl_ms == 1234
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_flags_override_the_environment_and_bad_values_are_refused() -> None:
    proc = serve("--listen", "127.0.0.1:0", PDBROKER_LISTEN="not an address")
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    bad = serve("--listen", "127.0.0.1:0", PDBROKER_DEFAULT_TTL_MS="soon")
    assert bad.wait(10) != 0
    assert "PDBROKER_DEFAULT_TTL_MS='soon' is not an integer" in bad.stderr.read()
    zero = serve("--listen", "127.0.0.1:0", "--lease-ttl-ms", "0")
    assert zero.wait(10) != 0
    assert "--lease-ttl-ms must be positive" in zero.stderr.read()
