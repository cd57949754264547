"""``pdbroker status`` and ``pdbroker transfer ID``: what a running broker holds, through its
read-only RPCs (``ListEngines``, ``ListTransfers``, ``GetTransfer``).

``status``: engines and their ranks (lease time left), transfers in flight (oldest first, with
their age) and the finished ones still kept. ``transfer``: one transfer's state, trace id,
timeline, plans and releases. ``--json`` prints one JSON object instead. gRPC is imported
only when one of them runs.

Against a broker that authorizes callers, both need an operator's credentials (a name in its
``--admin-identities``): ``--tls-ca`` with a client certificate (``--tls-cert``,
``--tls-key``) or a ``--token-file``. A broker that cannot be reached because it speaks TLS
and the command not (or the other way round) is a usage error naming ``--tls-ca``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from broker.commands.options import broker_address, from_environment, positive_float, positive_int
from broker.errors import UsageError
from broker.tracing import trace_id_of

if TYPE_CHECKING:
    from broker.client_security import ChannelSecurity
    from broker.v1 import broker_pb2 as pb

DEFAULT_BROKER = "127.0.0.1:50151"
_DEFAULT_LIMIT = 20
#: Connection options: (flag, environment variable, help).
_SECURITY_FILES = (
    ("--tls-ca", "PDBROKER_TLS_CA", "CA certificate (PEM) of the broker's certificate: use TLS"),
    ("--tls-cert", "PDBROKER_TLS_CLIENT_CERT", "client certificate (PEM) for mutual TLS"),
    ("--tls-key", "PDBROKER_TLS_CLIENT_KEY", "the private key of --tls-cert (PEM)"),
    ("--token-file", "PDBROKER_TOKEN_FILE", "file holding a bearer token (TLS only)"),
)


def register(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser(
        "status",
        help="engines, ranks and in-flight transfers of a running broker",
        description=__doc__,
    )
    _common(status)
    status.add_argument(
        "--limit",
        type=positive_int,
        default=_DEFAULT_LIMIT,
        help="in-flight transfers listed (oldest first)",
    )
    status.set_defaults(run=run_status)
    transfer = sub.add_parser(
        "transfer", help="one transfer's state, timeline, plans, releases", description=__doc__
    )
    transfer.add_argument("transfer_id", metavar="ID", help="the transfer's id")
    transfer.add_argument(
        "--prefill-engine",
        default="",
        metavar="ENGINE",
        help="the prefill engine that published it (needed when several published this id)",
    )
    _common(transfer)
    transfer.set_defaults(run=run_transfer)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker",
        type=broker_address,
        metavar="HOST:PORT",
        help=f"HOST:PORT of the broker [PDBROKER_BROKER, else {DEFAULT_BROKER}]",
    )
    p.add_argument(
        "--timeout", type=positive_float, default=5.0, metavar="SECONDS", help="seconds per call"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    for flag, env, text in _SECURITY_FILES:
        p.add_argument(flag, metavar="FILE", help=f"{text} [{env}, else plaintext]")


def _security(args: argparse.Namespace) -> ChannelSecurity:
    """How to connect, from the flags, else the environment; a bad option is a usage error."""
    from broker.client_security import ChannelSecurity

    files = {}
    for flag, env, _ in _SECURITY_FILES:
        name = flag.removeprefix("--").replace("-", "_")
        files[name] = getattr(args, name) or os.environ.get(env, "")
    try:
        return ChannelSecurity.from_files(
            files["tls_ca"], files["tls_cert"], files["tls_key"], files["token_file"], flags=True
        )
    except ValueError as exc:
        raise UsageError.of(exc) from None


def _address(args: argparse.Namespace) -> str:
    if args.broker:
        return str(args.broker)
    raw = os.environ.get("PDBROKER_BROKER", "")
    return (
        from_environment("--broker", "PDBROKER_BROKER", raw, broker_address)
        if raw
        else DEFAULT_BROKER
    )


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    """One read-only call; a failure exits with the broker's status and message (gRPC's
    native log of it held back)."""
    import grpc

    from broker.commands.native_log import native_log_held
    from broker.v1 import broker_pb2_grpc as pb_grpc

    address = _address(args)
    security = _security(args)
    try:
        with native_log_held() as held, security.channel(address) as channel:
            answer = getattr(pb_grpc.BrokerStub(channel), method)(request, timeout=args.timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            _refuse_tls_mismatch(address, security)
        raise SystemExit(
            f"pdbroker {args.command}: error: {method} at {address}: "
            f"{exc.code().name}: {exc.details()}"
        ) from None
    except ValueError as exc:  # an unreadable certificate, key or CA file
        raise UsageError.of(exc) from None
    sys.stderr.write(held[0])
    return answer


def _refuse_tls_mismatch(address: str, security: ChannelSecurity) -> None:
    """A usage error if the broker at ``address`` speaks TLS and the call did not, or the
    other way round (gRPC tells the first only as "Socket closed")."""
    from broker.client_security import speaks_tls

    tls = speaks_tls(address)
    if tls and not security.tls:
        raise UsageError(
            "--tls-ca",
            f"the broker at {address} serves TLS: pass --tls-ca with the CA of its "
            "certificate (and the credentials it asks for)",
        )
    if tls is False and security.tls:
        raise UsageError(
            "--tls-ca",
            f"the broker at {address} serves plaintext (serve --insecure): leave out "
            "--tls-ca, --tls-cert, --tls-key and --token-file",
        )


def _name(enum_type: Any, value: int, prefix: str) -> str:
    return enum_type.Name(value).removeprefix(prefix).lower()


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# --------------------------------------------------------------------------- status


def run_status(args: argparse.Namespace) -> int:
    from broker.v1 import broker_pb2 as pb

    engines = _call(args, "ListEngines", pb.ListEnginesRequest())
    listing = _call(
        args, "ListTransfers", pb.ListTransfersRequest(include_finished=False, limit=args.limit)
    )
    summary = status_summary(engines, listing)
    print(json.dumps(summary) if args.json else "\n".join(format_status(summary)))
    return 0


def status_summary(engines: pb.ListEnginesResponse, listing: pb.ListTransfersResponse) -> dict:
    """JSON-ready status; ages and lease times are relative to the broker's clock."""
    from broker.v1 import broker_pb2 as pb

    now = listing.now_ms
    counts = {_name(pb.TransferState, c.state, "TRANSFER_STATE_"): c.count for c in listing.counts}
    in_flight = [
        {
            "transfer_id": t.transfer_id,
            "state": _name(pb.TransferState, t.state, "TRANSFER_STATE_"),
            "prefill_engine_id": t.prefill_engine_id,
            "decode_engine_id": t.decode_engine_id,
            "num_tokens": t.num_tokens,
            "age_ms": now - t.published_at_ms,
            "expires_in_ms": t.expires_at_ms - now,
            "plans": t.plans,
            "plans_reported": t.plans_reported,
            "trace_id": trace_id_of(t.traceparent),
        }
        for t in listing.transfers
    ]
    return {
        "now_ms": now,
        "engines": [
            {
                "engine_id": e.engine_id,
                "role": _name(pb.Role, e.role, "ROLE_"),
                "tp_size": e.tp_size,
                "model_fingerprint": e.model_fingerprint,
                "generation": e.generation,
                "complete": e.complete,
                "ranks": [
                    {
                        "tp_rank": r.tp_rank,
                        "agent_name": r.agent_name,
                        "lease_left_ms": r.lease_expires_at_ms - now,
                        "num_regions": r.num_regions,
                        "num_blocks": r.num_blocks,
                        "page_bytes": r.page_bytes,
                    }
                    for r in e.ranks
                ],
            }
            for e in engines.engines
        ],
        "transfers": {
            "counts": counts,
            "in_flight": counts.get("published", 0) + counts.get("in_progress", 0),
            "oldest_in_flight": in_flight[0] if in_flight else None,
            "listed": in_flight,
        },
    }


