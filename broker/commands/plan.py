"""``pdbroker plan``: the transfer plan of one request, as a table or JSON.

The request is a case file's, or a fresh one of ``--tokens`` tokens on engines sized to hold
it (block ids from 0, one Mamba state block per group); both outputs state it first.

JSON: ``request`` (model, TP sizes, tokens, block sizes, KV dtype, and per KV-cache group its
kind, layers and the block ids each side gives); ``total_bytes``, ``descriptors``,
``naive_bytes`` (whole padded pages) and ``vllm_descriptors`` (vLLM's per-block scheme), and
the same per decode rank in ``ranks``, with ``sources`` per prefill rank read; ``runs``, one
``[decode_rank, decode_region, decode_offset, prefill_rank, prefill_region, prefill_offset,
length]`` per contiguous read, offsets in bytes from the start of the region, one
descriptor each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from broker.commands.options import add_cache_options, positive_int
from broker.errors import LayoutError
from broker.layout import EngineLayout
from broker.models import with_kv_dtype
from broker.planner import PairPlanner, TransferPlan, TransferRequest


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="compute the transfer plan of one request", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--case", type=Path, help="a case file (the test vectors' schema)")
    src.add_argument("--model", help="a preset name or a Hugging Face config.json path")
    p.add_argument("--prefill-tp", type=positive_int, default=1, help="prefill's TP size")
    p.add_argument("--decode-tp", type=positive_int, default=1, help="decode's TP size")
    p.add_argument("--tokens", type=positive_int, default=32768, help="tokens whose state moves")
    add_cache_options(p, "tokens per block; 0: vLLM's HMA choice (the larger of both sides')")
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
    assumed = request_summary(prefill, decode, request)
    if args.json:
        print(json.dumps({"request": assumed} | plan_summary(plan, with_runs=True)))
    else:
        print(format_request(assumed))
        print()
        print(format_plan(plan))
    return 0


def request_summary(prefill: EngineLayout, decode: EngineLayout, request: TransferRequest) -> dict:
    """The request planned and the engines it moves between, JSON-ready."""
    attention = next((g for g in prefill.groups if g.is_attention), None)
    kv = attention.segments[0] if attention is not None else None
    return {
        "model": prefill.model,
        "prefill_tp": prefill.tp_size,
        "decode_tp": decode.tp_size,
        "tokens": request.num_tokens,
        "block_size": max(g.block_size for g in prefill.groups),
        "kernel_block_size": attention.kernel_block_size if attention is not None else None,
        "kv_dtype": kv.dtype if kv is not None else None,
        "groups": [
            {
                "kind": g.kind.value,
                "layers": len(g.layers),
                "prefill_blocks": len(p_ids),
                "decode_blocks": len(d_ids),
            }
            for g, p_ids, d_ids in zip(
                prefill.groups, request.prefill_block_ids, request.decode_block_ids
            )
        ],
    }


def format_request(r: dict) -> str:
    kinds: dict[tuple[str, int, int], int] = {}
    for g in r["groups"]:
        key = (g["kind"], g["prefill_blocks"], g["decode_blocks"])
        kinds[key] = kinds.get(key, 0) + 1
    blocks = ", ".join(
        f"{n} {kind} group{'s' if n > 1 else ''} {p:,}/{d:,}" for (kind, p, d), n in kinds.items()
    )
    kernel = r["kernel_block_size"]
    return "\n".join(
        [
            (
                f"request:     {r['tokens']:,} tokens of {r['model']}, prefill TP{r['prefill_tp']}"
                f" -> decode TP{r['decode_tp']}"
            ),
            (
                f"blocks:      {r['block_size']:,} tokens"
                + (f", attention kernel blocks of {kernel:,}" if kernel else "")
                + (f", KV cache {r['kv_dtype']}" if r["kv_dtype"] else "")
            ),
            f"block ids:   prefill/decode per group: {blocks}",
        ]
    )


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
                f"{r.decode_rank:>11} {s.prefill_rank:>12} {s.num_descriptors:>11,} {s.nbytes:>14,}"
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
