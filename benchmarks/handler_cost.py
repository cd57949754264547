"""What ``GetTransferPlan`` costs the broker without gRPC: request bytes parsed, the servicer
method, the response serialized, in one process.

A Nemotron-3-Nano TP2 prefill and TP2 decode engine register (fake addresses), ``--transfers``
transfers of ``--tokens`` tokens are published, then every transfer is asked for by both
decode ranks in turn, as in serving: the first ask claims the transfer and plans both ranks,
the second only hands out its plan. Prints the lowest of ``--trials`` mean times per first
and per second ask (each trial on fresh transfers).

    .venv/bin/python benchmarks/handler_cost.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker import convert
from broker.config import ServiceConfig
from broker.presets import resolve_model
from broker.service import BrokerService
from broker.servicer import BrokerServicer
from broker.v1 import broker_pb2 as pb
from broker.wire import Role
from harness.bench_engines import DECODE_ADDR, PREFILL_ADDR, registrations
from harness.scenarios import build_scenario


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--transfers", type=int, default=1500, help="per trial")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()

    sc = build_scenario(resolve_model(args.model), 2, 2, args.tokens)
    total = args.transfers * (args.trials + 1)
    service = BrokerService(config=ServiceConfig(max_transfers=total, default_ttl_ms=3_600_000))
    servicer = BrokerServicer(service)
    for request in registrations(sc.prefill, "P", Role.PREFILL, PREFILL_ADDR) + registrations(
        sc.decode, "D", Role.DECODE, DECODE_ADDR
    ):
        service.register_rank(convert.registration_from_proto(request))
    published = [pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids]
    for i in range(total):
        request = pb.PublishBlocksRequest(
            transfer_id=f"t{i}",
            engine_id="P",
            block_ids=published,
            num_tokens=sc.request.num_tokens,
        )
        service.publish(convert.publication_from_proto(request, ""))
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
    get_plan = BrokerServicer.GetTransferPlan.__wrapped__  # the method inside the handler

    def ask(data: bytes) -> None:
        get_plan(servicer, pb.GetTransferPlanRequest.FromString(data)).SerializeToString()

    best = [float("inf"), float("inf")]
    for trial in range(args.trials + 1):  # trial 0 warms the pair's planner
        batch = range(trial * args.transfers, (trial + 1) * args.transfers)
        spent = [0, 0]
        for i in batch:
            for d in range(2):
                t0 = time.perf_counter_ns()
                ask(asks[d][i])
                spent[d] += time.perf_counter_ns() - t0
        if trial:
            best = [min(b, s / args.transfers / 1e3) for b, s in zip(best, spent)]
    print(
        f"{args.model} {args.tokens} tokens, P TP2 -> D TP2, in-process: first ask "
        f"{best[0]:.1f} us (claims, plans both ranks), second ask {best[1]:.1f} us; "
        f"{(best[0] + best[1]) / 2:.1f} us per call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
