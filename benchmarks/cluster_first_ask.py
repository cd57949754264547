"""First-ask planning cost as a cluster grows: prefill and decode engines of one layout,
each pair's first ``GetTransferPlan`` timed, side by side with another build of the broker.

In process (the service over the in-memory store, no gRPC): ``P`` prefill and ``D`` decode
engines of one layout (Nemotron-3-Nano TP2 -> TP2, 32k tokens) register with fake regions;
every prefill engine publishes a transfer for each decode engine, whose rank 0 asks for its
plan: the first ask of a transfer plans every decode rank, from the planner of the pair's
layouts if one is cached, else from a new one. Then a second transfer per pair is asked
for the same way (its planner cached in any build). Each round runs a fresh service in a
fresh interpreter; builds alternate round by round, and the lowest over rounds of each
build's median ask is reported (the host's timings drift), with how many first asks found a
cached planner and the ratio of the builds' first asks.

    PYTHONPATH=. python benchmarks/cluster_first_ask.py --clusters 1x1,9x8 --baseline main
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ("nemotron-3-nano-30b-a3b", 2, 2, 32768)


def measure(prefill_engines: int, decode_engines: int) -> dict[str, float]:
    """One round in this process, with whichever ``broker`` package is on the path."""
    from broker.api import PlanQuery, Publication
    from broker.layout import EngineLayout
    from broker.observer import ServiceObserver
    from broker.presets import resolve_model
    from broker.records import MemoryRegion, RankRegistration, region_rows
    from broker.service import BrokerService
    from broker.wire import MemoryKind, Role
    from harness.scenarios import build_scenario

    model, p_tp, d_tp, tokens = SCENARIO
    sc = build_scenario(resolve_model(model), p_tp, d_tp, tokens)

    class Hits(ServiceObserver):
        hits = 0

        def plan_handed_out(self, seconds: float, plan: object, cache_hit: bool) -> None:
            self.hits += cache_hit

    observer = Hits()
    service = BrokerService(observer=observer)
    next_addr = [0x1000_0000]

    def register(engine_id: str, role: Role, layout: EngineLayout) -> None:
        for rank in layout.ranks:
            regions = []
            for _ in range(rank.num_regions):
                regions.append(MemoryRegion(next_addr[0], rank.region_bytes, 0, MemoryKind.DRAM))
                next_addr[0] += rank.region_bytes
            service.register_rank(
                RankRegistration(
                    engine_id,
                    role,
                    layout.tp_size,
                    rank.tp_rank,
                    f"{engine_id}-{rank.tp_rank}",
                    b"metadata",
                    region_rows(regions),
                    rank,
                    layout.model,
                )
            )

    prefills = [f"P{i}" for i in range(prefill_engines)]
    decodes = [f"D{i}" for i in range(decode_engines)]
    for engine_id in prefills:
        register(engine_id, Role.PREFILL, sc.prefill)
    for engine_id in decodes:
        register(engine_id, Role.DECODE, sc.decode)

    def ask_each_pair(name: str) -> list[float]:
        times = []
        for p in prefills:
            for d in decodes:
                transfer_id = f"{name}-{p}-{d}"
                service.publish(Publication(transfer_id, p, sc.request.prefill_block_ids, tokens))
                query = PlanQuery(transfer_id, d, 0, sc.request.decode_block_ids)
                started = time.perf_counter()
                service.get_plan(query)
                times.append(time.perf_counter() - started)
        return times

    first = ask_each_pair("first")
    first_hits = observer.hits
    again = ask_each_pair("again")
    return {
        "first_ms": statistics.median(first) * 1e3,
        "again_ms": statistics.median(again) * 1e3,
        "first_hits": first_hits,
        "again_hits": observer.hits - first_hits,
        "asks": len(first),
    }


def exported(rev: str, into: Path) -> Path:
    """The packages of git revision ``rev`` in ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "broker", "harness", "clients"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_build(tree: Path, prefill_engines: int, decode_engines: int) -> dict[str, float]:
    """One round in a fresh interpreter importing the build in ``tree``."""
    out = subprocess.run(
        [sys.executable, __file__, "--round", f"{prefill_engines}x{decode_engines}"],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    ).stdout
    return json.loads(out)


def cluster(text: str) -> tuple[int, int]:
    prefill, _, decode = text.partition("x")
    return int(prefill), int(decode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clusters", default="1x1,9x8", help="PxD: prefill x decode engines, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each build")
    parser.add_argument("--baseline", metavar="REV", help="git revision to compare against")
    parser.add_argument("--round", metavar="PxD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.round:
        print(json.dumps(measure(*cluster(args.round))))
        return 0
    print(f"engines of one layout: {SCENARIO[0]} TP{SCENARIO[1]} -> TP{SCENARIO[2]}, ", end="")
    print(f"{SCENARIO[3] // 1024}k tokens; lowest median of {args.rounds} rounds")
    print(
        f"{'P x D':>6} {'build':<10} {'first ask ms':>13} {'cached':>7} {'later ask ms':>13} {'cached':>7}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"this": ROOT}
        if args.baseline:
            builds[args.baseline] = exported(args.baseline, Path(scratch))
        for text in args.clusters.split(","):
            rounds: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
            for _ in range(args.rounds):
                for name, tree in builds.items():
                    rounds[name].append(run_build(tree, *cluster(text)))
            first = {}
            for name, results in rounds.items():
                first[name] = min(r["first_ms"] for r in results)
                again = min(r["again_ms"] for r in results)
                asks = results[0]["asks"]
                hits = [f"{results[0][k]}/{asks}" for k in ("first_hits", "again_hits")]
                print(
                    f"{text:>6} {name:<10} {first[name]:>13.2f} {hits[0]:>7} "
                    f"{again:>13.2f} {hits[1]:>7}"
                )
            if args.baseline:
                ratio = first[args.baseline] / first["this"]
                print(f"{text:>6} first ask, {args.baseline} / this: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
