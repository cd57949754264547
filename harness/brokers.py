"""Brokers for the harness: a ``pdbroker serve`` process on a loopback port, or replicas
already running, as :func:`harness.fleet.run_fleet` and the tests use them; channels that
do not share their connection (:data:`OWN_CONNECTIONS`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from broker.client_security import PLAINTEXT, ChannelSecurity, Options
from clients.protocol import broker_addresses


@dataclass(frozen=True)
class OwnConnections(ChannelSecurity):
    """A :class:`ChannelSecurity` whose every channel opens a connection of its own, as
    clients in separate processes have. gRPC otherwise shares one among a process's channels
    to an address, which would put every client of the process on one worker of a
    ``pdbroker serve --workers`` broker."""

    def aio_channel(self, target: str, options: Options = ()) -> grpc.aio.Channel:
        return super().aio_channel(target, [*options, ("grpc.use_local_subchannel_pool", 1)])


#: Plaintext, a connection per channel.
OWN_CONNECTIONS = OwnConnections()


def serve_command(*flags: str, listen: str = "127.0.0.1:0") -> list[str]:
    """``pdbroker serve`` run by this Python on ``listen`` with ``flags``, plaintext
    (``--insecure``) unless the flags name ``--tls-cert``."""
    plaintext = () if "--tls-cert" in flags else ("--insecure",)
    return [sys.executable, "-m", "broker.cli", "serve", "--listen", listen, *plaintext, *flags]


class BrokerProcess:
    """``pdbroker serve`` on an ephemeral loopback port; ``flags`` are more ``serve`` options
    (``--metrics-port 0`` sets :attr:`metrics_url`); without ``--tls-cert`` among them it
    serves plaintext (``--insecure``). ``security``: how :meth:`list_engines` connects (an
    operator's credentials when the broker authorizes callers). :attr:`announced` holds the
    lines it printed while starting; what it prints after goes to this process's stdout."""

    def __init__(self, *flags: str, security: ChannelSecurity = PLAINTEXT) -> None:
        self.security = security
        self.process = subprocess.Popen(
            serve_command("--log-level", "WARNING", *flags),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.address = self.metrics_url = ""
        self.announced: list[str] = []
        while not self.address and (line := self.process.stdout.readline()):
            self.announced.append(line.rstrip("\n"))
            if "metrics on" in line:
                self.metrics_url = line.rsplit(" ", 1)[1].strip()
            elif "listening on" in line:
                self.address = line.rsplit(" ", 1)[1].strip()
        if not self.address:
            self.stop()
            raise RuntimeError(f"the broker did not start (exit code {self.process.poll()})")
        # Keep its stdout flowing (a console span exporter writes there).
        threading.Thread(
            target=shutil.copyfileobj, args=(self.process.stdout, sys.stdout), daemon=True
        ).start()

    def list_engines(self) -> tuple[str, ...]:
        from broker.v1 import broker_pb2 as pb
        from broker.v1 import broker_pb2_grpc as pb_grpc

        with self.security.channel(self.address) as channel:
            response = pb_grpc.BrokerStub(channel).ListEngines(pb.ListEnginesRequest(), timeout=10)
        return tuple(e.engine_id for e in response.engines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class RunningBrokers:
    """Brokers already running (replicas sharing a store), for :func:`run_fleet` in place of
    a :class:`BrokerProcess`: engines get every address and fail over between them."""

    def __init__(
        self, addresses: str | Sequence[str], security: ChannelSecurity = PLAINTEXT
    ) -> None:
        self.addresses = broker_addresses(addresses)
        self.address = ",".join(self.addresses)
        self.security = security

    def list_engines(self) -> tuple[str, ...]:
        """The engines registered, from the first replica that answers."""
        from broker.v1 import broker_pb2 as pb
        from broker.v1 import broker_pb2_grpc as pb_grpc

        error: grpc.RpcError | None = None
        for address in self.addresses:
            try:
                with self.security.channel(address) as channel:
                    response = pb_grpc.BrokerStub(channel).ListEngines(
                        pb.ListEnginesRequest(), timeout=10
                    )
                return tuple(e.engine_id for e in response.engines)
            except grpc.RpcError as exc:
                error = exc
        assert error is not None
        raise RuntimeError(
            f"no broker of {self.address} answered: {error.code().name}: {error.details()}"
        )

    def stop(self) -> None:
        """Nothing: they were running before and keep running."""
