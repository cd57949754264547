"""``pdbroker serve`` as a real process: configuration from flags and environment."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
from broker_helpers import hybrid, register_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.scenarios import build_scenario


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
    assert bad.stderr.read() == (
        "pdbroker serve: error: --default-ttl-ms: PDBROKER_DEFAULT_TTL_MS='soon' is not a "
        "positive integer\n"
    )
    zero = serve("--listen", "127.0.0.1:0", "--lease-ttl-ms", "0")
    assert zero.wait(10) != 0
    assert "--lease-ttl-ms: '0' is not a positive integer" in zero.stderr.read()


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM ``proc``; its stderr (the log) once it exited cleanly."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    return proc.stderr.read()


def test_a_forged_abort_reason_stays_on_its_log_line() -> None:
    """An abort's reason is logged; its newline, carriage return, ANSI escape, line separator
    and bidi override come out escaped on the one line of that event."""
    reason = "oom\n2026-01-01 00:00:00,000 INFO broker.service: completed\r\x1b[2J\u2028\u202e!"
    proc = serve("--listen", "127.0.0.1:0")
    try:
        address = re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)
        scenario = build_scenario(hybrid(), 1, 1, 100)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            stub.RegisterRank(
                register_request(scenario.prefill, "P", pb.ROLE_PREFILL, 0), timeout=10
            )
            stub.PublishBlocks(
                pb.PublishBlocksRequest(
                    transfer_id="t1",
                    engine_id="P",
                    block_ids=[pb.BlockIds(ids=g) for g in scenario.request.prefill_block_ids],
                    num_tokens=scenario.request.num_tokens,
                ),
                timeout=10,
            )
            stub.AbortTransfer(pb.AbortTransferRequest(transfer_id="t1", reason=reason), timeout=10)
    finally:
        log = stop(proc)
    assert not set("\r\x1b\u2028\u202e") & set(log), log
    (line,) = (line for line in log.splitlines() if "oom" in line)
    assert line.endswith(
        "aborted: oom\\n2026-01-01 00:00:00,000 INFO broker.service: completed\\r\\x1b[2J"
        "\\u2028\\u202e! transfer=t1"
    ), line
    assert not any(line.startswith("2026-01-01") for line in log.splitlines())


def test_store_passwords_stay_out_of_errors_and_logs(tmp_path) -> None:
    password = "hunter2-s3cret"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    for url in (
        f"redis://:{password}@127.0.0.1:{closed}/0",
        f"redis://pdbroker:{password}@127.0.0.1:{closed}/0",
        f"redis://:{password}@127.0.0.1:port/0",
        f"http://:{password}@127.0.0.1/0",
    ):
        proc = serve("--listen", "127.0.0.1:0", "--store", url)
        assert proc.wait(30) == 2
        stderr = proc.stderr.read()
        assert stderr.startswith("pdbroker serve: error: --store: ") and stderr.count("\n") == 1
        assert password not in stderr and ":***@127.0.0.1" in stderr, stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:  # until redis-server accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        proc = serve("--listen", "127.0.0.1:0", "--store", url, PDBROKER_LOG_LEVEL="INFO")
        try:
            assert "listening on" in proc.stdout.readline()
        finally:
            log = stop(proc)
        assert f"state in the Redis store at redis://:***@127.0.0.1:{port}/0" in log
        assert password not in log
        wrong = serve("--store", url.replace(password, "wrong-password"))
        assert wrong.wait(30) == 2
        stderr = wrong.stderr.read()
        assert stderr.startswith("pdbroker serve: error: --store: cannot reach redis://:***@")
        assert "wrong-password" not in stderr and stderr.count("\n") == 1
    finally:
        redis.terminate()
        redis.wait(10)


def test_the_collector_policy_bounds_every_generation_it_collects() -> None:
    """``pdbroker serve``'s collector policy, in an interpreter of its own: the import-time
    heap frozen, the young generation collected every 5,000 net allocations and the middle one
    every 20 young collections (each threshold bounds what a collection walks)."""
    probe = (
        "import gc; from broker.commands.collector import tune_collector; tune_collector(); "
        "print(gc.get_threshold(), gc.get_freeze_count() > 1_000)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "(5000, 20, 100) True", done.stdout
