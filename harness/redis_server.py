"""A private ``redis-server`` on a free loopback port, its files in a directory of its own
(no other Redis is touched): for the tests and the benchmarks that run brokers on Redis."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.store.redis import RedisStateStore

#: Seconds to wait for redis-server to accept connections or to exit.
REDIS_START_S = 10.0


@dataclass
class RedisServer:
    """A running private ``redis-server``: ``url`` names its database 0."""

    process: subprocess.Popen
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def store(self, **ttls: int) -> RedisStateStore:
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


def start_redis(
    directory: Path, port: int | None = None, binary: str = "redis-server", *more: str
) -> RedisServer:
    """``binary`` (redis-server) on 127.0.0.1 with its files in ``directory``; append-only
    persistence so a restarted server (same directory and port) keeps what was written.
    ``more``: further options (``--replicaof HOST PORT``)."""
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
            *more,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return _answering(RedisServer(process, port, directory))


def start_sentinel(
    directory: Path, primary: RedisServer, name: str, binary: str = "redis-server"
) -> RedisServer:
    """One Redis Sentinel on a free loopback port watching ``primary`` as ``name`` (quorum
    1, down after 500 ms: a failover within seconds of the primary going away), its
    configuration (which it rewrites) in ``directory``."""
    port = free_port()
    config = directory / "sentinel.conf"
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
        f"sentinel monitor {name} 127.0.0.1 {primary.port} 1\n"
        f"sentinel down-after-milliseconds {name} 500\n"
        f"sentinel failover-timeout {name} 5000\n"
    )
    process = subprocess.Popen(
        [binary, str(config), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return _answering(RedisServer(process, port, directory))


def _answering(server: RedisServer) -> RedisServer:
    """``server`` once it answers ``PING`` (stopped, and RuntimeError, if it never does)."""
    deadline = time.monotonic() + REDIS_START_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", server.port), 0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            pass
        if server.process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server did not start: {server.process.communicate()[1]}")
        time.sleep(0.02)
