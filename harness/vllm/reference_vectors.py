"""Reference transfer plans (``tests/data/testvectors``) from vLLM 0.33's own NIXL connector.

For a planning case, every decode rank is built as vLLM's connector worker, with the prefill
ranks it reads (:class:`harness.vllm.nixl_reference.VllmDecodeSide`), on caches shaped as
vLLM allocates them for the case's model (a ``config.json`` made from the case: Mamba2 as
Nemotron-H, MLA as DeepSeek-V2, sliding windows as gpt-oss, GDN state beside MLA as
Kimi-Linear, DeepSeek-V4 as DeepSeek-V4-Flash). The descriptors vLLM posts for the request are located in
the cache tensors of both sides and normalised as the vectors' README says: what carries no
state is dropped, the rest becomes maximal runs relative to region bases.

    python -m harness.vllm.reference_vectors CASE.json [CASE.json ...] --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from broker.errors import LayoutError
from broker.layout import RankLayout, window_blocks
from broker.planner import TransferRequest
from broker.presets import PRESET_CONFIGS, model_from_hf_config
from harness.cases import Case, deepseek_v4_config, load_case, merge_runs
from harness.scenarios import Scenario
from harness.vllm.nixl_reference import VllmDecodeSide

#: The block vLLM's allocator puts in place of blocks it freed (``BlockPool.null_block``).
_NULL_BLOCK = 0
#: Nemotron-H ``hybrid_override_pattern`` code of each case layer type.
_NEMOTRON_CODES = {"mamba": "M", "attention": "*"}
_KINDS = tuple(_NEMOTRON_CODES)


def _layer_indices(case: Mapping[str, Any]) -> dict[int, str]:
    """Each case layer's model index and type (names ``model.layers.N...``)."""
    return {int(layer["name"].split(".")[2]): layer["type"] for layer in case["layers"]}


def _nemotron_h(case: Mapping[str, Any]) -> dict[str, Any]:
    attn, mamba = case["attention"], case["mamba"]
    layers = _layer_indices(case)
    pattern = "".join(
        _NEMOTRON_CODES[layers[i]] if i in layers else "-" for i in range(max(layers) + 1)
    )
    if mamba["intermediate_size"] != mamba["num_heads"] * mamba["head_dim"]:
        raise LayoutError("mamba.intermediate_size", "Nemotron-H needs num_heads * head_dim")
    return {
        **PRESET_CONFIGS["nemotron-h-8b"],
        "torch_dtype": mamba["conv_dtype"],
        "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "num_key_value_heads": attn["total_num_kv_heads"],
        "attention_head_dim": attn["head_dim"],
        "mamba_num_heads": mamba["num_heads"],
        "mamba_head_dim": mamba["head_dim"],
        "n_groups": mamba["n_groups"],
        "ssm_state_size": mamba["state_size"],
        "conv_kernel": mamba["conv_kernel"],
        "mamba_ssm_cache_dtype": mamba["ssm_dtype"],
    }


def _deepseek_v2(case: Mapping[str, Any]) -> dict[str, Any]:
    attn = case["attention"]
    return {
        **PRESET_CONFIGS["deepseek-v2-lite"],
        "torch_dtype": attn.get("dtype", "bfloat16"),
        "num_hidden_layers": max(_layer_indices(case)) + 1,
        "kv_lora_rank": attn["kv_lora_rank"],
        "qk_rope_head_dim": attn["qk_rope_head_dim"],
    }


def _gpt_oss(case: Mapping[str, Any]) -> dict[str, Any]:
    attn = case["attention"]
    (window,) = {g["sliding_window"] for g in case["groups"] if "sliding_window" in g}
    return {
        **PRESET_CONFIGS["gpt-oss-20b"],
        "torch_dtype": attn.get("dtype", "bfloat16"),
        "num_hidden_layers": max(_layer_indices(case)) + 1,
        "num_key_value_heads": attn["total_num_kv_heads"],
        "head_dim": attn["head_dim"],
        "sliding_window": window,
    }


def _kimi_linear(case: Mapping[str, Any]) -> dict[str, Any]:
    attn, kda = case["attention"], case["mamba"]
    if (kda["num_k_heads"], kda["head_k_dim"]) != (kda["num_v_heads"], kda["head_v_dim"]):
        raise LayoutError("mamba", "KDA has as many K as V heads, of one head dim")
    if kda["ssm_dtype"] != "float32" or kda["conv_dtype"] != attn.get("dtype", "bfloat16"):
        raise LayoutError("mamba.ssm_dtype", "KDA keeps float32 state, convs in the model dtype")
    layers = _layer_indices(case)
    numbers = {kind: [i + 1 for i, t in sorted(layers.items()) if t == kind] for kind in _KINDS}
    return {
        **PRESET_CONFIGS["kimi-linear-48b-a3b"],
        "torch_dtype": kda["conv_dtype"],
        "num_hidden_layers": max(layers) + 1,
        "kv_lora_rank": attn["kv_lora_rank"],
        "qk_rope_head_dim": attn["qk_rope_head_dim"],
        "linear_attn_config": {
            "full_attn_layers": numbers["attention"],
            "kda_layers": numbers["mamba"],
            "head_dim": kda["head_k_dim"],
            "num_heads": kda["num_k_heads"],
            "short_conv_kernel_size": kda["conv_kernel"],
        },
    }


