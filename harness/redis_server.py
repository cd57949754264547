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
    directory: Path, port: int | None = None, binary: str = "redis-server"
) -> RedisServer:
    """``binary`` (redis-server) on 127.0.0.1 with its files in ``directory``; append-only
    persistence so a restarted server (same directory and port) keeps what was written."""
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
            raise RuntimeError(f"redis-server did not start: {process.communicate()[1]}")
        time.sleep(0.02)