def format_status(s: dict) -> list[str]:
    engines = s["engines"]
    lines = [f"engines: {len(engines)}, ranks: {sum(len(e['ranks']) for e in engines)}"]
    if engines:
        rows = [["ENGINE", "ROLE", "TP", "RANKS", "GENERATION", "MODEL"]]
        for e in engines:
            rows.append(
                [
                    e["engine_id"],
                    e["role"],
                    str(e["tp_size"]),
                    f"{len(e['ranks'])}/{e['tp_size']}",
                    str(e["generation"]),
                    e["model_fingerprint"],
                ]
            )
        lines += _table(rows)
        rows = [["ENGINE", "RANK", "AGENT", "LEASE LEFT s", "REGIONS", "BLOCKS", "PAGE BYTES"]]
        for e in engines:
            for r in e["ranks"]:
                rows.append(
                    [
                        e["engine_id"],
                        str(r["tp_rank"]),
                        r["agent_name"],
                        f"{r['lease_left_ms'] / 1000:.1f}",
                        str(r["num_regions"]),
                        f"{r['num_blocks']:,}",
                        f"{r['page_bytes']:,}",
                    ]
                )
        lines += [""] + _table(rows)
    t = s["transfers"]
    oldest = t["oldest_in_flight"]
    by_state = ", ".join(
        f"{n:,} {state}"
        for state, n in t["counts"].items()
        if state in ("published", "in_progress")
    )
    lines += [
        "",
        f"transfers in flight: {t['in_flight']:,}"
        + (
            f" ({by_state}); oldest {oldest['transfer_id']}, {oldest['age_ms'] / 1000:.3f} s"
            if oldest
            else ""
        ),
    ]
    if t["listed"]:
        rows = [
            [
                "TRANSFER",
                "STATE",
                "PREFILL",
                "DECODE",
                "TOKENS",
                "AGE s",
                "EXPIRES IN s",
                "REPORTED",
                "TRACE",
            ]
        ]
        for x in t["listed"]:
            rows.append(
                [
                    x["transfer_id"],
                    x["state"],
                    x["prefill_engine_id"],
                    x["decode_engine_id"] or "-",
                    f"{x['num_tokens']:,}",
                    f"{x['age_ms'] / 1000:.3f}",
                    f"{x['expires_in_ms'] / 1000:.3f}",
                    f"{x['plans_reported']}/{x['plans']}",
                    x["trace_id"] or "-",
                ]
            )
        lines += _table(rows)
    finished = {k: n for k, n in t["counts"].items() if k not in ("published", "in_progress")}
    if finished:
        lines.append(
            "finished, kept for queries: " + ", ".join(f"{n:,} {k}" for k, n in finished.items())
        )
    return lines


