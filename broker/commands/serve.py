"""``pdbroker serve``: run the broker (in-memory state, or Redis with ``--store``) until
SIGINT/SIGTERM.

The port speaks TLS (``--tls-cert``/``--tls-key``), with client certificates
(``--tls-client-ca``) and/or bearer tokens (``--auth-tokens``) identifying and authorizing
callers; plaintext only with ``--insecure``, which logs a warning (:mod:`broker.server_security`).

A configuration that cannot work ends the command before it serves, with one line
``pdbroker serve: error: --flag: why`` on stderr and exit status 2: a malformed value, an
unreadable or non-PEM certificate or key, a key that is not the certificate's, a malformed
tokens file, an unreachable store, a port that cannot be bound, more than one worker on the
in-memory store. Nothing is announced before every port is bound (by every worker). A store
URL is only ever shown with its password replaced by ``***``.

``--workers N`` runs N broker processes on the port (:mod:`broker.commands.serve_workers`);
each is what one ``serve`` runs (:func:`serve_process`).

Connections cost a file each: the soft open-file limit is raised to the hard one at start-up,
and each port holds at most ``--max-connections`` at once, lowered to fit that limit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import resource
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker.commands.collector import tune_collector
from broker.commands.native_log import native_log_held
from broker.commands.options import from_environment, listen_address, port, positive_int
from broker.commands.serve_announce import Bound, announce_serving, announcer
from broker.config import STORE_THREADS, ServiceConfig
from broker.errors import UsageError
from broker.logs import FORMATS, configure_logging
from broker.service import BrokerService
from broker.store.contract import StateStore

if TYPE_CHECKING:
    from broker.metrics import BrokerMetrics
    from broker.server import BrokerServer
    from broker.server_security import ServerSecurity

log = logging.getLogger("broker.serve")

_DEFAULTS = ServiceConfig()
DEFAULT_LISTEN = "127.0.0.1:50151"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Connections a port holds at once: two per rank of a full broker (``max_ranks``), as an
#: engine reconnecting may briefly hold its old and its new one.
MAX_CONNECTIONS = 2 * _DEFAULTS.max_ranks
#: TLS and HTTP/2 handshakes take milliseconds; this much only a stalled peer needs.
HANDSHAKE_TIMEOUT_MS = 10_000
#: Engines call at least every third of their lease TTL; this closes abandoned connections.
IDLE_TIMEOUT_MS = 300_000
#: Open files kept for the broker beyond its connections: store sockets, metrics, logs.
FILES_BESIDES_CONNECTIONS = 256
#: File options of the port's security: (flag, environment variable, help).
_SECURITY_FILES = (
    ("--tls-cert", "PDBROKER_TLS_CERT", "the broker's certificate chain (PEM): serve TLS"),
    ("--tls-key", "PDBROKER_TLS_KEY", "the private key of --tls-cert (PEM)"),
    (
        "--tls-client-ca",
        "PDBROKER_TLS_CLIENT_CA",
        (
            "CA certificates (PEM) that sign client certificates: require one from every "
            "caller (mutual TLS); its common name and subject alternative names identify it"
        ),
    ),
    (
        "--auth-tokens",
        "PDBROKER_AUTH_TOKENS",
        (
            "file of 'NAME: TOKEN' lines: callers may identify as NAME with 'authorization: "
            "Bearer TOKEN' (TLS only)"
        ),
    ),
)
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
        "largest TTL a publish may ask for; extensions keep no transfer longer after its publish",
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
    ("--max-ranks", "PDBROKER_MAX_RANKS", _DEFAULTS.max_ranks, "ranks registered at once"),
    (
        "--max-read-ms",
        "PDBROKER_MAX_READ_MS",
        _DEFAULTS.max_read_ms,
        "how long an unreported plan holds its prefill blocks after its transfer ended",
    ),
    (
        "--release-backlog-bytes",
        "PDBROKER_RELEASE_BACKLOG_BYTES",
        _DEFAULTS.release_backlog_bytes,
        (
            "release events kept per prefill rank (bytes); older ones are dropped and a "
            "stream resuming before them is told to reconcile"
        ),
    ),
    (
        "--max-transfers-per-engine",
        "PDBROKER_MAX_TRANSFERS_PER_ENGINE",
        _DEFAULTS.max_transfers_per_engine,
        "transfers one prefill engine may hold at once",
    ),
    (
        "--max-block-ids-per-engine",
        "PDBROKER_MAX_BLOCK_IDS_PER_ENGINE",
        _DEFAULTS.max_block_ids_per_engine,
        "block ids one prefill engine's transfers may hold at once",
    ),
    (
        "--max-metadata-bytes-per-engine",
        "PDBROKER_MAX_METADATA_BYTES_PER_ENGINE",
        _DEFAULTS.max_metadata_bytes_per_engine,
        "NIXL agent metadata the ranks of one engine may register (bytes)",
    ),
    (
        "--release-backlog-total-bytes",
        "PDBROKER_RELEASE_BACKLOG_TOTAL_BYTES",
        _DEFAULTS.release_backlog_total_bytes,
        "release events kept over all prefill ranks (bytes)",
    ),
    (
        "--max-session-streams",
        "PDBROKER_MAX_SESSION_STREAMS",
        _DEFAULTS.max_session_streams,
        "EngineSession streams open at once (one per decode client); one more is refused",
    ),
    (
        "--planner-cache-bytes",
        "PDBROKER_PLANNER_CACHE_BYTES",
        _DEFAULTS.planner_cache_bytes,
        (
            "templates kept by cached planners (bytes; one planner per pair of engine "
            "layouts); the least recently used are dropped first"
        ),
    ),
    (
        "--max-ranks-per-identity",
        "PDBROKER_MAX_RANKS_PER_IDENTITY",
        1024,
        "ranks one authenticated identity may hold registered, over the engines it names",
    ),
    ("--reap-interval-ms", "PDBROKER_REAP_INTERVAL_MS", 100, "how often expiry is checked"),
    (
        "--store-timeout-ms",
        "PDBROKER_STORE_TIMEOUT_MS",
        1_000,
        "deadline of one Redis connect, and of all replies of one store call (UNAVAILABLE past it)",
    ),
    (
        "--workers",
        "PDBROKER_WORKERS",
        1,
        (
            "broker processes serving the port (and --health-port) together on a Redis "
            "--store; worker k of them serves metrics on port --metrics-port+k-1"
        ),
    ),
    (
        "--store-threads",
        "PDBROKER_STORE_THREADS",
        STORE_THREADS,
        (
            "threads per worker running calls on a Redis --store: they take turns running "
            "the service's code, and wait for Redis together"
        ),
    ),
    (
        "--max-connections",
        "PDBROKER_MAX_CONNECTIONS",
        MAX_CONNECTIONS,
        (
            "connections a port holds at once, per worker (lowered to fit the open-file limit); "
            "one more is closed on accept and its client sees UNAVAILABLE"
        ),
    ),
    (
        "--handshake-timeout-ms",
        "PDBROKER_HANDSHAKE_TIMEOUT_MS",
        HANDSHAKE_TIMEOUT_MS,
        "a connection that has not completed its TLS and HTTP/2 handshake by then is closed",
    ),
    (
        "--idle-timeout-ms",
        "PDBROKER_IDLE_TIMEOUT_MS",
        IDLE_TIMEOUT_MS,
        "a connection without calls for this long is closed (GOAWAY; clients reconnect)",
    ),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the broker's gRPC server",
        description="Flags override environment variables (shown in brackets).",
    )
    p.add_argument(
        "--listen",
        type=listen_address,
        metavar="HOST:PORT",
        help=f"HOST:PORT; port 0 picks a free one [PDBROKER_LISTEN, else {DEFAULT_LISTEN}]",
    )
    for flag, env, default, text in _INT_OPTIONS:
        p.add_argument(flag, type=positive_int, metavar="N", help=f"{text} [{env}, else {default}]")
    p.add_argument(
        "--store",
        metavar="URL",
        help="memory, or redis://HOST:PORT/DB (rediss:// for TLS) for state shared by "
        "replicas, or redis+sentinel://HOST:PORT[,HOST:PORT...]/PRIMARY[/DB] for the primary "
        "Redis Sentinel names [PDBROKER_STORE, else memory]",
    )
    p.add_argument(
        "--log-level",
        type=_log_level,
        metavar="LEVEL",
        help=f"{', '.join(LEVELS)} (any case) [PDBROKER_LOG_LEVEL, else INFO]",
    )
    p.add_argument(
        "--log-format",
        type=_log_format,
        metavar="FORMAT",
        help=f"{' or '.join(FORMATS)} [PDBROKER_LOG_FORMAT, else text]",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        metavar="PORT",
        help="serve Prometheus /metrics on this port of the --listen host; 0 picks one "
        "[PDBROKER_METRICS_PORT, else off]",
    )
    for flag, env, text in _SECURITY_FILES:
        p.add_argument(flag, metavar="FILE", help=f"{text} [{env}]")
    p.add_argument(
        "--admin-identities",
        metavar="NAMES",
        help="comma-separated caller names (certificate or token names) allowed the operator "
        "calls: ListEngines, ListTransfers, any GetTransfer and AbortTransfer "
        "[PDBROKER_ADMIN_IDENTITIES]",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="serve plaintext without authentication (development only) [PDBROKER_INSECURE=1]",
    )
    p.add_argument(
        "--health-port",
        type=port,
        metavar="PORT",
        help="also serve gRPC health alone, in plaintext, on this port of the --listen host, "
        "for probes that cannot speak TLS; 0 picks one [PDBROKER_HEALTH_PORT, else off]",
    )
    p.set_defaults(run=run)


def _one_of(choices: tuple[str, ...], normal: Callable[[str], str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if normal(text) not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return normal(text)

    return parse


_log_level = _one_of(LEVELS, str.upper)
_log_format = _one_of(FORMATS, str.lower)


def _resolve(args: argparse.Namespace) -> None:
    """Fill options not given as flags from the environment, then from the defaults; a bad
    environment value is refused naming its flag and variable."""
    options: list[tuple[str, str, Any, Callable[[str], Any]]] = [
        ("--listen", "PDBROKER_LISTEN", DEFAULT_LISTEN, listen_address),
        ("--log-level", "PDBROKER_LOG_LEVEL", "INFO", _log_level),
        ("--log-format", "PDBROKER_LOG_FORMAT", "text", _log_format),
        ("--store", "PDBROKER_STORE", "memory", str),
        ("--metrics-port", "PDBROKER_METRICS_PORT", None, port),
        ("--health-port", "PDBROKER_HEALTH_PORT", None, port),
        *((flag, env, default, positive_int) for flag, env, default, _ in _INT_OPTIONS),
    ]
    for flag, env, default, parse in options:
        name = _dest(flag)
        if getattr(args, name) is None:
            raw = os.environ.get(env, "")
            setattr(args, name, from_environment(flag, env, raw, parse) if raw else default)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _security(args: argparse.Namespace) -> ServerSecurity:
    """The port's security from the flags, else the environment; exits naming the flag of a
    missing or contradictory setting."""
    from broker.server_security import ServerSecurity

    files = {}
    for flag, env, _ in _SECURITY_FILES:
        files[_dest(flag)] = getattr(args, _dest(flag)) or os.environ.get(env, "")
    admins = args.admin_identities
    if admins is None:
        admins = os.environ.get("PDBROKER_ADMIN_IDENTITIES", "")
    insecure = args.insecure
    if insecure is None:
        raw = os.environ.get("PDBROKER_INSECURE", "")
        if raw.lower() not in ("", "0", "1", "false", "true"):
            raise UsageError("--insecure", f"PDBROKER_INSECURE={raw!r} is not 0 or 1")
        insecure = raw.lower() in ("1", "true")
    try:
        return ServerSecurity(
            admin_identities=frozenset(n.strip() for n in admins.split(",") if n.strip()),
            insecure=insecure,
            max_ranks_per_identity=args.max_ranks_per_identity,
            **files,
        )
    except ValueError as exc:
        raise UsageError.of(exc) from None


def run(args: argparse.Namespace) -> int:
    _resolve(args)
    security = _security(args)
    if args.workers > 1 and args.store == "memory":
        raise UsageError(
            "--workers",
            f"{args.workers} workers need a shared store (--store redis://...); the in-memory "
            "store serves one process",
        )
    configure_logging(args.log_level, args.log_format)
    announce = announcer(args.log_format)
    if args.workers > 1:
        from broker.commands.serve_workers import Supervisor

        return Supervisor(args, security, announce).run()
    return serve_process(args, security, lambda bound: announce_serving(bound, security, announce))


def serve_process(
    args: argparse.Namespace, security: ServerSecurity, on_bound: Callable[[Bound], None]
) -> int:
    """Serve in this process until SIGINT/SIGTERM, calling ``on_bound`` once every port is
    bound (and the signals are handled); a configuration that cannot work raises
    :class:`UsageError` before that."""
    from broker.span_tracer import install_broker_tracing  # imports the OpenTelemetry SDK

    # Off unless OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_*ENDPOINT ask for traces.
    tracer_provider = install_broker_tracing(os.environ.get("OTEL_SERVICE_NAME") or "pdbroker")
    config = ServiceConfig(
        default_ttl_ms=args.default_ttl_ms,
        max_ttl_ms=args.max_ttl_ms,
        lease_ttl_ms=args.lease_ttl_ms,
        retention_ms=args.retention_ms,
        max_transfers=args.max_transfers,
        max_read_ms=args.max_read_ms,
        max_ranks=args.max_ranks,
        release_backlog_bytes=args.release_backlog_bytes,
        max_transfers_per_engine=args.max_transfers_per_engine,
        max_block_ids_per_engine=args.max_block_ids_per_engine,
        max_metadata_bytes_per_engine=args.max_metadata_bytes_per_engine,
        release_backlog_total_bytes=args.release_backlog_total_bytes,
        planner_cache_bytes=args.planner_cache_bytes,
        max_session_streams=args.max_session_streams,
    )
    try:
        metrics, metrics_url = _metrics(args)
        store, shown = _open_store(args.store, config, args.store_timeout_ms)
        file_limit = _raise_file_limit()
        _fit_connections(args, file_limit)
        service = BrokerService(store, config=config, observer=metrics)
        server = _server(service, args, security, metrics)

        def bound() -> None:
            health = "" if server.health_port is None else _health_address(server)
            on_bound(
                Bound(server.address, health, metrics_url, shown, args.max_connections, file_limit)
            )

        asyncio.run(_serve(server, bound))
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flush the last spans
    return 0


def _metrics(args: argparse.Namespace) -> tuple[BrokerMetrics | None, str]:
    """The metrics and the URL of their bound ``/metrics`` endpoint (none without
    ``--metrics-port``)."""
    if args.metrics_port is None:
        return None, ""
    from broker.metrics import BrokerMetrics

    metrics = BrokerMetrics()
    host = _listen_host(args.listen)
    try:
        bound = metrics.serve(args.metrics_port, host)
    except OSError as exc:
        raise UsageError(
            "--metrics-port",
            f"cannot listen on {_url_host(host)}:{args.metrics_port}: {exc.strerror or exc}",
        ) from None
    return metrics, f"http://{_url_host(host)}:{bound}/metrics"


def _server(
    service: BrokerService,
    args: argparse.Namespace,
    security: ServerSecurity,
    metrics: BrokerMetrics | None,
) -> BrokerServer:
    """The server, its certificates and tokens read."""
    from broker.server import BrokerServer  # grpc: only for the commands that need it

    try:
        return BrokerServer(
            service,
            args.listen,
            args.reap_interval_ms,
            security,
            args.health_port,
            max_connections=args.max_connections,
            handshake_timeout_ms=args.handshake_timeout_ms,
            idle_timeout_ms=args.idle_timeout_ms,
            metrics=metrics,
            reuse_port=args.workers > 1,
            store_threads=args.store_threads,
        )
    except ValueError as exc:  # a bad certificate, key or tokens file, named by its flag
        raise UsageError.of(exc) from None


def _raise_file_limit() -> int:
    """Raise the soft limit of open files to the hard one; the limit in force after
    (``resource.RLIM_INFINITY``: none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # an unlimited hard limit above the kernel's
            log.warning("open files: cannot raise the limit from %d to %d: %s", soft, hard, exc)
    return soft


def _fit_connections(args: argparse.Namespace, file_limit: int) -> None:
    """Lower ``--max-connections`` (each port's) so that every port full still leaves
    :data:`FILES_BESIDES_CONNECTIONS` files of ``file_limit``; warns when it had to, refuses
    to start when no connection fits."""
    ports = 1 if args.health_port is None else 2
    if file_limit == resource.RLIM_INFINITY:
        return
    fits = (file_limit - FILES_BESIDES_CONNECTIONS) // ports
    if fits < 1:
        raise UsageError(
            "--max-connections",
            f"the open-file limit {file_limit} leaves no room for connections beside "
            f"{FILES_BESIDES_CONNECTIONS} other files",
        )
    if args.max_connections > fits:
        log.warning(
            "--max-connections %d does not fit the open-file limit %d (%d files beside "
            "connections, %d port(s)): lowered to %d; raise the limit (ulimit -n) for more",
            args.max_connections,
            file_limit,
            FILES_BESIDES_CONNECTIONS,
            ports,
            fits,
        )
        args.max_connections = fits


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _listen_host(listen: str) -> str:
    return listen.rsplit(":", 1)[0].strip("[]")


def _open_store(url: str, config: ServiceConfig, timeout_ms: int) -> tuple[StateStore | None, str]:
    """``None`` (the in-memory default) for ``memory``, else a reachable Redis store whose
    server-side TTLs outlast every lease and transfer the service keeps and whose connects
    and replies time out after ``timeout_ms``; with the URL as shown ('' for memory)."""
    if url == "memory":
        return None, ""
    import redis

    from broker.store.redis import RedisStateStore
    from broker.store.redis_link import SENTINEL_SCHEME, redact_url

    shown = redact_url(url)
    if not url.startswith(("redis://", "rediss://", "unix://", SENTINEL_SCHEME)):
        raise UsageError(
            "--store", f"{shown!r} is neither memory nor redis:// nor {SENTINEL_SCHEME}"
        )
    try:
        store = RedisStateStore.from_url(
            url,
            timeout_ms=timeout_ms,
            rank_ttl_ms=3 * config.lease_ttl_ms,
            transfer_ttl_ms=config.max_ttl_ms
            + config.max_read_ms
            + config.retention_ms
            + config.lease_ttl_ms,
        )
    except ValueError as exc:  # the URL's parse
        why = _without(str(exc), url)
        raise UsageError("--store", f"{shown}: {why}") from None
    try:
        store.client.ping()
    except redis.RedisError as exc:
        why = _without(str(exc), store.client.connection_pool.connection_kwargs.get("password"))
        raise UsageError("--store", f"cannot reach {shown}: {why}") from None
    return store, shown


def _without(text: str, secret: str | None) -> str:
    """``text`` on one line, ``secret`` (a URL or password) replaced by ``***``."""
    if secret:
        text = text.replace(secret, "***")
    return " ".join(text.split())


async def _serve(server: BrokerServer, bound: Callable[[], None]) -> None:
    await _start(server)
    tune_collector()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound()
    await stop.wait()
    await server.stop()


async def _start(server: BrokerServer) -> None:
    """Bind the ports and start serving. gRPC logs a failed bind natively, on several
    lines: that log is held back and its reason becomes the one line naming the flag."""
    health = _health_address(server)
    failure: Exception | None = None
    with native_log_held() as held:
        try:
            await server.start()
        except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError for a failed bind
            failure = exc
    if failure is None:
        sys.stderr.write(held[0])  # what a successful start logged, if anything
        return
    flag, address = ("--health-port", health) if server.port else ("--listen", server.listen)
    raise UsageError(flag, f"cannot listen on {address}: {_bind_failure(held[0], failure)}")


def _health_address(server: BrokerServer) -> str:
    return f"{_url_host(_listen_host(server.listen))}:{server.health_port}"


#: gRPC's native log of a bind that failed: the system's reason, or what failed before it.
_BIND_REASON = re.compile(r"Error in bind for address '[^']*': ([^)]+)\)")
_ADD_PORT_FAILURE = re.compile(r"Failed to add port to server: (.+)")


def _bind_failure(native_log: str, exc: Exception) -> str:
    for pattern in (_BIND_REASON, _ADD_PORT_FAILURE):
        found = pattern.search(native_log)
        if found:
            return found.group(1).strip()
    return " ".join(str(exc).split())
