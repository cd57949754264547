"""What connections may cost a real ``pdbroker serve``: idle sockets that never handshake are
closed at the handshake deadline, a port holds at most ``--max-connections`` (one more is
closed on accept), connections without calls are closed after ``--idle-timeout-ms`` and
reconnect transparently, clients pinging too often get GOAWAY, and the open-file limit is
raised and the connection cap fitted to it."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_security import Pki, pki, tls_flags  # noqa: F401 - pki: a fixture

from broker.client_security import PLAINTEXT, ChannelSecurity
from clients.protocol import open_channel
from harness.brokers import BrokerProcess

HANDSHAKE_MS = 1500
#: Idle sockets opened at once: a few hundred, far below the default cap and the fd limit.
IDLE_SOCKETS = 300
CAP = 16


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _connect(address: str, n: int) -> list[socket.socket]:
    """``n`` TCP connections to ``address`` that never send a byte (the caller closes them)."""
    host, port = address.rsplit(":", 1)
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sockets.append(socket.create_connection((host, int(port)), timeout=5))
    except BaseException:
        _close(sockets)
        raise
    for sock in sockets:
        sock.setblocking(False)
    return sockets


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _wait_closed(sockets: list[socket.socket], timeout_s: float) -> dict[int, float]:
    """Read (and drop) what the broker sends on each socket until it closes it or
    ``timeout_s`` passes: when (``time.monotonic()``) it closed each, by socket index."""
    deadline = time.monotonic() + timeout_s
    closed: dict[int, float] = {}
    index = {sock.fileno(): i for i, sock in enumerate(sockets)}
    while len(closed) < len(sockets) and (left := deadline - time.monotonic()) > 0:
        open_ = [s for i, s in enumerate(sockets) if i not in closed]
        readable, _, _ = select.select(open_, [], [], min(left, 0.1))
        for sock in readable:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:  # reset
                data = b""
            if not data:
                closed[index[sock.fileno()]] = time.monotonic()
    return closed


def _health(address: str, security: ChannelSecurity = PLAINTEXT) -> tuple[str, float]:
    """A new client's health check: its status code's name (``SERVING`` when it succeeds)
    and how long it took."""
    started = time.monotonic()
    with security.channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except grpc.RpcError as exc:
            outcome = exc.code().name
    return outcome, time.monotonic() - started


@pytest.mark.parametrize("mode", ["plaintext", "tls"])
def test_sockets_that_never_handshake_are_closed_at_the_deadline(pki: Pki, mode: str) -> None:  # noqa: F811
    """300 TCP connections that never send a byte: all held (a file each), a new client is
    served meanwhile; each is closed between 1 and 3 s after the 1.5 s deadline passes
    (none before), the broker's files drop back and new clients are served."""
    tls = mode == "tls"
    security = ChannelSecurity(pki.ca) if tls else PLAINTEXT
    flags = tls_flags(pki) if tls else ()
    broker = BrokerProcess(*flags, "--handshake-timeout-ms", str(HANDSHAKE_MS))
    sockets: list[socket.socket] = []
    try:
        pid = broker.process.pid
        baseline = _fds(pid)
        opened = time.monotonic()
        sockets = _connect(broker.address, IDLE_SOCKETS)
        assert _wait_closed(sockets, 0.3) == {}
        assert _fds(pid) >= baseline + IDLE_SOCKETS
        outcome, took = _health(broker.address, security)
        print(
            f"{mode}: health check with {IDLE_SOCKETS} idle sockets open: {outcome} in "
            f"{took * 1000:.1f} ms"
        )
        assert outcome == "SERVING"
        closed = _wait_closed(sockets, HANDSHAKE_MS / 1000 + 5)
        assert len(closed) == IDLE_SOCKETS
        lived = sorted(at - opened for at in closed.values())
        print(f"{mode}: closed {lived[0]:.2f} to {lived[-1]:.2f} s after opening")
        assert HANDSHAKE_MS / 1000 - 0.1 < lived[0] and lived[-1] < HANDSHAKE_MS / 1000 + 3
        assert _fds(pid) <= baseline + 2
        assert _health(broker.address, security)[0] == "SERVING"
        assert broker.process.poll() is None
    finally:
        _close(sockets)
        broker.stop()


def test_a_port_holds_at_most_max_connections_and_serves_again_after_the_deadline() -> None:
    """``--max-connections 16``, 40 idle sockets: 24 are closed at once, 16 held; meanwhile a
    new client fails fast UNAVAILABLE and the broker keeps running; once the handshake
    deadline has closed the 16, new clients are served."""
    broker = BrokerProcess(
        "--max-connections", str(CAP), "--handshake-timeout-ms", str(HANDSHAKE_MS)
    )
    sockets: list[socket.socket] = []
    try:
        pid = broker.process.pid
        baseline = _fds(pid)
        sockets = _connect(broker.address, 40)
        refused = _wait_closed(sockets, 0.5)
        assert len(refused) == 40 - CAP
        assert _fds(pid) <= baseline + CAP
        outcome, took = _health(broker.address)
        print(f"health check with the port full: {outcome} in {took * 1000:.1f} ms")
        assert outcome == "UNAVAILABLE" and took < 2
        assert broker.process.poll() is None
        held = [s for i, s in enumerate(sockets) if i not in refused]
        assert len(_wait_closed(held, HANDSHAKE_MS / 1000 + 5)) == CAP
        assert _health(broker.address)[0] == "SERVING"
    finally:
        _close(sockets)
        broker.stop()


