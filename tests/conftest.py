"""Fixtures shared by test modules: a private ``redis-server``, the store parametrization, and
a ``pdbroker serve`` process per test (``broker``; modules that need another kind of broker
define their own).

``redis_server`` starts one ``redis-server`` per session on a free loopback port in a temporary
directory (no other Redis is touched) and stops it at the end. Where no ``redis-server`` binary
exists the Redis tests skip with that reason, except under CI (``CI=true``), where
``.ci/run`` installs it and a missing server is a failure (:mod:`prerequisites`).

Hypothesis runs derandomized by default, so the suite is the same on every run; the profile
``random`` (``HYPOTHESIS_PROFILE=random``) draws fresh examples, ten times as many.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings
from prerequisites import require_binary

from harness.brokers import BrokerProcess

#: Seconds to wait for redis-server to accept connections or to exit.
REDIS_START_S = 10.0

settings.register_profile("deterministic", derandomize=True, database=None, max_examples=300)
settings.register_profile("random", derandomize=False, max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@dataclass
class RedisServer:
    """A running private ``redis-server``: ``url`` names its database 0."""

    process: subprocess.Popen
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def store(self, **ttls: int):
        """A :class:`~broker.store.redis.RedisStateStore` under a prefix of its own, so
        every store made here starts empty."""
        from broker.store.redis import RedisStateStore

        return RedisStateStore.from_url(self.url, f"test-{uuid.uuid4().hex[:12]}:", **ttls)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(REDIS_START_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: Path, port: int | None = None) -> RedisServer:
    """``redis-server`` on 127.0.0.1 with its files in ``directory``; append-only persistence
    so a restarted server (same directory and port) keeps what was written."""
    binary = require_binary("redis-server", "bash scripts/test.sh installs it with apt-get")
    port = port or free_port()
    process = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = RedisServer(process, port, directory)
    deadline = time.monotonic() + REDIS_START_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server did not start: {process.stderr.read()}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(params=["memory", "redis"])
def default_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once per store: with ``redis``, every ``BrokerService`` the test builds
    without a store gets a fresh :class:`~broker.store.redis.RedisStateStore` instead of the
    in-memory default. Use it with ``pytestmark = pytest.mark.usefixtures("default_store")``."""
    if request.param == "redis":
        import broker.service

        server: RedisServer = request.getfixturevalue("redis_server")
        monkeypatch.setattr(broker.service, "InMemoryStateStore", server.store)
    return request.param


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    """A ``pdbroker serve`` process of its own for one test."""
    process = BrokerProcess()
    yield process
    process.stop()
