"""``pdbroker plan``: the transfer plan of one request, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from broker.errors import LayoutError
from broker.models import with_kv_dtype
from broker.planner import PairPlanner, TransferPlan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="compute the transfer plan of one request")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--case", type=Path, help="a case file (testvectors schema)")
    src.add_argument("--model", help="a preset name or a Hugging Face config.json path")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32768, help="tokens whose state moves")
    p.add_argument("--block-size", type=int, default=0, help="default: vLLM's HMA choice")
    p.add_argument("--kernel-block-size", type=int, default=0, help="default: = block size")
    p.add_argument("--kv-dtype", default=None, help="KV-cache dtype, e.g. bfloat16 or fp8")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.case:
        from harness.cases import load_case

        try:
            raw = json.loads(args.case.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LayoutError("case", f"cannot read {args.case}: {exc}") from None
        case = load_case(raw)
        prefill, decode, request = case.prefill, case.decode, case.request
    else:
        from broker.presets import resolve_model
        from harness.scenarios import build_scenario

        model = with_kv_dtype(resolve_model(args.model), args.kv_dtype)
        sc = build_scenario(
            model,
            args.prefill_tp,
            args.decode_tp,
            args.tokens,
            args.block_size,
            args.kernel_block_size,
        )
        prefill, decode, request = sc.prefill, sc.decode, sc.request
    plan = PairPlanner(prefill, decode).plan(request)
    if args.json:
        print(json.dumps(plan_summary(plan, with_runs=True)))
    else:
        print(format_plan(plan))
    return 0


def plan_summary(plan: TransferPlan, with_runs: bool = False) -> dict:
    """JSON-ready accounting of a plan; ``runs`` use region-relative offsets."""
    out: dict = {
        "total_bytes": plan.nbytes,
        "descriptors": plan.num_descriptors,
        "naive_bytes": plan.naive_bytes,
        "vllm_descriptors": plan.vllm_descriptors,
        "ranks": [
            {
                "decode_rank": r.decode_rank,
                "bytes": r.nbytes,
                "descriptors": r.num_descriptors,
                "naive_bytes": r.naive_bytes,
                "vllm_descriptors": r.vllm_descriptors,
                "sources": [
                    {
                        "prefill_rank": s.prefill_rank,
                        "bytes": s.nbytes,
                        "descriptors": s.num_descriptors,
                    }
                    for s in r.sources
                ],
            }
            for r in plan.ranks
        ],
    }
    if with_runs:
        out["runs"] = plan.rows().tolist()
    return out


def format_plan(plan: TransferPlan) -> str:
    lines = [f"{'decode rank':>11} {'prefill rank':>12} {'descriptors':>11} {'bytes':>14}"]
    for r in plan.ranks:
        for s in r.sources:
            lines.append(
                f"{r.decode_rank:>11} {s.prefill_rank:>12} {s.num_descriptors:>11} {s.nbytes:>14,}"
            )
    saved = plan.naive_bytes - plan.nbytes
    lines += [
        "",
        (
            f"bytes:       {plan.nbytes:,} (naive padded pages {plan.naive_bytes:,}; "
            f"saves {saved:,} = {100 * saved / max(plan.naive_bytes, 1):.1f}%)"
        ),
        (
            f"descriptors: {plan.num_descriptors:,} (vLLM per-block scheme {plan.vllm_descriptors:,}; "
            f"ratio {plan.num_descriptors / max(plan.vllm_descriptors, 1):.3f})"
        ),
    ]
    return "\n".join(lines)
