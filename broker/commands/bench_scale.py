"""``pdbroker bench scale``: what each call costs a broker as its cluster grows, in memory
and on Redis (:mod:`harness.scale_bench`), against the goal of a cost independent of the
cluster's size."""

from __future__ import annotations

import argparse

from broker.commands.options import positive_int, positive_ints
from broker.console import Progress
from broker.errors import UsageError

#: The stores ``--store`` may name.
STORES = ("memory", "redis")
#: Largest sweep the defaults stop short of (see ``--help``).
FULL_SWEEP = "--engines 2,16,64,256 --held 100,1000,10000,100000 --tp 8"


def add_scale(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``scale`` kind of ``pdbroker bench``."""
    scale = kinds.add_parser(
        "scale",
        help="latency and broker CPU per call, event loop stalls and memory per transfer "
        "against cluster size (engines, ranks, transfers held), in memory and on Redis",
        epilog=f"the full sweep: {FULL_SWEEP} (2,048 ranks, minutes per point)",
    )
    scale.add_argument(
        "--engines",
        type=positive_ints,
        default="2,8,32",
        help="comma-separated engine counts (half prefill, half decode)",
    )
    scale.add_argument(
        "--held",
        type=positive_ints,
        default="100,1000,10000",
        help="comma-separated counts of transfers held in flight",
    )
    scale.add_argument(
        "--tp",
        type=positive_ints,
        default="1,2,4,8",
        help="comma-separated TP sizes the engines take in turn (each of 1, 2, 4, 8)",
    )
    scale.add_argument(
        "--store",
        default="memory,redis",
        help="comma-separated stores: memory, redis (a private redis-server)",
    )
    scale.add_argument(
        "--samples", type=positive_int, default=200, help="timed calls of each kind per point"
    )
    scale.add_argument(
        "--expiries", type=positive_int, default=20, help="leases left to expire per point"
    )
    scale.add_argument("--tokens", type=positive_int, default=8192, help="tokens of every transfer")
    scale.add_argument(
        "--trials",
        type=positive_int,
        default=1,
        help="sweeps run in turn; each figure is the lowest of its trials",
    )
    scale.add_argument(
        "--lease-ttl-ms",
        type=positive_int,
        default=3000,
        help="the brokers' lease TTL: how long each point waits for its expiries",
    )
    return scale


def run_scale_command(args: argparse.Namespace, progress: Progress) -> int:
    """Run the sweep; print it (or its JSON); write JSON and PNG under ``--out``."""
    from broker.commands.bench import _emit
    from harness.scale_bench import ScaleOptions, plot, run_scale, table

    stores = [s.strip() for s in args.store.split(",") if s.strip()]
    if not stores or any(s not in STORES for s in stores):
        raise UsageError("--store", f"{args.store!r}: name memory, redis or memory,redis")
    if any(tp not in (1, 2, 4, 8) for tp in args.tp):
        raise UsageError("--tp", f"{args.tp}: each TP size must be 1, 2, 4 or 8")
    options = ScaleOptions(
        engines=args.engines,
        held=args.held,
        tp=args.tp,
        stores=stores,
        samples=args.samples,
        expiries=args.expiries,
        tokens=args.tokens,
        lease_ttl_ms=args.lease_ttl_ms,
        trials=args.trials,
    )
    result = run_scale(options, progress)
    _emit(args, progress, "scale", {"scale": result}, table(result))
    if args.out:
        plot(result, args.out / "scale.png")
    return 0
