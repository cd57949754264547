"""Read a planning case (the schema of ``tests/data/testvectors/README.md``) into domain objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.errors import LayoutError
from broker.layout import EngineLayout, GroupKind
from broker.models import (
    AttentionParams,
    MambaParams,
    ModelSpec,
    build_engine_layout,
    with_kv_dtype,
)
from broker.planner import TransferRequest
from broker.presets import model_from_hf_config


@dataclass(frozen=True)
class Case:
    name: str
    model: ModelSpec
    prefill: EngineLayout
    decode: EngineLayout
    request: TransferRequest


def _get(obj: Mapping[str, Any], key: str, where: str) -> Any:
    try:
        return obj[key]
    except (KeyError, TypeError):
        raise LayoutError(f"{where}.{key}" if where else key, "missing") from None


def _positive_int(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = _get(obj, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"{where}.{key}", f"must be a positive integer, got {value!r}")
    return value


def _mamba_params(kind: str, raw: Mapping[str, Any]) -> MambaParams:
    dims = {
        k: v
        for k, v in raw.items()
        if k in MambaParams.__dataclass_fields__
        and k not in ("local_shapes", "conv_kernel", "kind")
    }
    local_shapes = {}
    for tp, shapes in (raw.get("shapes_by_tp") or {}).items():
        where = f"mamba.shapes_by_tp.{tp}"
        proj = (
            shapes.get("conv_local_proj_dims")
            or shapes.get("conv_proj_dims")
            or shapes.get("proj_dims")
        )
        if proj is None and kind == "mamba1" and "conv_shape" in shapes:
            proj = [shapes["conv_shape"][0]]
        ssm = shapes.get("ssm_shape") or shapes.get("ssm")
        if proj is None or ssm is None:
            raise LayoutError(where, "needs conv_local_proj_dims and ssm_shape")
        local_shapes[int(tp)] = (tuple(proj), tuple(ssm))
    try:
        return MambaParams(
            kind=kind,
            conv_kernel=_get(raw, "conv_kernel", "mamba"),
            local_shapes=local_shapes,
            **dims,
        )
    except TypeError as exc:
        raise LayoutError("mamba", str(exc)) from None


def _attention_params(raw: Mapping[str, Any]) -> AttentionParams:
    """``kind`` ``mha`` (default): K and V per head; ``mla``: one latent of ``kv_lora_rank +
    qk_rope_head_dim`` elements per token, held whole by every rank (``deepseek_v4``:
    :func:`deepseek_v4_config`)."""
    kind = raw.get("kind", "mha")
    dtype = raw.get("dtype", "bfloat16")
    if kind == "mla":
        return AttentionParams.mla(
            _positive_int(raw, "kv_lora_rank", "attention"),
            _positive_int(raw, "qk_rope_head_dim", "attention"),
            dtype,
        )
    if kind != "mha":
        raise LayoutError("attention.kind", f"must be mha, mla or deepseek_v4, got {kind!r}")
    return AttentionParams(
        _positive_int(raw, "total_num_kv_heads", "attention"),
        _positive_int(raw, "head_dim", "attention"),
        dtype,
    )


def _sliding_window(group: Mapping[str, Any], where: str) -> int:
    """A group's ``sliding_window`` in tokens; 0 (absent): full attention or Mamba."""
    return _positive_int(group, "sliding_window", where) if "sliding_window" in group else 0


def deepseek_v4_config(attention: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` fields of the DeepSeek-V4 model an ``attention`` of kind
    ``deepseek_v4`` declares: ``head_dim``, ``index_head_dim``, ``sliding_window`` and each
    layer's ``compress_ratios``."""
    ratios = _get(attention, "compress_ratios", "attention")
    if not isinstance(ratios, list) or not ratios:
        raise LayoutError("attention.compress_ratios", "must list each layer's compress ratio")
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": len(ratios),
        "compress_ratios": ratios,
        **{
            key: _get(attention, key, "attention")
            for key in ("head_dim", "index_head_dim", "sliding_window")
        },
    }


def _deepseek_v4_model(
    case: Mapping[str, Any], groups: list[tuple[GroupKind, tuple[str, ...]]], windows: list[int]
) -> ModelSpec:
    """DeepSeek-V4's block-outermost caches (:mod:`broker.row_models`); the case's groups must
    be the ones vLLM forms of them."""
    attention = case["attention"]
    config = deepseek_v4_config(attention)
    try:
        model = model_from_hf_config(config, case.get("name", "case"))
        model = with_kv_dtype(model, attention.get("dtype", "bfloat16"))
    except LayoutError as exc:
        field = "dtype" if exc.field == "kv_dtype" else exc.field
        raise LayoutError(f"attention.{field}", exc.detail) from None
    if (model.groups, model.sliding_windows) != (tuple(groups), tuple(windows)):
        raise LayoutError("groups", "vLLM groups the DeepSeek-V4 caches otherwise")
    return model


def model_from_case(case: Mapping[str, Any]) -> ModelSpec:
    groups, windows = [], []
    for i, group in enumerate(_get(case, "groups", "")):
        kind = _get(group, "type", f"groups[{i}]")
        if kind not in ("attention", "mamba"):
            raise LayoutError(f"groups[{i}].type", f"must be attention or mamba, got {kind!r}")
        groups.append((GroupKind(kind), tuple(_get(group, "layers", f"groups[{i}]"))))
        windows.append(_sliding_window(group, f"groups[{i}]"))
    if not groups:
        raise LayoutError("groups", "at least one group is required")
    if case.get("attention", {}).get("kind") == "deepseek_v4":
        return _deepseek_v4_model(case, groups, windows)
    attention = _attention_params(case["attention"]) if "attention" in case else None
    mamba = None
    if "mamba" in case:
        mamba = _mamba_params(_get(case, "mamba_type", ""), case["mamba"])
    return ModelSpec(
        case.get("name", "case"),
        tuple(groups),
        attention,
        mamba,
        tuple(windows) if any(windows) else (),
    )


def _engine(case: Mapping[str, Any], role: str, model: ModelSpec) -> EngineLayout:
    side = _get(case, role, "")
    block_size = side.get("logical_block_size", case.get("logical_block_size", 0))
    kernel = side.get("kernel_block_size", case.get("kernel_block_size", 0))
    return build_engine_layout(
        model,
        _positive_int(side, "tp", role),
        _positive_int(side, "num_blocks", role),
        block_size,
        kernel,
    )


def load_case(case: Mapping[str, Any]) -> Case:
    """Build both engines and the request; raises :class:`LayoutError` naming the field."""
    model = model_from_case(case)
    request = _get(case, "request", "")
    return Case(
        name=case.get("name", "case"),
        model=model,
        prefill=_engine(case, "prefill", model),
        decode=_engine(case, "decode", model),
        request=TransferRequest.of(
            _positive_int(request, "num_tokens", "request"),
            _get(request, "p_block_ids", "request"),
            _get(request, "d_block_ids", "request"),
        ),
    )


def merge_runs(runs: list[list[int]]) -> list[tuple[int, ...]]:
    """Sort and merge runs that continue each other on both sides (same ranks, regions)."""
    merged: list[tuple[int, ...]] = []
    for run in sorted(map(tuple, runs)):
        if merged:
            prev = merged[-1]
            if (prev[0], prev[1], prev[3], prev[4]) == (run[0], run[1], run[3], run[4]) and (
                prev[2] + prev[6] == run[2] and prev[5] + prev[6] == run[5]
            ):
                merged[-1] = (*prev[:6], prev[6] + run[6])
                continue
        merged.append(run)
    return merged
