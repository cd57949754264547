"""``pdbroker serve``: run the broker (in-memory state) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal

from broker.server import BrokerServer
from broker.service import BrokerService, ServiceConfig

_DEFAULTS = ServiceConfig()
#: Allocations between young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 50_000
#: Positive integer options: (flag, environment variable, default, help).
_INT_OPTIONS = (
    (
        "--default-ttl-ms",
        "PDBROKER_DEFAULT_TTL_MS",
        _DEFAULTS.default_ttl_ms,
        "transfer TTL when a publish sets none",
    ),
    (
        "--max-ttl-ms",
        "PDBROKER_MAX_TTL_MS",
        _DEFAULTS.max_ttl_ms,
        "largest TTL a publish may ask for",
    ),
    ("--lease-ttl-ms", "PDBROKER_LEASE_TTL_MS", _DEFAULTS.lease_ttl_ms, "rank lease TTL"),
    (
        "--retention-ms",
        "PDBROKER_RETENTION_MS",
        _DEFAULTS.retention_ms,
        "how long finished transfers stay queryable",
    ),
    (
        "--max-transfers",
        "PDBROKER_MAX_TRANSFERS",
        _DEFAULTS.max_transfers,
        "transfers held at once",
    ),
    ("--reap-interval-ms", "PDBROKER_REAP_INTERVAL_MS", 100, "how often expiry is checked"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the broker's gRPC server",
        description="Flags override environment variables (shown in brackets).",
    )
    p.add_argument(
        "--listen",
        help="HOST:PORT; port 0 picks a free one [PDBROKER_LISTEN, else 127.0.0.1:50151]",
    )
    for flag, env, default, text in _INT_OPTIONS:
        p.add_argument(flag, type=int, help=f"{text} [{env}, else {default}]")
    p.add_argument("--log-level", help="[PDBROKER_LOG_LEVEL, else INFO]")
    p.set_defaults(run=run)


def _resolve(args: argparse.Namespace) -> None:
    """Fill options not given as flags from the environment, then from the defaults."""
    if args.listen is None:
        args.listen = os.environ.get("PDBROKER_LISTEN", "127.0.0.1:50151")
    if args.log_level is None:
        args.log_level = os.environ.get("PDBROKER_LOG_LEVEL", "INFO")
    for flag, env, default, _ in _INT_OPTIONS:
        name = flag.removeprefix("--").replace("-", "_")
        if getattr(args, name) is None:
            raw = os.environ.get(env)
            try:
                setattr(args, name, default if raw is None else int(raw))
            except ValueError:
                raise SystemExit(
                    f"pdbroker serve: error: {env}={raw!r} is not an integer"
                ) from None
        if getattr(args, name) <= 0:
            raise SystemExit(f"pdbroker serve: error: {flag} must be positive")


def run(args: argparse.Namespace) -> int:
    _resolve(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServiceConfig(
        default_ttl_ms=args.default_ttl_ms,
        max_ttl_ms=args.max_ttl_ms,
        lease_ttl_ms=args.lease_ttl_ms,
        retention_ms=args.retention_ms,
        max_transfers=args.max_transfers,
    )
    asyncio.run(
        _serve(BrokerServer(BrokerService(config=config), args.listen, args.reap_interval_ms))
    )
    return 0


async def _serve(server: BrokerServer) -> None:
    await server.start()
    # GC tuning for tail latency: keep the import-time heap out of full collections (they
    # then walk only the broker's own records), and collect the young generation every
    # GC_YOUNG_THRESHOLD allocations rather than 700: a plan allocates hundreds of
    # short-lived objects that reference counting frees anyway.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 100)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Printed last: once a supervisor reads this line, SIGTERM stops the broker cleanly.
    print(f"pdbroker serve: listening on {server.address}", flush=True)
    await stop.wait()
    await server.stop()
