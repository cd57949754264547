"""What each call of a transfer's life costs the broker's own CPU on Redis, side by side with
the in-memory store: the service in one process (no gRPC, no store thread), a Nemotron-3-Nano
TP2 prefill and TP2 decode engine registered (fake addresses), a private ``redis-server``
started here. One cycle: ``PublishBlocks``, ``GetTransferPlan`` (first ask, then the later
rank), ``ReportTransfer`` of both plans (the last releases the prefill ranks) and one
``KeepAlive``.

The ways alternate trial by trial, ``--cycles`` fresh transfers each: in memory; on Redis
with redis-py's pure-Python reply parser; on Redis with ``hiredis``'s (when it is
installed; the store packs its own commands either way), its replies read as the store
reads them (a round trip's straight from hiredis's reader) and, as a way of its own, one
redis-py ``read_response`` a reply. Printed per call: the lowest of ``--trials`` CPU times per call of
each way and the ratios to memory; Redis's commands per call (counted once, in the steady
state); per cycle, the broker's and Redis's CPU (Redis's from /proc, the lowest trial).

    .venv/bin/python benchmarks/redis_call_cost.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
from redis._parsers import _RESP2Parser
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE

from broker import convert
from broker.api import PlanQuery, Publication, Report
from broker.config import ServiceConfig
from broker.presets import resolve_model
from broker.service import BrokerService
from broker.store import redis_unit
from broker.store.redis import RedisStateStore
from broker.store.redis_link import read_replies
from broker.wire import ReportStatus, Role
from harness.bench_engines import DECODE_ADDR, PREFILL_ADDR, cpu_seconds, registrations
from harness.redis_server import RedisServer, start_redis
from harness.scenarios import Scenario, build_scenario

CALLS = (
    "PublishBlocks",
    "GetTransferPlan (first ask)",
    "GetTransferPlan (later rank)",
    "ReportTransfer",
    "ReportTransfer (last: releases)",
    "KeepAlive",
)


def read_each(connection: Any, count: int) -> list[Any]:
    """``count`` replies, one redis-py ``read_response`` each."""
    return [connection.read_response() for _ in range(count)]


class Way:
    """A service and its engines' leases; ``transfers`` numbers its fresh transfers; its
    store reads a round trip's replies with ``reader``."""

    def __init__(
        self,
        sc: Scenario,
        service: BrokerService,
        reader: Callable[[Any, int], list[Any]] = read_replies,
    ) -> None:
        self.sc, self.service, self.reader = sc, service, reader
        ranks = registrations(sc.prefill, "P", Role.PREFILL, PREFILL_ADDR)
        ranks += registrations(sc.decode, "D", Role.DECODE, DECODE_ADDR)
        self.leases = [
            service.register_rank(convert.registration_from_proto(r)).lease_id for r in ranks
        ]
        self.transfers = 0

    def calls(self) -> list[Callable[[], object]]:
        """One cycle's calls, in order (each plan's report asks for its plan first)."""
        service, request, plans = self.service, self.sc.request, []
        transfer_id, lease = f"t{self.transfers}", self.leases[self.transfers % len(self.leases)]
        self.transfers += 1

        def plan(rank: int) -> None:
            query = PlanQuery(transfer_id, "D", rank, request.decode_block_ids)
            plans.append(service.get_plan(query))

        def report(rank: int) -> None:
            service.report(Report(plans[rank].plan_id, "D", rank, ReportStatus.DONE, 0, 10))

        publication = Publication(transfer_id, "P", request.prefill_block_ids, request.num_tokens)
        return [
            lambda: service.publish(publication),
            lambda: plan(0),
            lambda: plan(1),
            lambda: report(0),
            lambda: report(1),
            lambda: service.keep_alive(lease),
        ]

    def trial(self, cycles: int) -> list[float]:
        """CPU seconds per call of each kind over ``cycles`` cycles."""
        spent = [0.0] * len(CALLS)
        redis_unit.read_replies = self.reader
        for _ in range(cycles):
            for i, call in enumerate(self.calls()):
                before = time.process_time()
                call()
                spent[i] += time.process_time() - before
        return [s / cycles for s in spent]


def redis_store(server: RedisServer, prefix: str, python_parser: bool) -> RedisStateStore:
    """A store on ``server`` whose connections parse replies (and redis-py packs commands) in
    pure Python (``python_parser``), else with ``hiredis``."""
    store = RedisStateStore.from_url(server.url, prefix)
    if python_parser:
        kwargs = store.client.connection_pool.connection_kwargs
        kwargs["parser_class"] = _RESP2Parser  # the RESP3 one where RESP3 is spoken
        kwargs["command_packer"] = PythonRespSerializer(
            6000, Encoder("utf-8", "strict", False).encode
        )
    return store


