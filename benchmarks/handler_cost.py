"""What plans and reports cost the broker without gRPC, unary and batched: request bytes
parsed, the servicer method, the response serialized, in one process; and what checking
each plan costs the decode rank that gets it (``check_each``, as before posting its reads:
a call's plans of each rank at once).

A Nemotron-3-Nano TP2 prefill and TP2 decode engine register (fake addresses) and transfers
of ``--tokens`` tokens are published. Each way then plans every rank of fresh transfers, as
in serving (a transfer's first ask claims it and plans both ranks, the second only hands out
its plan), and reports every plan DONE: ``GetTransferPlan`` and ``ReportTransfer`` one entry
a call, or ``GetTransferPlans`` and ``ReportTransfers`` ``--batch`` entries a call. The ways
alternate trial by trial, each trial on ``--transfers`` fresh transfers; printed: the lowest
of ``--trials`` CPU times per rank-plan and per report, and their ratios, and the lowest
time per plan of the decode ranks' checks (one by one at batch 1).

    .venv/bin/python benchmarks/handler_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.presets import resolve_model
from broker.servicer import BrokerServicer
from broker.v1 import broker_pb2 as pb
from clients.plan_check import check_each
from clients.transport import RegionIndex, fake_memory
from harness.bench_engines import DECODE_ADDR, published_service
from harness.scenarios import build_scenario


class Context:
    """The servicer context a call without gRPC needs: no metadata; an abort raises."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
        raise RuntimeError(f"{code}: {details}")


Plans = list[pb.GetTransferPlanResponse]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=16, help="entries per batched call")
    parser.add_argument("--transfers", type=int, default=400, help="per trial and way")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()

    sc = build_scenario(resolve_model(args.model), 2, 2, args.tokens)
    total = args.transfers * 2 * (args.trials + 1)
    service = published_service(sc, total)
    servicer = BrokerServicer(service)
    decode_ids = [pb.BlockIds(ids=g) for g in sc.request.decode_block_ids]
    context = Context()
    regions = {r: RegionIndex(m) for r, m in fake_memory(sc.decode, DECODE_ADDR).items()}

    def rank_of(plan: pb.GetTransferPlanResponse) -> int:
        return int(plan.plan_id.rsplit("-", 1)[1])

    def entries(first: int) -> list[pb.GetTransferPlanRequest]:
        return [
            pb.GetTransferPlanRequest(
                transfer_id=f"t{i}", engine_id="D", tp_rank=d, block_ids=decode_ids
            )
            for i in range(first, first + args.transfers)
            for d in range(2)
        ]

    def reports(plans: Plans) -> list[pb.ReportTransferRequest]:
        return [
            pb.ReportTransferRequest(
                plan_id=p.plan_id,
                engine_id="D",
                tp_rank=rank_of(p),
                status=pb.REPORT_STATUS_DONE,
                bytes_moved=p.total_bytes,
                duration_us=1000,
            )
            for p in plans
        ]

    async def unary_plans(asks: list[bytes]) -> Plans:
        plans = []
        for data in asks:
            answer = await servicer.GetTransferPlan(
                pb.GetTransferPlanRequest.FromString(data), context
            )
            plans.append(pb.GetTransferPlanResponse.FromString(answer.SerializeToString()))
        return plans

    async def unary_reports(asks: list[bytes]) -> None:
        for data in asks:
            request = pb.ReportTransferRequest.FromString(data)
            (await servicer.ReportTransfer(request, context)).SerializeToString()

    async def batched_plans(asks: list[bytes]) -> Plans:
        plans = []
        for data in asks:
            request = pb.GetTransferPlansRequest.FromString(data)
            answer = await servicer.GetTransferPlans(request, context)
            results = pb.GetTransferPlansResponse.FromString(answer.SerializeToString()).results
            if any(r.code for r in results):
                raise RuntimeError(f"refused: {[r.message for r in results if r.code]}")
            plans += [r.plan for r in results]
        return plans

    async def batched_reports(asks: list[bytes]) -> None:
        for data in asks:
            request = pb.ReportTransfersRequest.FromString(data)
            (await servicer.ReportTransfers(request, context)).SerializeToString()

    def unary_asks(first: int) -> list[bytes]:
        return [e.SerializeToString() for e in entries(first)]

    def batched_asks(first: int) -> list[bytes]:
        es, k = entries(first), args.batch
        return [
            pb.GetTransferPlansRequest(engine_id="D", entries=es[i : i + k]).SerializeToString()
            for i in range(0, len(es), k)
        ]

    def unary_report_asks(plans: Plans) -> list[bytes]:
        return [r.SerializeToString() for r in reports(plans)]

    def batched_report_asks(plans: Plans) -> list[bytes]:
        rs, k = reports(plans), args.batch
        return [
            pb.ReportTransfersRequest(engine_id="D", reports=rs[i : i + k]).SerializeToString()
            for i in range(0, len(rs), k)
        ]

    Way = tuple[
        Callable[[int], list[bytes]],
        Callable[[list[bytes]], Awaitable[Plans]],
        Callable[[Plans], list[bytes]],
        Callable[[list[bytes]], Awaitable[None]],
    ]
    ways: dict[str, Way] = {
        "unary": (unary_asks, unary_plans, unary_report_asks, unary_reports),
        f"batch {args.batch}": (batched_asks, batched_plans, batched_report_asks, batched_reports),
    }

    async def trials() -> dict[str, list[float]]:
        best = {name: [float("inf")] * 3 for name in ways}
        first = 0
        for trial in range(args.trials + 1):  # trial 0 warms the pair's planner up
            for name, (asks, plan, report_asks, report) in ways.items():
                requests = asks(first)
                first += args.transfers
                start = time.process_time()
                plans = await plan(requests)
                planned = time.process_time()
                k = 1 if name == "unary" else args.batch  # a call's plans, each rank's at once
                for i in range(0, len(plans), k):
                    check_each([(p, regions[rank_of(p)], rank_of(p)) for p in plans[i : i + k]])
                checked = time.process_time()
                answers = report_asks(plans)
                reported = time.process_time()
                await report(answers)
                spent = [planned - start, time.process_time() - reported, checked - planned]
                if trial:
                    best[name] = [min(b, s / len(plans) * 1e6) for b, s in zip(best[name], spent)]
        return best

    best = asyncio.run(trials())
    unary = best["unary"]
    print(
        f"{args.model} {args.tokens} tokens, P TP2 -> D TP2, in process, lowest of "
        f"{args.trials} trials, CPU us:"
    )
    for name, (plan_us, report_us, check_us) in best.items():
        print(
            f"  {name:>9}: {plan_us:7.1f} per rank-plan ({unary[0] / plan_us:4.2f}x unary), "
            f"{report_us:6.1f} per report ({unary[1] / report_us:4.2f}x unary); "
            f"decode ranks' checks {check_us:5.1f} per plan"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
