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
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from prerequisites import require_binary

from harness.brokers import BrokerProcess
from harness.redis_server import RedisServer, free_port
from harness.redis_server import start_redis as start_redis_binary

__all__ = ["RedisServer", "free_port", "start_redis"]

settings.register_profile("deterministic", derandomize=True, database=None, max_examples=300)
settings.register_profile("random", derandomize=False, max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def start_redis(directory: Path, port: int | None = None) -> RedisServer:
    """:func:`harness.redis_server.start_redis` of the ``redis-server`` found, or skip."""
    binary = require_binary("redis-server", "bash scripts/test.sh installs it with apt-get")
    return start_redis_binary(directory, port, binary)


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