def _deepseek_v4(case: Mapping[str, Any]) -> dict[str, Any]:
    return {**PRESET_CONFIGS["deepseek-v4-flash"], **deepseek_v4_config(case["attention"])}


def _cache_dtype(case: Mapping[str, Any]) -> str:
    """vLLM's ``--kv-cache-dtype`` for the case: a DeepSeek-V4 case's ``attention.dtype``
    (its cache dtype is not the model's); other families' caches are in the model dtype."""
    attention = case.get("attention", {})
    if attention.get("kind") == "deepseek_v4":
        dtype = attention.get("dtype", "bfloat16")
        return "auto" if dtype == "bfloat16" else str(dtype)
    return "auto"


def hf_config(case: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json`` of a model vLLM forms the case's layers and groups from: Mamba2 as
    Nemotron-H, MLA as DeepSeek-V2, sliding-window attention as gpt-oss, GDN state with MLA
    as Kimi-Linear (its KDA layers), DeepSeek-V4 as DeepSeek-V4-Flash with the case's layers
    (in the case's cache dtype); other families raise :class:`LayoutError`."""
    windowed = any("sliding_window" in g for g in case["groups"])
    kind = case.get("attention", {}).get("kind")
    mla = kind == "mla"
    if kind == "deepseek_v4":
        config = _deepseek_v4(case)
    elif mla and "mamba" not in case:
        config = _deepseek_v2(case)
    elif mla and case.get("mamba_type") == "gdn" and "shapes_by_tp" not in case["mamba"]:
        config = _kimi_linear(case)
    elif windowed and "mamba" not in case:
        config = _gpt_oss(case)
    elif case.get("mamba_type") == "mamba2" and "shapes_by_tp" not in case["mamba"]:
        config = _nemotron_h(case)
    else:
        raise LayoutError(
            "mamba_type",
            "reference plans are made for Mamba2, MLA, sliding-window, Kimi-Linear and "
            "DeepSeek-V4 cases",
        )
    built = model_from_hf_config(config, "case")
    wanted = tuple(
        (g["type"], tuple(g["layers"]), g.get("sliding_window", 0)) for g in case["groups"]
    )
    got = tuple(
        (kind.value, names, built.sliding_window(g)) for g, (kind, names) in enumerate(built.groups)
    )
    if got != wanted:
        raise LayoutError("groups", "vLLM groups the case's layers otherwise")
    return config


#: A region vLLM registered: base address, bytes, the layers whose cache it holds.
Region = tuple[int, int, set[str]]


def _locate(regions: Sequence[Region], addr: int, length: int) -> tuple[int, int]:
    """(region, offset) of ``length`` bytes at ``addr`` inside one of ``regions``."""
    for region, (base, size, _) in enumerate(regions):
        if base <= addr and addr + length <= base + size:
            return region, addr - base
    raise RuntimeError(f"vLLM reads {length} bytes at {addr:#x}, outside every region")


def _carries_state(side: VllmDecodeSide, region: Region, offset: int) -> bool:
    """Whether the decode bytes at ``offset`` of ``region`` hold request state: a block of a
    group with a layer in that region, and for attention a kernel block with a token below
    the request's length (sliding window: and one from the window's first token on, the
    first that vLLM's ``get_num_skipped_tokens`` keeps)."""
    engine, request = side.decode_engine, side.sc.request
    page = region[1] // engine.kv_config.num_blocks
    block = offset // page
    group = next(g for g, ids in enumerate(request.decode_block_ids) if block in ids)
    if not region[2] & set(engine.kv_config.kv_cache_groups[group].layer_names):
        return False
    if not side.sc.decode.groups[group].is_attention:
        return True
    ids = request.decode_block_ids[group]
    logical = side.sc.decode.groups[group].block_size
    ratio = side.worker._physical_blocks_per_logical_kv_block
    first = -(-request.num_tokens // logical) - len(ids)
    kernel = (offset % page) // (page // ratio)
    start = ((first + ids.index(block)) * ratio + kernel) * (logical // ratio)
    window = side.sc.decode.groups[group].sliding_window
    in_window = not window or start + logical // ratio > request.num_tokens - window + 1
    return start < request.num_tokens and in_window


def _row_content(rank: RankLayout, request: TransferRequest, run: list[int]) -> list[list[int]]:
    """The bytes of a read of one block row (``run``) that the block's group's layers'
    pages hold: vLLM's connector reads whole rows, alignment padding and the row's tail
    (other groups' pages are wider) included, which carry no state."""
    d, d_region, d_offset, p, p_region, p_offset, length = run
    row = rank.page_bytes
    block = d_offset // row
    if (d_offset + length - 1) // row != block:
        raise RuntimeError(f"vLLM reads {length} bytes at {d_offset} across block rows")
    group = next(g for g, ids in enumerate(request.decode_block_ids) if block in ids)
    content = []
    for segment in rank.groups[group].segments:
        start = block * row + segment.offset
        lo, hi = max(start, d_offset), min(start + segment.nbytes, d_offset + length)
        if lo < hi:
            content.append([d, d_region, lo, p, p_region, p_offset + lo - d_offset, hi - lo])
    return content


def _vllm_request(loaded: Case) -> TransferRequest:
    """The request as vLLM's schedulers hand it to its worker: a sliding-window group's
    prefill list is the tail of the prefill block table, where vLLM has put its null block
    (id 0) in place of the blocks it freed as out of window; the case lists them without it
    (as :func:`clients.vllm.scheduler._clip_group` hands them over)."""
    request = loaded.request
    prefill = []
    for group, ids in zip(loaded.prefill.groups, request.prefill_block_ids, strict=True):
        padding = 0
        if group.sliding_window:
            blocks = -(-request.num_tokens // group.block_size)
            kept = min(window_blocks(group.sliding_window, group.block_size), blocks)
            padding = max(0, kept - len(ids))
        prefill.append((_NULL_BLOCK,) * padding + tuple(ids))
    return TransferRequest.of(request.num_tokens, prefill, request.decode_block_ids)


def _region_facts(regions: Sequence[Region], num_blocks: int) -> dict[str, Any]:
    """What one rank registered: its regions and their page sizes."""
    return {
        "num_regions": len(regions),
        "region_page_bytes": [size // num_blocks for _, size, _ in regions],
    }


def reference_plan(case: Mapping[str, Any]) -> dict[str, Any]:
    """The ``expected`` object of ``case`` (README schema), from vLLM's posted descriptors."""
    config, loaded = hf_config(case), load_case(case)
    scenario = Scenario(loaded.model, loaded.prefill, loaded.decode, _vllm_request(loaded))
    attention = [g for g in loaded.decode.groups if g.is_attention]
    # FlashInfer for kernel blocks smaller than a page, as the case's engines use.
    kernel = next((g.kernel_block_size for g in attention if g.kernel_blocks_per_page > 1), 0)
    runs, kept, posted = [], 0, 0
    engines: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    for d in range(loaded.decode.tp_size):
        side = VllmDecodeSide(copy.deepcopy(config), scenario, kernel, d, _cache_dtype(case))
        try:
            reads = side.reads()
            d_regions = side.decode_engine.regions(d)
            p_regions = {p: side.prefill_engine.regions(p) for p in side.prefill_engine.caches}
            for addr, p, remote_addr, length in reads:
                posted += length
                d_region, d_offset = _locate(d_regions, addr, length)
                if not _carries_state(side, d_regions[d_region], d_offset):
                    continue
                kept += 1
                p_region, p_offset = _locate(p_regions[p], remote_addr, length)
                run = [d, d_region, d_offset, p, p_region, p_offset, length]
                if loaded.model.row_caches:
                    runs += _row_content(loaded.decode.ranks[d], loaded.request, run)
                else:
                    runs.append(run)
            engines["decode"][str(d)] = {
                **_region_facts(d_regions, loaded.decode.ranks[d].num_blocks),
                "kernel_block_size": side.worker.block_size,
                "physical_blocks_per_logical": side.worker._physical_blocks_per_logical_kv_block,
            }
            for p, regions in p_regions.items():
                engines["prefill"][str(p)] = _region_facts(
                    regions, loaded.prefill.ranks[p].num_blocks
                )
        finally:
            side.close()
    merged = [list(run) for run in merge_runs(runs)]
    return {
        "case": case.get("name", "case"),
        "status": "ok",
        "runs": merged,
        "total_bytes": sum(run[6] for run in merged),
        "vllm_descriptors": kept,
        "vllm_bytes_incl_unused": posted,
        "engines": engines,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="directory for expected files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.cases:
        expected = reference_plan(json.loads(path.read_text()))
        (args.out / path.name).write_text(json.dumps(expected))


if __name__ == "__main__":
    main()