def commands_per_call(way: Way, client: redis.Redis) -> list[int]:
    """Commands Redis ran for each call of one cycle (the ``INFO`` asking left out)."""
    counts = []
    for call in way.calls():
        before = client.info("stats")["total_commands_processed"]
        call()
        counts.append(client.info("stats")["total_commands_processed"] - before - 1)
    return counts


def replies_alone(way: Way, rounds: int = 2_000, trials: int = 10) -> tuple[int, list[float]]:
    """The first round trip of a later rank's ``GetTransferPlan`` (its reads) sent again
    and again on one of the store's connections, its replies read by the store's
    :func:`~broker.store.redis_link.read_replies` and by :func:`read_each` in turn,
    ``rounds`` a trial: the replies' count, and the lowest CPU seconds per round trip of
    each."""
    sent: list[list[redis_unit.Command]] = []
    pack = redis_unit.pack

    def recording(commands: list[redis_unit.Command]) -> bytes:
        sent.append(commands)
        return pack(commands)

    calls = way.calls()
    for call in calls[:2]:  # published, first ask
        call()
    redis_unit.pack = recording
    try:
        calls[2]()
    finally:
        redis_unit.pack = pack
    packed, count = pack(sent[0]), len(sent[0])
    connection = way.service.store.client.connection_pool.get_connection()  # type: ignore[attr-defined]
    best = [float("inf")] * 2
    for trial in range(trials):
        for i, read in sorted(enumerate((read_replies, read_each)), reverse=trial % 2 == 1):
            before = time.process_time()
            for _ in range(rounds):
                connection.send_packed_command([packed])
                read(connection, count)
            best[i] = min(best[i], (time.process_time() - before) / rounds)
    return count, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cycles", type=int, default=300, help="per trial and way")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    sc = build_scenario(resolve_model(args.model), 2, 2, args.tokens)
    config = ServiceConfig(
        max_transfers=1_000_000, max_transfers_per_engine=1_000_000, default_ttl_ms=3_600_000
    )
    with tempfile.TemporaryDirectory() as directory:
        server = start_redis(Path(directory))
        try:
            parsers = {"Redis, Python parser": True}
            if HIREDIS_AVAILABLE:
                parsers["Redis, hiredis"] = False
                parsers["hiredis, read each"] = False
            ways = {"memory": Way(sc, BrokerService(config=config))}
            for i, (name, python_parser) in enumerate(parsers.items()):
                store = redis_store(server, f"cost{i}:", python_parser)
                reader = read_each if name.endswith("read each") else read_replies
                ways[name] = Way(sc, BrokerService(store, config=config), reader)
            best, redis_cycle = measure(ways, args, server)
            # After the trials: the steady state (each decode rank knows its prefill agents).
            counts = commands_per_call(ways[next(iter(parsers))], redis.Redis.from_url(server.url))
            alone = replies_alone(ways["Redis, hiredis"]) if HIREDIS_AVAILABLE else None
        finally:
            server.stop()
    print(
        f"{args.model} TP2 -> TP2, {args.tokens} tokens; broker CPU us per call, lowest of "
        f"{args.trials} trials of {args.cycles} cycles"
    )
    print(f"{'call':34s}" + "".join(f"{name:>22s}" for name in ways) + "  Redis commands")
    for i, call in enumerate(CALLS):
        memory = best["memory"][i]
        cells = [f"{best[name][i] * 1e6:8.0f} ({best[name][i] / memory:5.2f}x)" for name in ways]
        print(f"{call:34s}" + "".join(f"{c:>22s}" for c in cells) + f"  {counts[i]:14d}")
    print(
        f"{'cycle (broker)':34s}"
        + "".join(f"{sum(best[name]) * 1e6:22.0f}" for name in ways)
        + f"  {sum(counts):14d}"
    )
    if alone is not None:
        count, (at_once, each) = alone
        print(
            f"a later rank's read round trip alone ({count} replies), broker CPU us: read at "
            f"once {at_once * 1e6:.1f}, read each {each * 1e6:.1f} ({at_once / each:.2f}x)"
        )
    print(
        f"{'cycle (redis-server)':34s}{'':22s}"
        + "".join(f"{redis_cycle[name] * 1e6:22.0f}" for name in parsers)
    )


def measure(
    ways: dict[str, Way], args: Any, server: RedisServer
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """The lowest CPU per call of each way, and Redis's lowest CPU per cycle of each Redis way."""
    best: dict[str, list[float]] = {}
    redis_cycle: dict[str, float] = {}
    for way in ways.values():
        way.trial(max(args.cycles // 5, 1))  # caches filled, scripts loaded
    for _ in range(args.trials):
        for name, way in ways.items():
            before = cpu_seconds(server.process.pid)
            per_call = way.trial(args.cycles)
            spent = (cpu_seconds(server.process.pid) - before) / args.cycles
            best[name] = [min(p) for p in zip(best.get(name, per_call), per_call)]
            if name != "memory":
                redis_cycle[name] = min(redis_cycle.get(name, spent), spent)
    return best, redis_cycle


if __name__ == "__main__":
    main()
