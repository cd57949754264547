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


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"pdbroker serve: error: {name}={raw!r} is not an integer") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the broker's gRPC server",
                       description="Flags override environment variables (shown in brackets).")
    p.add_argument("--listen", default=os.environ.get("PDBROKER_LISTEN", "127.0.0.1:50151"),
                   help="HOST:PORT; port 0 picks a free one [PDBROKER_LISTEN]")
    p.add_argument("--default-ttl-ms", type=int,
                   default=_env_int("PDBROKER_DEFAULT_TTL_MS", _DEFAULTS.default_ttl_ms),
                   help="transfer TTL when a publish sets none [PDBROKER_DEFAULT_TTL_MS]")
    p.add_argument("--max-ttl-ms", type=int,
                   default=_env_int("PDBROKER_MAX_TTL_MS", _DEFAULTS.max_ttl_ms),
                   help="largest TTL a publish may ask for [PDBROKER_MAX_TTL_MS]")
    p.add_argument("--lease-ttl-ms", type=int,
                   default=_env_int("PDBROKER_LEASE_TTL_MS", _DEFAULTS.lease_ttl_ms),
                   help="rank lease TTL [PDBROKER_LEASE_TTL_MS]")
    p.add_argument("--retention-ms", type=int,
                   default=_env_int("PDBROKER_RETENTION_MS", _DEFAULTS.retention_ms),
                   help="how long finished transfers stay queryable [PDBROKER_RETENTION_MS]")
    p.add_argument("--max-transfers", type=int,
                   default=_env_int("PDBROKER_MAX_TRANSFERS", _DEFAULTS.max_transfers),
                   help="transfers held at once [PDBROKER_MAX_TRANSFERS]")
    p.add_argument("--reap-interval-ms", type=int,
                   default=_env_int("PDBROKER_REAP_INTERVAL_MS", 100),
                   help="how often expiry is checked [PDBROKER_REAP_INTERVAL_MS]")
    p.add_argument("--log-level", default=os.environ.get("PDBROKER_LOG_LEVEL", "INFO"),
                   help="[PDBROKER_LOG_LEVEL]")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("default_ttl_ms", "max_ttl_ms", "lease_ttl_ms", "retention_ms", "max_transfers",
                 "reap_interval_ms"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"pdbroker serve: error: --{name.replace('_', '-')} must be positive")
    config = ServiceConfig(default_ttl_ms=args.default_ttl_ms, max_ttl_ms=args.max_ttl_ms,
                           lease_ttl_ms=args.lease_ttl_ms, retention_ms=args.retention_ms,
                           max_transfers=args.max_transfers)
    asyncio.run(_serve(BrokerServer(BrokerService(config=config), args.listen, args.reap_interval_ms)))
    return 0


async def _serve(server: BrokerServer) -> None:
    await server.start()
    # Keep the import-time heap out of full collections: they then walk only the broker's
    # own records, which keeps GC pauses (and so tail latency) short.
    gc.freeze()
    print(f"pdbroker serve: listening on {server.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
