"""Declarative description of what lives in an engine's KV-cache pages.

An engine has ``tp_size`` ranks. Every rank registers ``num_regions`` regions (tensors) of
``num_blocks`` pages of ``page_bytes`` each; region *i* holds layer *i* of every KV-cache
group (vLLM's hybrid allocator shares one tensor between groups), so the same page is read
through the view of whichever group its block id was allocated to.

A group's view of a page is a tuple of :class:`Segment`: pieces of *global* tensors (``kv``,
``conv.x``, ``ssm`` ...) with their local shape, byte strides, TP-sharded axis and, for
attention, the token axis. Attention pages hold ``block_size // kernel_block_size`` kernel
blocks of ``kernel_block_bytes``; their segment offsets are relative to a kernel block.
Nothing here does I/O; everything is frozen and validated on construction.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from broker.errors import LayoutError, LimitExceededError
from broker.limits import LIMITS

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes(dtype: str, field_name: str = "dtype") -> int:
    """Bytes per element of ``dtype`` (accepts ``torch.bfloat16``-style names)."""
    name = dtype.removeprefix("torch.")
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise LayoutError(field_name, f"unknown dtype {dtype!r}") from None


class GroupKind(str, Enum):
    ATTENTION = "attention"
    MAMBA = "mamba"


@dataclass(frozen=True)
class Segment:
    """One rank's piece of one global tensor, as laid out inside a page (or kernel block).

    ``offset`` and ``strides`` are in bytes; ``shape`` in elements. Along ``shard_axis`` the
    rank holds global indices ``shard_start .. shard_start + shape[shard_axis]`` of
    ``global_extent``; other axes are whole. Without a ``shard_axis`` the segment is
    replicated: every rank holds the whole tensor (MLA's latent), so one rank is enough to
    read it from. ``token_axis`` indexes tokens within the kernel block (attention only);
    each index along it holds ``tokens_per_entry`` consecutive tokens (a compressed cache
    keeps one state per that many tokens), so it has ``kernel_block_size / tokens_per_entry``
    entries.
    """

    tensor: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    shard_axis: int | None = None
    shard_start: int = 0
    global_extent: int = 0
    token_axis: int | None = None
    tokens_per_entry: int = 1

    def __post_init__(self) -> None:
        where = f"segment {self.tensor!r}"
        if self.tokens_per_entry < 1 or (self.tokens_per_entry > 1 and self.token_axis is None):
            raise LayoutError(
                f"{where}.tokens_per_entry",
                f"{self.tokens_per_entry}: must be 1, or more on a segment with a token axis",
            )
        if len(self.shape) != len(self.strides) or not self.shape:
            raise LayoutError(f"{where}.strides", "shape and strides must have the same rank")
        if any(n <= 0 for n in self.shape):
            raise LayoutError(f"{where}.shape", f"dimensions must be positive, got {self.shape}")
        if any(s <= 0 for s in self.strides):
            raise LayoutError(f"{where}.strides", f"strides must be positive, got {self.strides}")
        if self.offset < 0:
            raise LayoutError(f"{where}.offset", "must be >= 0")
        dtype_bytes(self.dtype, f"{where}.dtype")
        for axis_field in ("shard_axis", "token_axis"):
            axis = getattr(self, axis_field)
            if axis is not None and not 0 <= axis < len(self.shape):
                raise LayoutError(f"{where}.{axis_field}", f"axis {axis} out of range")
        if self.shard_axis is None:
            if self.shard_start or self.global_extent:
                raise LayoutError(
                    f"{where}.shard_start",
                    "a replicated segment (no shard_axis) holds the whole tensor: "
                    "shard_start and global_extent must be 0",
                )
        else:
            if self.shard_axis == self.token_axis:
                raise LayoutError(f"{where}.shard_axis", "cannot also be the token axis")
            local = self.shape[self.shard_axis]
            if not 0 <= self.shard_start <= self.global_extent - local:
                raise LayoutError(
                    f"{where}.shard_start",
                    f"local slice [{self.shard_start}, {self.shard_start + local}) "
                    f"outside global extent {self.global_extent}",
                )

    @property
    def itemsize(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of state this segment holds (excluding any gaps between strided elements)."""
        return math.prod(self.shape) * self.itemsize

    @property
    def end(self) -> int:
        """One past the last byte addressed, relative to the page (or kernel block)."""
        return (
            self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + self.itemsize
        )

    @property
    def num_runs(self) -> int:
        """Contiguous byte runs its elements form (trailing axes that continue each other
        fold into one run)."""
        return math.prod(self.shape[: self._fold()[0]])

    def runs(self) -> tuple[np.ndarray, int]:
        """Start offsets (bytes from the page or kernel block start) of its contiguous runs,
        in element order, and their common length."""
        outer, length = self._fold()
        starts = np.array([self.offset], dtype=np.int64)
        for n, stride in zip(self.shape[:outer], self.strides[:outer]):
            if n > 1:  # a stride of a length-1 axis is never taken
                starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
        return starts, length

    def _fold(self) -> tuple[int, int]:
        """``(outer axes, run bytes)``: the trailing axes from ``outer`` on make one run."""
        length, outer = self.itemsize, len(self.shape)
        while outer and (self.shape[outer - 1] == 1 or self.strides[outer - 1] == length):
            length *= self.shape[outer - 1]
            outer -= 1
        return outer, length

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the global tensor, token axis left at the local kernel-block length."""
        if self.shard_axis is None:
            return self.shape
        return tuple(
            self.global_extent if axis == self.shard_axis else n
            for axis, n in enumerate(self.shape)
        )

    @property
    def shard_interval(self) -> tuple[int, int]:
        """Global ``[start, stop)`` held along the shard axis (``(0, 1)`` if unsharded)."""
        if self.shard_axis is None:
            return (0, 1)
        return (self.shard_start, self.shard_start + self.shape[self.shard_axis])


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a sliding-window group's lists keep (0: a full-attention group keeps all), as
    vLLM's NIXL connector computes them: the window's blocks plus one, as the window need not
    start at a block boundary."""
    return -(-sliding_window // block_size) + 1 if sliding_window else 0


def window_tail(block_ids: list[int], sliding_window: int, block_size: int) -> list[int]:
    """The blocks of ``block_ids`` (a group's, in request order) that a sliding-window group
    moves: its last :func:`window_blocks`; a full-attention group's whole list."""
    keep = window_blocks(sliding_window, block_size)
    return block_ids[-keep:] if keep else block_ids


def tail_start(num_tokens: int, num_blocks: int, block_size: int) -> int:
    """First token a list of a request's last ``num_blocks`` blocks holds (0 when it holds
    the request's first block: a longer list holds blocks past its tokens)."""
    return max(0, -(-num_tokens // block_size) - num_blocks) * block_size


def attention_shortfall(group: GroupLayout, num_tokens: int, num_blocks: int) -> str | None:
    """Why a list of ``num_blocks`` of ``group``'s blocks cannot hold what a request of
    ``num_tokens`` needs (every token; a sliding-window group: those in the window of token
    ``num_tokens``, by which vLLM sizes both engines' tables), or None when it can."""
    held = tail_start(num_tokens, num_blocks, group.block_size)
    if not group.sliding_window:
        if held:
            return (
                f"{num_blocks} blocks of {group.block_size} tokens cannot hold "
                f"num_tokens={num_tokens}"
            )
        return None
    needed = max(0, num_tokens - group.sliding_window + 1)
    if held > needed:
        return (
            f"{num_blocks} blocks of {group.block_size} tokens hold tokens from {held} on, "
            f"but the {group.sliding_window}-token window of num_tokens={num_tokens} "
            f"starts at token {needed}"
        )
    return None


def contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group's view of a page: its layers (one per region) and segments.

    Attention groups set ``block_size`` (tokens per logical page), ``kernel_block_size``
    (tokens per kernel block) and ``kernel_block_bytes`` (stride between kernel blocks);
    their segment offsets are relative to the kernel block. Mamba groups leave them 0: one
    block is one indivisible state snapshot.

    ``sliding_window`` (tokens; 0 = full attention) declares a sliding-window attention group:
    its block lists hold only the request's last blocks (:func:`window_blocks` of them, as
    vLLM's NIXL connector clips them), which must reach back to the window's first token.
    """

    kind: GroupKind
    layers: tuple[str, ...]
    segments: tuple[Segment, ...]
    block_size: int = 0
    kernel_block_size: int = 0
    kernel_block_bytes: int = 0
    sliding_window: int = 0

    @property
    def is_attention(self) -> bool:
        return self.kind is GroupKind.ATTENTION

    @property
    def kernel_blocks_per_page(self) -> int:
        return self.block_size // self.kernel_block_size if self.is_attention else 1

    @property
    def state_bytes(self) -> int:
        """Bytes of real state in one page (attention: all kernel blocks), padding excluded."""
        return sum(s.nbytes for s in self.segments) * self.kernel_blocks_per_page

    def segment(self, tensor: str) -> Segment:
        for seg in self.segments:
            if seg.tensor == tensor:
                return seg
        raise KeyError(tensor)


@dataclass(frozen=True)
class RankLayout:
    """Everything one TP rank declares about its KV cache."""

    tp_rank: int
    num_regions: int
    num_blocks: int
    page_bytes: int
    groups: tuple[GroupLayout, ...]

    def __post_init__(self) -> None:
        where = f"ranks[{self.tp_rank}]"
        for name in ("num_regions", "num_blocks", "page_bytes"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{where}.{name}", "must be positive")
        if self.region_bytes >= 1 << 63:
            raise LayoutError(f"{where}.page_bytes", "num_blocks * page_bytes reaches 2**63")
        if not self.groups:
            raise LayoutError(f"{where}.groups", "at least one KV-cache group is required")
        for g, group in enumerate(self.groups):
            gwhere = f"{where}.groups[{g}]"
            if not group.layers or len(group.layers) > self.num_regions:
                raise LayoutError(
                    f"{gwhere}.layers",
                    f"{len(group.layers)} layers do not fit {self.num_regions} regions",
                )
            if not group.segments:
                raise LayoutError(f"{gwhere}.segments", "a group needs at least one segment")
            if len({s.tensor for s in group.segments}) != len(group.segments):
                raise LayoutError(f"{gwhere}.segments", "tensor names must be unique")
            if group.is_attention:
                self._check_attention(group, gwhere)
            else:
                if group.sliding_window:
                    raise LayoutError(f"{gwhere}.sliding_window", "mamba groups have no window")
                for seg in group.segments:
                    if seg.token_axis is not None:
                        raise LayoutError(f"{gwhere}.segments", "mamba segments have no token axis")
                    if seg.end > self.page_bytes:
                        raise LayoutError(
                            f"{gwhere}.segments[{seg.tensor!r}]",
                            f"ends at byte {seg.end}, past page_bytes {self.page_bytes}",
                        )
            _check_disjoint(group, gwhere)

    def _check_attention(self, group: GroupLayout, gwhere: str) -> None:
        if group.sliding_window < 0:
            raise LayoutError(f"{gwhere}.sliding_window", "must be >= 0")
        if group.block_size <= 0 or group.kernel_block_size <= 0:
            raise LayoutError(f"{gwhere}.block_size", "attention groups need positive block sizes")
        if group.block_size % group.kernel_block_size:
            raise LayoutError(
                f"{gwhere}.kernel_block_size",
                f"{group.kernel_block_size} does not divide block_size {group.block_size}",
            )
        if group.kernel_block_bytes * group.kernel_blocks_per_page > self.page_bytes:
            raise LayoutError(
                f"{gwhere}.kernel_block_bytes",
                f"{group.kernel_blocks_per_page} kernel blocks of {group.kernel_block_bytes} "
                f"bytes exceed page_bytes {self.page_bytes}",
            )
        for seg in group.segments:
            if (
                seg.token_axis is None
                or seg.shape[seg.token_axis] * seg.tokens_per_entry != group.kernel_block_size
            ):
                raise LayoutError(
                    f"{gwhere}.segments[{seg.tensor!r}].token_axis",
                    f"needs a token axis of kernel_block_size={group.kernel_block_size} tokens "
                    f"(entries of tokens_per_entry={seg.tokens_per_entry} tokens)",
                )
            if seg.end > group.kernel_block_bytes:
                raise LayoutError(
                    f"{gwhere}.segments[{seg.tensor!r}]",
                    f"ends at byte {seg.end}, past kernel_block_bytes {group.kernel_block_bytes}",
                )

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.page_bytes


#: Rank layouts held by some registration, by hash (see :func:`shared_layout`).
_IN_USE: weakref.WeakValueDictionary[int, RankLayout] = weakref.WeakValueDictionary()


def shared_layout(layout: RankLayout) -> RankLayout:
    """An equal layout some registration already holds, else ``layout`` (then the one held):
    the ranks of a cluster's engines of one model and TP size declare equal layouts, kept
    once rather than once per rank, so a cluster's records are fewer objects for memory and
    for the garbage collector to walk. A layout is dropped when no registration holds it."""
    key = hash(layout)
    held = _IN_USE.get(key)
    if held is not None and held == layout:
        return held
    if held is None:
        _IN_USE[key] = layout
    return layout


def _check_disjoint(group: GroupLayout, gwhere: str) -> None:
    """No byte of a page (attention: of a kernel block) holds two elements of the group's
    segments, so a plan writes every decode byte at most once. Segments must lie inside the
    page already; at most ``max_page_runs`` contiguous runs are enumerated."""
    counts = [seg.num_runs for seg in group.segments]
    if sum(counts) > LIMITS.max_page_runs:
        raise LimitExceededError(
            f"{gwhere}.segments",
            f"{sum(counts)} contiguous runs per page, at most {LIMITS.max_page_runs}",
        )
    runs = [seg.runs() for seg in group.segments]
    starts = np.concatenate([s for s, _ in runs])
    ends = starts + np.repeat([n for _, n in runs], counts)
    owner = np.repeat(np.arange(len(counts)), counts)
    order = np.argsort(starts, kind="stable")
    clash = np.flatnonzero(starts[order][1:] < ends[order][:-1])
    if clash.size:
        first, second = order[clash[0]], order[clash[0] + 1]
        a, b = (group.segments[owner[i]].tensor for i in (first, second))
        raise LayoutError(
            f"{gwhere}.segments[{b!r}]",
            f"byte {int(starts[second])} also belongs to segment {a!r}"
            if a != b
            else f"its strides put two elements on byte {int(starts[second])}",
        )


def _signature(group: GroupLayout) -> tuple[object, ...]:
    """What every rank of an engine declares alike about a group: the planner reads them
    from rank 0."""
    tensors = sorted(
        (s.tensor, s.dtype, s.shard_axis, s.token_axis, s.tokens_per_entry, s.global_shape)
        for s in group.segments
    )
    return (
        group.kind,
        group.layers,
        group.block_size,
        group.kernel_block_size,
        group.sliding_window,
        tensors,
    )


@dataclass(frozen=True)
class EngineLayout:
    """A whole engine: the model it serves and the layout of each of its TP ranks."""

    model: str
    tp_size: int
    ranks: tuple[RankLayout, ...]
    description: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.tp_size <= 0:
            raise LayoutError("tp_size", "must be positive")
        if len(self.ranks) != self.tp_size:
            raise LayoutError("ranks", f"expected {self.tp_size} ranks, got {len(self.ranks)}")
        for r, rank in enumerate(self.ranks):
            if rank.tp_rank != r:
                raise LayoutError(f"ranks[{r}].tp_rank", f"expected {r}, got {rank.tp_rank}")
        first = self.ranks[0]
        for rank in self.ranks[1:]:
            where = f"ranks[{rank.tp_rank}]"
            for name in ("num_regions", "num_blocks", "page_bytes"):
                mine, theirs = getattr(rank, name), getattr(first, name)
                if mine != theirs:
                    raise LayoutError(f"{where}.{name}", f"{mine}, rank 0 declares {theirs}")
            if [_signature(g) for g in rank.groups] != [_signature(g) for g in first.groups]:
                raise LayoutError(
                    f"{where}.groups",
                    "ranks disagree on the groups (kinds, layers, block sizes, windows, tensors, "
                    "their dtypes, axes or global shapes)",
                )

    @property
    def groups(self) -> tuple[GroupLayout, ...]:
        """Rank 0's groups: kinds, layers, block sizes and tensors are the same on every
        rank."""
        return self.ranks[0].groups
