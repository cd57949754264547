"""Size limits on everything a client can make the broker hold or compute.

Counts above a limit are refused with RESOURCE_EXHAUSTED naming the field
(:class:`~broker.errors.LimitExceededError`); malformed values (empty ids, zero sizes,
addresses past 2**63) are INVALID_ARGUMENT. The defaults are generous for real models: the
largest presets at TP 1 with 1M tokens need 16 regions, 7 groups, 4 segments per group,
about 2,000 block ids, 4 KB of layout and 32 runs per page per region; a pure-attention model
with 16-token blocks needs 62,500 block ids for 1M tokens; NIXL agent metadata is KBs to a
few MBs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Upper bounds on inbound messages and on the planner's work per request."""

    #: Largest inbound gRPC message, bytes: a registration with the largest metadata, regions
    #: and layout, or a request with the most block ids (10 bytes each at worst), fits. gRPC
    #: refuses a longer one from its length prefix, before reading it.
    max_request_bytes: int = 24 << 20
    #: Characters of an id or name (engine, agent, transfer, plan, lease, tensor, layer,
    #: model fingerprint, dtype).
    max_id_chars: int = 256
    #: Longer free texts (a FAILED report's ``error``, an abort ``reason``) are truncated,
    #: not refused: a failure must always be recordable.
    max_text_chars: int = 4096
    #: Ranks of one engine (``tp_size``).
    max_tp_size: int = 128
    #: Regions (tensors) of one rank, and layers of one group (a layer lives in one region).
    max_regions: int = 4096
    #: KV-cache groups of a layout, and block-id lists of a request.
    max_groups: int = 256
    #: Segments of one group's page.
    max_segments_per_group: int = 64
    #: Dimensions of one segment.
    max_dims: int = 8
    #: Contiguous byte runs the segments of one group split a page (attention: a kernel
    #: block) into; real layouts have one run per segment.
    max_page_runs: int = 1 << 16
    #: Kernel blocks in one attention page (``block_size // kernel_block_size``).
    max_kernel_blocks_per_page: int = 4096
    #: NIXL agent metadata of one rank, bytes.
    max_agent_metadata_bytes: int = 16 << 20
    #: Block ids of one request, all groups together.
    max_block_ids: int = 1 << 20
    #: Entries of ``allowed_decode_engines``.
    max_allowed_decode_engines: int = 256
    #: Transfers one ExtendTransfers call keeps alive.
    max_extended_transfers: int = 1024
    #: Entries of one GetTransferPlans or ReportTransfers call (their block ids together
    #: count against ``max_block_ids``, as one request's do).
    max_batch_entries: int = 1024
    #: Runs one page template may hold, over all regions of its group: layouts whose strides
    #: split a page into more pieces than this are refused when planned.
    max_template_runs: int = 1 << 20
    #: Runs (descriptors before coalescing) of one decode rank's plan.
    max_plan_runs: int = 1 << 24
    #: Bytes of a plan answered by the unary GetTransferPlan; a larger one is refused before
    #: it is handed out, to be asked for with StreamTransferPlan (whose messages carry at
    #: most ``max_plan_chunk_bytes`` of descriptors each). Either bound keeps one answer from
    #: holding the broker's event loop for long.
    max_unary_plan_bytes: int = 16 << 20
    max_plan_chunk_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        fixed = self.max_agent_metadata_bytes + 64 * self.max_regions + (1 << 20)
        if self.max_request_bytes < fixed or self.max_request_bytes < 10 * self.max_block_ids:
            raise ValueError("max_request_bytes cannot carry the largest registration or request")


#: The limits the broker enforces.
LIMITS = Limits()

#: Largest request of a method that carries ids, a reason or an error text, but no layout,
#: metadata or block ids (KeepAlive, ReportTransfer, AbortTransfer, ...), bytes: room for
#: texts many times ``max_text_chars`` long (they are cut to it, not refused).
MAX_SMALL_REQUEST_BYTES = 256 << 10


def max_request_bytes_of(method: str, limits: Limits = LIMITS) -> int:
    """Largest request the Broker method ``method`` accepts: what its largest valid request
    can need, so a small method never parses megabytes."""
    if method == "RegisterRank":  # metadata, regions (< 64 bytes each), layout
        return limits.max_agent_metadata_bytes + 64 * limits.max_regions + (1 << 20)
    if method in ("PublishBlocks", "GetTransferPlan", "StreamTransferPlan"):  # <= 10 B an id
        return 10 * limits.max_block_ids + (1 << 20)
    if method == "ExtendTransfers":  # two ids an entry, <= 4 B a character, 16 B of framing
        per_entry = 2 * 4 * limits.max_id_chars + 16
        return limits.max_extended_transfers * per_entry + MAX_SMALL_REQUEST_BYTES
    if method == "GetTransferPlans":  # block ids as one request's, three ids an entry
        per_entry = 3 * 4 * limits.max_id_chars + 32
        return 10 * limits.max_block_ids + limits.max_batch_entries * per_entry + (1 << 20)
    if method == "ReportTransfers":  # two ids, an error text (cut, not refused) and a
        # traceparent (55 characters) an entry
        per_entry = 2 * 4 * limits.max_id_chars + 4 * limits.max_text_chars + 128
        return limits.max_batch_entries * per_entry + MAX_SMALL_REQUEST_BYTES
    if method == "EngineSession":  # either call's request, a sequence and a traceparent
        calls = ("GetTransferPlans", "ReportTransfers")
        return max(max_request_bytes_of(call, limits) for call in calls) + 1024
    return MAX_SMALL_REQUEST_BYTES