def test_a_connection_without_calls_is_closed_after_the_idle_timeout_and_reconnects() -> None:
    """``--idle-timeout-ms 1000``: an engine's channel goes IDLE about 1 s after its last
    call (the broker closed the connection: one file less) and the next call reconnects and
    succeeds; an open stream keeps its connection past the timeout."""
    broker = BrokerProcess("--idle-timeout-ms", "1000")
    pid = broker.process.pid
    ready, idle = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
    request = health_pb2.HealthCheckRequest()

    async def scenario() -> None:
        async with open_channel(broker.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(request, timeout=5)
            assert channel.get_state() is ready
            connected = _fds(pid)
            started = time.monotonic()
            while channel.get_state() is ready and time.monotonic() - started < 5:
                await asyncio.sleep(0.02)
            closed_after = time.monotonic() - started
            print(f"idle connection closed after {closed_after:.2f} s")
            assert channel.get_state() is idle and 0.8 < closed_after < 3
            assert _fds(pid) == connected - 1
            response = await stub.Check(request, timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
            assert channel.get_state() is ready
            watch = stub.Watch(request)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(2.5)
            assert channel.get_state() is ready and not watch.done()
            watch.cancel()

    try:
        asyncio.run(scenario())
    finally:
        broker.stop()


def test_a_client_pinging_too_often_is_disconnected_and_engines_are_not() -> None:
    """A client pinging every 200 ms without data loses its stream UNAVAILABLE (GOAWAY
    ``too_many_pings``) within seconds; an engine's channel (no keepalive pings of its own)
    with a stream open over the same time stays connected throughout."""
    broker = BrokerProcess()
    request = health_pb2.HealthCheckRequest()
    pinging = [
        ("grpc.keepalive_time_ms", 200),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]

    async def scenario() -> None:
        async with (
            grpc.aio.insecure_channel(broker.address, options=pinging) as abusive,
            open_channel(broker.address) as engine,
        ):
            abusive_watch = health_pb2_grpc.HealthStub(abusive).Watch(request)
            engine_watch = health_pb2_grpc.HealthStub(engine).Watch(request)
            await abusive_watch.read()
            await engine_watch.read()
            started = time.monotonic()
            states = set()
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                reading = asyncio.ensure_future(abusive_watch.read())
                while not reading.done() and time.monotonic() - started < 10:
                    states.add(engine.get_state())
                    await asyncio.sleep(0.02)
                await asyncio.wait_for(reading, 0.1)
            took = time.monotonic() - started
            print(
                f"pinging client cut after {took:.2f} s: {cut.value.code().name} "
                f"{cut.value.details()!r}"
            )
            assert cut.value.code() is grpc.StatusCode.UNAVAILABLE and took < 10
            await asyncio.sleep(1)
            assert states == {grpc.ChannelConnectivity.READY}
            assert engine.get_state() is grpc.ChannelConnectivity.READY
            assert not engine_watch.done()
            engine_watch.cancel()

    try:
        asyncio.run(scenario())
    finally:
        broker.stop()


def _under_file_limit(soft: int, hard: int, *flags: str) -> list[str]:
    """The command line of ``pdbroker serve`` (plaintext, INFO logs) under an open-file
    limit."""
    limit = f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))"
    argv = [
        sys.executable,
        "-m",
        "broker.cli",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        *flags,
    ]
    return [
        sys.executable,
        "-c",
        f"import os, resource, sys; {limit}; os.execv(sys.executable, {argv!r})",
    ]


def _serve_with_file_limit(soft: int, hard: int, *flags: str) -> tuple[subprocess.Popen, str]:
    """``pdbroker serve`` started under an open-file limit, and its address."""
    process = subprocess.Popen(
        _under_file_limit(soft, hard, *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    address = ""
    while not address and (line := process.stdout.readline()):
        if "listening on" in line:
            address = line.rsplit(" ", 1)[1].strip()
    if not address:
        process.kill()
        raise AssertionError(f"the broker did not start: {process.communicate()[1]}")
    return process, address


def _stop(process: subprocess.Popen) -> str:
    """Stop ``process``; what it wrote on stderr."""
    process.terminate()
    try:
        return process.communicate(timeout=10)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[1]


def _soft_file_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open-file limit for process {pid}")


def test_the_soft_file_limit_is_raised_to_the_hard_one() -> None:
    process, _ = _serve_with_file_limit(1024, 4096, "--max-connections", "1000")
    try:
        assert _soft_file_limit(process.pid) == 4096
    finally:
        logs = _stop(process)
    assert "INFO broker.serve: open files: up to 4096; up to 1000 connections a port" in logs
    assert "does not fit" not in logs


def test_a_cap_that_does_not_fit_the_file_limit_is_lowered_with_a_warning() -> None:
    """Under a limit of 300 files the default cap is lowered to 44 (256 kept for the rest),
    with a warning, and the port then holds 44 connections."""
    process, address = _serve_with_file_limit(300, 300)
    sockets: list[socket.socket] = []
    try:
        sockets = _connect(address, 60)
        assert len(_wait_closed(sockets, 0.5)) == 60 - 44
        assert process.poll() is None
    finally:
        _close(sockets)
        logs = _stop(process)
    assert (
        "WARNING broker.serve: --max-connections 8192 does not fit the open-file limit "
        "300 (256 files beside connections, 1 port(s)): lowered to 44" in logs
    )


def test_a_file_limit_without_room_for_connections_is_refused() -> None:
    done = subprocess.run(
        _under_file_limit(200, 200), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "pdbroker serve: error: --max-connections: the open-file limit 200 leaves no room "
        "for connections beside 256 other files"
    )
