"""What ``GetTransferPlan`` costs the broker without gRPC's transport: request bytes parsed,
the method as the server serves it (:mod:`broker.server`'s per-method wrapper), the response
serialized, in one process; side by side, the same with the per-RPC metrics
(``grpc_server_*``, :class:`broker.metrics.MethodMetrics`) counting every call.

A Nemotron-3-Nano TP2 prefill and TP2 decode engine register (fake addresses), ``--transfers``
transfers of ``--tokens`` tokens are published, then every transfer is asked for by both
decode ranks in turn, as in serving: the first ask claims the transfer and plans both ranks,
the second only hands out its plan. Transfers alternate between the plain and the counted
handler, so both share the machine's minute. Prints the lowest of ``--trials`` median times
of first and of second asks of each, their ratio, and what the metrics' bookkeeping costs a call
timed alone.

    .venv/bin/python benchmarks/metrics_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpc import StatusCode

from broker.limits import max_request_bytes_of
from broker.metrics import BrokerMetrics
from broker.presets import resolve_model
from broker.server import SERVICE_NAME, _lenient, _serializer, _served
from broker.servicer import BrokerServicer
from broker.v1 import broker_pb2 as pb
from harness.bench_engines import published_service
from harness.scenarios import build_scenario

MODES = ("plain", "counted")


def bookkeeping_us(iterations: int = 200_000) -> float:
    """Microseconds a call's metrics cost alone (started, handled OK, its time observed):
    the lowest of 5 means of ``iterations`` calls."""
    method = BrokerMetrics().method("unary", SERVICE_NAME, "GetTransferPlan")
    means = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            method.started.inc()
            at = time.perf_counter()
            method.handled(StatusCode.OK, time.perf_counter() - at)
        means.append((time.perf_counter_ns() - t0) / iterations / 1e3)
    return min(means)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--transfers", type=int, default=1500, help="per trial")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()

    sc = build_scenario(resolve_model(args.model), 2, 2, args.tokens)
    total = args.transfers * (args.trials + 1)
    service = published_service(sc, total)
    servicer = BrokerServicer(service)
    decode_ids = [pb.BlockIds(ids=g) for g in sc.request.decode_block_ids]
    asks = [
        [
            pb.GetTransferPlanRequest(
                transfer_id=f"t{i}", engine_id="D", tp_rank=d, block_ids=decode_ids
            ).SerializeToString()
            for i in range(total)
        ]
        for d in range(2)
    ]
    parse = _lenient(pb.GetTransferPlanRequest, max_request_bytes_of("GetTransferPlan"))
    encode = _serializer(pb.GetTransferPlanResponse)
    metrics = BrokerMetrics().method("unary", SERVICE_NAME, "GetTransferPlan")
    handlers: dict[str, Callable[[Any, Any], Awaitable[Any]]] = {
        "plain": _served(servicer.GetTransferPlan, False, None, ""),
        "counted": _served(servicer.GetTransferPlan, False, metrics, ""),
    }

    async def trial(batch: range) -> dict[str, list[float]]:
        """Median microseconds of first and of second asks of each mode over ``batch``."""
        samples: dict[str, tuple[list[int], list[int]]] = {mode: ([], []) for mode in MODES}
        for i in batch:
            mode = MODES[i % 2]
            handler = handlers[mode]
            for d in range(2):
                t0 = time.perf_counter_ns()
                encode(await handler(parse(asks[d][i]), None))  # no context: none is read
                samples[mode][d].append(time.perf_counter_ns() - t0)
        return {m: [statistics.median(ns) / 1e3 for ns in samples[m]] for m in MODES}

    best = {mode: [float("inf"), float("inf")] for mode in MODES}
    for t in range(args.trials + 1):  # trial 0 warms the pair's planner
        medians = asyncio.run(trial(range(t * args.transfers, (t + 1) * args.transfers)))
        if t:
            best = {m: [min(b, x) for b, x in zip(best[m], medians[m])] for m in MODES}
    per_call = {m: sum(best[m]) / 2 for m in MODES}
    print(
        f"{args.model} {args.tokens} tokens, P TP2 -> D TP2, in-process, lowest of {args.trials}:"
    )
    for mode in MODES:
        print(
            f"  {mode:>7}: first ask {best[mode][0]:.1f} us (claims, plans both ranks), "
            f"second ask {best[mode][1]:.1f} us; {per_call[mode]:.1f} us per call"
        )
    print(
        f"  counted / plain: {per_call['counted'] / per_call['plain']:.3f} per call; "
        f"the metrics alone: {bookkeeping_us():.2f} us per call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
