"""What ``pdbroker serve`` says once it serves: where (printed on stdout, once every port of
every process is bound, ``listening on`` last) and how (logged)."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.logs import JsonFormatter

if TYPE_CHECKING:
    from broker.server_security import ServerSecurity

log = logging.getLogger("broker.serve")


@dataclass(frozen=True)
class Bound:
    """A broker process with every port bound: where it serves (``health``: HOST:PORT of
    ``--health-port``, ``metrics_url``: its ``/metrics``; '' when off), its store (as shown,
    '' in memory) and its limits."""

    address: str
    health: str
    metrics_url: str
    store: str
    max_connections: int
    file_limit: int


def announce_serving(
    bound: Bound,
    security: ServerSecurity,
    announce: Callable[[str], None],
    workers: Sequence[str] = (),
) -> None:
    """Log how the bound port serves, then announce where: a line per worker (``workers``)
    or the metrics endpoint, the health port, and last the port itself."""
    log_mode(bound, security, len(workers))
    lines = list(workers) or ([f"metrics on {bound.metrics_url}"] if bound.metrics_url else [])
    if bound.health:
        lines.append(f"health on {bound.health}")
    # Printed last: once a supervisor reads this line, SIGTERM stops the broker cleanly.
    lines.append(f"listening on {bound.address}")
    for line in lines:
        announce(line)


def log_mode(bound: Bound, security: ServerSecurity, workers: int) -> None:
    """Log the store, how the bound port serves (a warning when callers are not
    authenticated) and the connections it holds."""
    if bound.store:
        log.info("state in the Redis store at %s", bound.store)
    if security.insecure:
        log.warning(
            "--insecure: serving plaintext without authentication; any process that reaches "
            "%s may act as any engine (use --tls-cert/--tls-key outside development)",
            bound.address,
        )
    elif security.authenticates:
        log.info("serving %s", security.describe())
    else:
        log.warning("serving %s (add --tls-client-ca or --auth-tokens)", security.describe())
    log.info(
        "%sopen files: up to %s; up to %d connections a port",
        f"{workers} workers on one port, each: " if workers else "",
        "unlimited" if bound.file_limit == resource.RLIM_INFINITY else bound.file_limit,
        bound.max_connections,
    )


def announcer(log_format: str) -> Callable[[str], None]:
    """Prints a start-up line (where the broker listens) on stdout: ``pdbroker serve: ...``,
    or with ``--log-format json`` a JSON object as the logs are, its ``message`` the same."""
    if log_format != "json":
        return lambda line: print(f"pdbroker serve: {line}", flush=True)
    formatter = JsonFormatter()

    def announce(line: str) -> None:
        record = logging.LogRecord(log.name, logging.INFO, __file__, 0, line, None, None)
        print(formatter.format(record), flush=True)

    return announce
