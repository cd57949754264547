"""Whether a decode engine can be filled from a prefill engine: the checks a pair of layouts
passes before any plan is made.

Both sides must serve the same model with TP sizes that divide one another, the same KV-cache
groups over the same layers, and per group the same tensors with equal dtypes, sharded axes and
global shapes (token extents aside: block sizes may differ). Errors name the offending field.
"""

from __future__ import annotations

from broker.errors import IncompatibleLayoutsError
from broker.layout import EngineLayout, Segment


def check_compatible(prefill: EngineLayout, decode: EngineLayout) -> None:
    """Raise :class:`IncompatibleLayoutsError` unless decode can be filled from prefill."""
    if prefill.model and decode.model and prefill.model != decode.model:
        raise IncompatibleLayoutsError(
            "model", f"prefill serves {prefill.model!r}, decode {decode.model!r}"
        )
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
    if prefill.ranks[0].num_regions != decode.ranks[0].num_regions:
        raise IncompatibleLayoutsError(
            "num_regions",
            f"prefill {prefill.ranks[0].num_regions}, decode {decode.ranks[0].num_regions}",
        )
    for g, (pg, dg) in enumerate(zip(prefill.groups, decode.groups)):
        where = f"groups[{g}]"
        if pg.kind != dg.kind:
            raise IncompatibleLayoutsError(
                f"{where}.kind", f"prefill {pg.kind.value}, decode {dg.kind.value}"
            )
        if pg.layers != dg.layers:
            raise IncompatibleLayoutsError(
                f"{where}.layers", "prefill and decode list different layers"
            )
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


def _check_segment_pair(where: str, ps: Segment, ds: Segment) -> None:
    if ps.dtype != ds.dtype:
        raise IncompatibleLayoutsError(f"{where}.dtype", f"prefill {ps.dtype}, decode {ds.dtype}")
    if (ps.shard_axis, ps.token_axis) != (ds.shard_axis, ds.token_axis):
        raise IncompatibleLayoutsError(
            f"{where}.shard_axis", "prefill and decode shard different axes"
        )
    p_shape, d_shape = list(ps.global_shape), list(ds.global_shape)
    if ds.token_axis is not None:
        p_shape[ds.token_axis] = d_shape[ds.token_axis] = 0
    if p_shape != d_shape:
        raise IncompatibleLayoutsError(
            f"{where}.shape",
            f"global shapes differ: prefill {ps.global_shape}, decode {ds.global_shape}",
        )
