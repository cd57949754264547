"""``pdbroker layout``: rank 0's KV-cache page of a model at a TP size, as vLLM 0.33 lays it out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from broker.commands.options import add_cache_options, positive_int
from broker.layout import EngineLayout, GroupLayout, RankLayout, Segment
from broker.models import build_engine_layout, hma_block_size, with_kv_dtype
from broker.presets import model_from_hf_file, preset_names, resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="print rank 0's page layout: groups, segments, padding")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", help=f"a preset ({', '.join(preset_names())}) or a config.json path"
    )
    src.add_argument("--hf-config", type=Path, help="a Hugging Face config.json or its directory")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    add_cache_options(p, "tokens per logical block; 0: vLLM's HMA choice (alignment 16)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model = model_from_hf_file(args.hf_config) if args.hf_config else resolve_model(args.model)
    model = with_kv_dtype(model, args.kv_dtype)
    block_size = args.block_size or hma_block_size(model, args.tp)
    engine = build_engine_layout(model, args.tp, 1, block_size, args.kernel_block_size)
    summary = layout_summary(engine, block_size, args.kernel_block_size or block_size)
    print(json.dumps(summary) if args.json else format_layout(engine, summary))
    return 0


def _mamba_group(rank: RankLayout) -> GroupLayout | None:
    return next((g for g in rank.groups if not g.is_attention), None)


def layout_summary(engine: EngineLayout, block_size: int, kernel_block_size: int) -> dict:
    """Rank 0's page as JSON-ready data; offsets and sizes in bytes from the page start
    (attention: from the kernel block's)."""
    rank = engine.ranks[0]
    out: dict = {
        "model": engine.model,
        "tp": engine.tp_size,
        "rank": rank.tp_rank,
        "regions": rank.num_regions,
        "block_size": block_size,
        "kernel_block_size": kernel_block_size,
        "page_bytes": rank.page_bytes,
        "groups": [{"type": g.kind.value, "layers": list(g.layers)} for g in rank.groups],
        "attention": None,
        "mamba": None,
    }
    attention = next((g for g in rank.groups if g.is_attention), None)
    if attention is not None:
        out["attention"] = {
            "kernel_blocks_per_page": attention.kernel_blocks_per_page,
            "kernel_block_bytes": attention.kernel_block_bytes,
            "segments": [_segment(s) for s in attention.segments],
        }
    mamba = _mamba_group(rank)
    if mamba is not None:
        conv = [[s.offset, s.nbytes] for s in mamba.segments if s.tensor.startswith("conv.")]
        ssm = mamba.segment("ssm")
        out["mamba"] = {
            "conv_segments": conv,
            "ssm_offset": ssm.offset,
            "ssm_bytes": ssm.nbytes,
            "padding_bytes": rank.page_bytes - sum(n for _, n in conv) - ssm.nbytes,
            "segments": [_segment(s) for s in mamba.segments],
        }
    return out


def _segment(s: Segment) -> dict:
    """A segment as the text shows it: rank 0's share ``shard`` (global indices ``[start,
    end)`` of ``global_extent`` along ``shard_axis``; None when replicated)."""
    shard = None
    if s.shard_axis is not None:
        shard = {
            "axis": s.shard_axis,
            "start": s.shard_interval[0],
            "end": s.shard_interval[1],
            "global_extent": s.global_extent,
        }
    return {
        "tensor": s.tensor,
        "offset": s.offset,
        "bytes": s.nbytes,
        "shape": list(s.shape),
        "dtype": s.dtype,
        "shard": shard,
    }


def format_layout(engine: EngineLayout, summary: dict) -> str:
    rank = engine.ranks[0]
    lines = [
        f"model         {engine.model} (tp={engine.tp_size}, rank 0 of {engine.tp_size})",
        (
            f"block size    {summary['block_size']:,} tokens, kernel block "
            f"{summary['kernel_block_size']:,} tokens"
        ),
        f"page bytes    {rank.page_bytes:,} (regions: {rank.num_regions})",
        "",
        "groups",
    ]
    for g, group in enumerate(rank.groups):
        lines.append(
            f"  {g:>3} {group.kind.value:<9} {len(group.layers):>3} layers: "
            f"{', '.join(group.layers)}"
        )
    attention = next((g for g in rank.groups if g.is_attention), None)
    if attention is not None and len(attention.segments) == 1:
        (kv,) = attention.segments
        held = (
            f"heads {kv.shard_interval[0]}..{kv.shard_interval[1] - 1} of {kv.global_extent}"
            if kv.shard_axis is not None
            else "whole on every rank"
        )
        lines += [
            "",
            (
                f"attention page: {attention.kernel_blocks_per_page} kernel block(s) of "
                f"{attention.kernel_block_bytes:,} bytes, each {kv.tensor} {kv.shape} "
                f"{kv.dtype} ({held})"
            ),
        ]
    elif attention is not None:  # block rows: each group's layers' pages side by side
        lines += ["", f"block rows of {rank.page_bytes:,} bytes, every page whole on every rank"]
        for g, group in enumerate(rank.groups):
            used = sum(s.nbytes for s in group.segments)
            lines.append(
                f"  {g:>3} {group.block_size:>5}-token blocks, window "
                f"{group.sliding_window or '-':>5}: {len(group.segments):>3} layer pages, "
                f"{used:,} bytes per block (the rest of the row never transferred)"
            )
    mamba = _mamba_group(rank)
    if mamba is not None:
        lines += [
            "",
            "mamba page",
            f"  {'offset':>12} {'bytes':>12}  {'tensor':<8} {'shape':<16} dtype",
        ]
        for s in mamba.segments:
            lines.append(
                f"  {s.offset:>12,} {s.nbytes:>12,}  {s.tensor:<8} {s.shape!s:<16} {s.dtype}"
            )
        padding = summary["mamba"]["padding_bytes"]
        lines.append(
            f"  {rank.page_bytes - padding:>12,} {padding:>12,}  padding (never transferred)"
        )
    return "\n".join(lines)