# --------------------------------------------------------------------------- transfer


def run_transfer(args: argparse.Namespace) -> int:
    from broker.v1 import broker_pb2 as pb

    request = pb.GetTransferRequest(
        transfer_id=args.transfer_id, prefill_engine_id=args.prefill_engine
    )
    t = _call(args, "GetTransfer", request)
    summary = transfer_summary(t)
    print(json.dumps(summary) if args.json else "\n".join(format_transfer(summary)))
    return 0


def transfer_summary(t: pb.GetTransferResponse) -> dict:
    """JSON-ready view of one transfer; timeline instants as ms after publication."""
    from broker.v1 import broker_pb2 as pb

    end = t.finished_at_ms or t.now_ms
    return {
        "transfer_id": t.transfer_id,
        "state": _name(pb.TransferState, t.state, "TRANSFER_STATE_"),
        "prefill_engine_id": t.prefill_engine_id,
        "decode_engine_id": t.decode_engine_id,
        "num_tokens": t.num_tokens,
        "published_at_ms": t.published_at_ms,
        "expires_at_ms": t.expires_at_ms,
        "finished_at_ms": t.finished_at_ms,
        "duration_ms": end - t.published_at_ms,
        "trace_id": trace_id_of(t.traceparent),
        "traceparent": t.traceparent,
        "timeline": [
            {"after_ms": e.at_ms - t.published_at_ms, "event": e.event, "detail": e.detail}
            for e in t.timeline
        ],
        "plans": [
            {
                "plan_id": p.plan_id,
                "decode_rank": p.decode_rank,
                "prefill_ranks": list(p.prefill_ranks),
                "total_bytes": p.total_bytes,
                "num_descriptors": p.num_descriptors,
                "handed_out": p.handed_out,
                "status": _name(pb.ReportStatus, p.status, "REPORT_STATUS_"),
                "bytes_moved": p.bytes_moved,
                "duration_us": p.duration_us,
                "error": p.error,
            }
            for p in t.plans
        ],
        "releases": [
            {
                "prefill_rank": r.tp_rank,
                "reason": _name(pb.ReleaseReason, r.reason, "RELEASE_REASON_"),
                "consumers": list(r.consumers),
            }
            for r in t.releases
        ],
    }


def format_transfer(s: dict) -> list[str]:
    finished = "finished" if s["finished_at_ms"] else "running"
    lines = [
        f"transfer {s['transfer_id']}: {s['state']}",
        (
            f"  prefill {s['prefill_engine_id']} -> decode {s['decode_engine_id'] or '-'}, "
            f"{s['num_tokens']:,} tokens; published {_utc(s['published_at_ms'])} UTC, "
            f"{finished} after {s['duration_ms']:,} ms"
        ),
        f"  trace {s['trace_id'] or '- (not traced)'}",
        "timeline (ms after publication):",
    ]
    lines += _table([[f"{e['after_ms']:>6}", e["event"], e["detail"]] for e in s["timeline"]])
    if s["plans"]:
        rows = [["DECODE RANK", "SOURCES", "BYTES", "DESCRIPTORS", "STATUS", "READ us", "PLAN"]]
        for p in s["plans"]:
            rows.append(
                [
                    str(p["decode_rank"]),
                    ",".join(map(str, p["prefill_ranks"])),
                    f"{p['total_bytes']:,}",
                    f"{p['num_descriptors']:,}",
                    p["status"] if p["handed_out"] else "not asked for",
                    f"{p['duration_us']:,}",
                    p["plan_id"] + (f"  {p['error']}" if p["error"] else ""),
                ]
            )
        lines += ["plans:", *_table(rows)]
    lines.append("releases:")
    for r in s["releases"]:
        readers = ",".join(map(str, r["consumers"])) or "none"
        lines.append(f"  prefill rank {r['prefill_rank']}: {r['reason']} (readers: {readers})")
    return lines
