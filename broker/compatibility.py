"""Whether a decode engine can be filled from a prefill engine: the checks a pair of layouts
passes before any plan is made.

Both sides must serve the same model with TP sizes that divide one another, the same KV-cache
groups over the same layers with the same sliding windows, and per group the same tensors with equal dtypes, sharded axes and
global shapes (token extents aside: block sizes may differ). Errors name the offending field.
"""

from __future__ import annotations

from broker.errors import IncompatibleLayoutsError
from broker.layout import EngineLayout, GroupLayout, Segment

#: Layouts name a Mamba conv state's sub-projections ``conv.x``, ``conv.B``, ``conv.Q``, ...
CONV_PREFIX = "conv."


def check_compatible(prefill: EngineLayout, decode: EngineLayout) -> None:
    """Raise :class:`IncompatibleLayoutsError` unless decode can be filled from prefill."""
    if _model_name(prefill.model) != _model_name(decode.model):
        _check_same_model(prefill, decode)
    p_tp, d_tp = prefill.tp_size, decode.tp_size
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise IncompatibleLayoutsError(
            "tp_size", f"prefill tp={p_tp} and decode tp={d_tp}: one must divide the other"
        )
    if len(prefill.groups) != len(decode.groups):
        raise IncompatibleLayoutsError(
            "groups",
            f"prefill has {len(prefill.groups)} KV-cache groups, decode {len(decode.groups)}",
        )
    # Layers first: a layer on one side only (e.g. a speculative drafter's) is the cause to
    # name, and it also changes the region count.
    for g, (pg, dg) in enumerate(zip(prefill.groups, decode.groups)):
        where = f"groups[{g}]"
        if pg.kind != dg.kind:
            raise IncompatibleLayoutsError(
                f"{where}.kind", f"prefill {pg.kind.value}, decode {dg.kind.value}"
            )
        if pg.layers != dg.layers:
            raise IncompatibleLayoutsError(f"{where}.layers", _layer_difference(pg, dg))
        if pg.sliding_window != dg.sliding_window:
            raise IncompatibleLayoutsError(
                f"{where}.sliding_window",
                f"prefill {pg.sliding_window} tokens, decode {dg.sliding_window} "
                "(0: full attention); both must serve the same attention windows",
            )
    if prefill.ranks[0].num_regions != decode.ranks[0].num_regions:
        raise IncompatibleLayoutsError(
            "num_regions",
            f"prefill {prefill.ranks[0].num_regions}, decode {decode.ranks[0].num_regions}",
        )
    for g, (pg, dg) in enumerate(zip(prefill.groups, decode.groups)):
        where = f"groups[{g}]"
        p_tensors = {s.tensor: s for s in pg.segments}
        for ds in dg.segments:
            ps = p_tensors.get(ds.tensor)
            swhere = f"{where}.segments[{ds.tensor!r}]"
            if ps is None:
                raise IncompatibleLayoutsError(swhere, "prefill pages have no such tensor")
            _check_segment_pair(swhere, ps, ds)
        extra = set(p_tensors) - {s.tensor for s in dg.segments}
        if extra:
            raise IncompatibleLayoutsError(
                f"{where}.segments", f"decode pages lack {sorted(extra)}"
            )
    # One model name, other state shapes: the structural difference above says what to fix
    # (a speculative drafter, a cache dtype); only if there is none is the digest named.
    _check_same_model(prefill, decode)


def _model_name(fingerprint: str) -> str:
    """The model name part of a ``name:digest`` fingerprint."""
    return fingerprint.rpartition(":")[0] or fingerprint


def _check_same_model(prefill: EngineLayout, decode: EngineLayout) -> None:
    if prefill.model and decode.model and prefill.model != decode.model:
        raise IncompatibleLayoutsError(
            "model", f"prefill serves {prefill.model!r}, decode {decode.model!r}"
        )


def _layer_difference(prefill: GroupLayout, decode: GroupLayout, shown: int = 3) -> str:
    """What differs between two groups' layer lists, naming up to ``shown`` layers a side."""
    only_prefill = [n for n in prefill.layers if n not in set(decode.layers)]
    only_decode = [n for n in decode.layers if n not in set(prefill.layers)]
    if not only_prefill and not only_decode:
        return "prefill and decode list the same layers in another order"
    sides = [
        f"{side} alone has {len(names)} ({', '.join(names[:shown])}"
        f"{', ...' if len(names) > shown else ''})"
        for side, names in (("prefill", only_prefill), ("decode", only_decode))
        if names
    ]
    return "; ".join(sides) + " (speculative decoding on one side only adds its drafter's layers)"


def _check_segment_pair(where: str, ps: Segment, ds: Segment) -> None:
    if ps.dtype != ds.dtype:
        raise IncompatibleLayoutsError(f"{where}.dtype", f"prefill {ps.dtype}, decode {ds.dtype}")
    if (ps.shard_axis, ps.token_axis) != (ds.shard_axis, ds.token_axis):
        raise IncompatibleLayoutsError(
            f"{where}.shard_axis", "prefill and decode shard different axes"
        )
    if ps.tokens_per_entry != ds.tokens_per_entry:
        raise IncompatibleLayoutsError(
            f"{where}.tokens_per_entry",
            f"prefill keeps one entry per {ps.tokens_per_entry} tokens, "
            f"decode per {ds.tokens_per_entry}",
        )
    p_shape, d_shape = list(ps.global_shape), list(ds.global_shape)
    if ds.token_axis is not None:
        p_shape[ds.token_axis] = d_shape[ds.token_axis] = 0
    if p_shape != d_shape:
        hint = (
            " (a conv state keeps kernel width - 1 rows plus one per speculative draft token: "
            "both sides need the same num_speculative_tokens)"
            if ps.tensor.startswith(CONV_PREFIX)
            else ""
        )
        raise IncompatibleLayoutsError(
            f"{where}.shape",
            f"global shapes differ: prefill {ps.global_shape}, decode {ds.global_shape}{hint}",
        )
