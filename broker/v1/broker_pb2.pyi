from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class GroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_KIND_UNSPECIFIED: _ClassVar[GroupKind]
    GROUP_KIND_ATTENTION: _ClassVar[GroupKind]
    GROUP_KIND_MAMBA: _ClassVar[GroupKind]

class ReportStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPORT_STATUS_UNSPECIFIED: _ClassVar[ReportStatus]
    REPORT_STATUS_DONE: _ClassVar[ReportStatus]
    REPORT_STATUS_FAILED: _ClassVar[ReportStatus]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_COMPLETED: _ClassVar[ReleaseReason]
    RELEASE_REASON_EXPIRED: _ClassVar[ReleaseReason]
    RELEASE_REASON_ABORTED: _ClassVar[ReleaseReason]
    RELEASE_REASON_CONSUMER_FAILED: _ClassVar[ReleaseReason]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_PUBLISHED: _ClassVar[TransferState]
    TRANSFER_STATE_IN_PROGRESS: _ClassVar[TransferState]
    TRANSFER_STATE_COMPLETED: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_EXPIRED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTED: _ClassVar[TransferState]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
GROUP_KIND_UNSPECIFIED: GroupKind
GROUP_KIND_ATTENTION: GroupKind
GROUP_KIND_MAMBA: GroupKind
REPORT_STATUS_UNSPECIFIED: ReportStatus
REPORT_STATUS_DONE: ReportStatus
REPORT_STATUS_FAILED: ReportStatus
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_COMPLETED: ReleaseReason
RELEASE_REASON_EXPIRED: ReleaseReason
RELEASE_REASON_ABORTED: ReleaseReason
RELEASE_REASON_CONSUMER_FAILED: ReleaseReason
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_PUBLISHED: TransferState
TRANSFER_STATE_IN_PROGRESS: TransferState
TRANSFER_STATE_COMPLETED: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_EXPIRED: TransferState
TRANSFER_STATE_ABORTED: TransferState

class Segment(_message.Message):
    __slots__ = ("tensor", "offset", "shape", "strides", "dtype", "shard_axis", "shard_start", "global_extent", "token_axis", "tokens_per_entry")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_AXIS_FIELD_NUMBER: _ClassVar[int]
    SHARD_START_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_EXTENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AXIS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ENTRY_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shard_axis: int
    shard_start: int
    global_extent: int
    token_axis: int
    tokens_per_entry: int
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shard_axis: _Optional[int] = ..., shard_start: _Optional[int] = ..., global_extent: _Optional[int] = ..., token_axis: _Optional[int] = ..., tokens_per_entry: _Optional[int] = ...) -> None: ...

class GroupLayout(_message.Message):
    __slots__ = ("kind", "layers", "segments", "block_size", "kernel_block_size", "kernel_block_bytes", "sliding_window_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: GroupKind
    layers: _containers.RepeatedScalarFieldContainer[str]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    block_size: int
    kernel_block_size: int
    kernel_block_bytes: int
    sliding_window_tokens: int
    def __init__(self, kind: _Optional[_Union[GroupKind, str]] = ..., layers: _Optional[_Iterable[str]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., block_size: _Optional[int] = ..., kernel_block_size: _Optional[int] = ..., kernel_block_bytes: _Optional[int] = ..., sliding_window_tokens: _Optional[int] = ...) -> None: ...

class RankLayout(_message.Message):
    __slots__ = ("num_regions", "num_blocks", "page_bytes", "groups")
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_regions: int
    num_blocks: int
    page_bytes: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupLayout]
    def __init__(self, num_regions: _Optional[int] = ..., num_blocks: _Optional[int] = ..., page_bytes: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupLayout, _Mapping]]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("base_addr", "length_bytes", "device_id", "memory_kind")
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    base_addr: int
    length_bytes: int
    device_id: int
    memory_kind: MemoryKind
    def __init__(self, base_addr: _Optional[int] = ..., length_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRankRequest(_message.Message):
    __slots__ = ("engine_id", "role", "tp_size", "tp_rank", "agent_name", "agent_metadata", "regions", "layout", "model_fingerprint")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: Role
    tp_size: int
    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    layout: RankLayout
    model_fingerprint: str
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., layout: _Optional[_Union[RankLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_ms", "generation", "engine_complete")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: int
    generation: int
    engine_complete: bool
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., generation: _Optional[int] = ..., engine_complete: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "engine_id", "block_ids", "num_tokens", "ttl_ms", "allowed_decode_engines")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_DECODE_ENGINES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    engine_id: str
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    ttl_ms: int
    allowed_decode_engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., allowed_decode_engines: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishBlocksResponse(_message.Message):
    __slots__ = ("expires_at_ms",)
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    expires_at_ms: int
    def __init__(self, expires_at_ms: _Optional[int] = ...) -> None: ...

class GetTransferPlanRequest(_message.Message):
    __slots__ = ("transfer_id", "engine_id", "tp_rank", "block_ids", "want_agent_metadata", "prefill_engine_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    engine_id: str
    tp_rank: int
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    want_agent_metadata: bool
    prefill_engine_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., want_agent_metadata: _Optional[bool] = ..., prefill_engine_id: _Optional[str] = ...) -> None: ...

class SourcePlan(_message.Message):
    __slots__ = ("prefill_rank", "remote_agent_name", "remote_agent_metadata", "local_descriptors", "remote_descriptors", "num_descriptors", "total_bytes", "notification", "local_memory_kind", "remote_memory_kind")
    PREFILL_RANK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    REMOTE_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    REMOTE_MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    prefill_rank: int
    remote_agent_name: str
    remote_agent_metadata: bytes
    local_descriptors: bytes
    remote_descriptors: bytes
    num_descriptors: int
    total_bytes: int
    notification: bytes
    local_memory_kind: MemoryKind
    remote_memory_kind: MemoryKind
    def __init__(self, prefill_rank: _Optional[int] = ..., remote_agent_name: _Optional[str] = ..., remote_agent_metadata: _Optional[bytes] = ..., local_descriptors: _Optional[bytes] = ..., remote_descriptors: _Optional[bytes] = ..., num_descriptors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., notification: _Optional[bytes] = ..., local_memory_kind: _Optional[_Union[MemoryKind, str]] = ..., remote_memory_kind: _Optional[_Union[MemoryKind, str]] = ...) -> None: ...

class GetTransferPlanResponse(_message.Message):
    __slots__ = ("plan_id", "sources", "total_bytes", "num_descriptors", "naive_bytes", "vllm_descriptors", "expires_at_ms", "traceparent")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    NAIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VLLM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    sources: _containers.RepeatedCompositeFieldContainer[SourcePlan]
    total_bytes: int
    num_descriptors: int
    naive_bytes: int
    vllm_descriptors: int
    expires_at_ms: int
    traceparent: str
    def __init__(self, plan_id: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[SourcePlan, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., naive_bytes: _Optional[int] = ..., vllm_descriptors: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ReportTransferRequest(_message.Message):
    __slots__ = ("plan_id", "engine_id", "tp_rank", "status", "bytes_moved", "duration_us", "error", "traceparent")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    engine_id: str
    tp_rank: int
    status: ReportStatus
    bytes_moved: int
    duration_us: int
    error: str
    traceparent: str
    def __init__(self, plan_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., status: _Optional[_Union[ReportStatus, str]] = ..., bytes_moved: _Optional[int] = ..., duration_us: _Optional[int] = ..., error: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ReportTransferResponse(_message.Message):
    __slots__ = ("duplicate", "state", "intact")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INTACT_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    state: TransferState
    intact: bool
    def __init__(self, duplicate: _Optional[bool] = ..., state: _Optional[_Union[TransferState, str]] = ..., intact: _Optional[bool] = ...) -> None: ...

class GetTransferPlansRequest(_message.Message):
    __slots__ = ("engine_id", "entries")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    entries: _containers.RepeatedCompositeFieldContainer[GetTransferPlanRequest]
    def __init__(self, engine_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[GetTransferPlanRequest, _Mapping]]] = ...) -> None: ...

class TransferPlanResult(_message.Message):
    __slots__ = ("code", "message", "plan")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    plan: GetTransferPlanResponse
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., plan: _Optional[_Union[GetTransferPlanResponse, _Mapping]] = ...) -> None: ...

class GetTransferPlansResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TransferPlanResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TransferPlanResult, _Mapping]]] = ...) -> None: ...

class ReportTransfersRequest(_message.Message):
    __slots__ = ("engine_id", "reports")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reports: _containers.RepeatedCompositeFieldContainer[ReportTransferRequest]
    def __init__(self, engine_id: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[ReportTransferRequest, _Mapping]]] = ...) -> None: ...

class TransferReportResult(_message.Message):
    __slots__ = ("code", "message", "outcome")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    outcome: ReportTransferResponse
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., outcome: _Optional[_Union[ReportTransferResponse, _Mapping]] = ...) -> None: ...

class ReportTransfersResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TransferReportResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TransferReportResult, _Mapping]]] = ...) -> None: ...

class EngineSessionRequest(_message.Message):
    __slots__ = ("sequence", "get_transfer_plans", "report_transfers", "traceparent")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GET_TRANSFER_PLANS_FIELD_NUMBER: _ClassVar[int]
    REPORT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    get_transfer_plans: GetTransferPlansRequest
    report_transfers: ReportTransfersRequest
    traceparent: str
    def __init__(self, sequence: _Optional[int] = ..., get_transfer_plans: _Optional[_Union[GetTransferPlansRequest, _Mapping]] = ..., report_transfers: _Optional[_Union[ReportTransfersRequest, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EngineSessionResponse(_message.Message):
    __slots__ = ("sequence", "get_transfer_plans", "report_transfers", "error")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GET_TRANSFER_PLANS_FIELD_NUMBER: _ClassVar[int]
    REPORT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    get_transfer_plans: GetTransferPlansResponse
    report_transfers: ReportTransfersResponse
    error: SessionError
    def __init__(self, sequence: _Optional[int] = ..., get_transfer_plans: _Optional[_Union[GetTransferPlansResponse, _Mapping]] = ..., report_transfers: _Optional[_Union[ReportTransfersResponse, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class WatchReleasesRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "after_sequence", "lease_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    after_sequence: int
    lease_id: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., after_sequence: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseEvent(_message.Message):
    __slots__ = ("sequence", "transfer_id", "block_ids", "reason", "detail", "released_at_ms", "traceparent")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    transfer_id: str
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    reason: ReleaseReason
    detail: str
    released_at_ms: int
    traceparent: str
    def __init__(self, sequence: _Optional[int] = ..., transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ..., detail: _Optional[str] = ..., released_at_ms: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class AbortTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "reason", "prefill_engine_id", "held_by_decode")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_DECODE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    prefill_engine_id: str
    held_by_decode: bool
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., prefill_engine_id: _Optional[str] = ..., held_by_decode: _Optional[bool] = ...) -> None: ...

class AbortTransferResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ...) -> None: ...

class TransferName(_message.Message):
    __slots__ = ("transfer_id", "prefill_engine_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prefill_engine_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., prefill_engine_id: _Optional[str] = ...) -> None: ...

class ExtendTransfersRequest(_message.Message):
    __slots__ = ("engine_id", "transfers")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    transfers: _containers.RepeatedCompositeFieldContainer[TransferName]
    def __init__(self, engine_id: _Optional[str] = ..., transfers: _Optional[_Iterable[_Union[TransferName, _Mapping]]] = ...) -> None: ...

class TransferExtension(_message.Message):
    __slots__ = ("expires_at_ms", "ttl_ms", "code", "message")
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    expires_at_ms: int
    ttl_ms: int
    code: int
    message: str
    def __init__(self, expires_at_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ExtendTransfersResponse(_message.Message):
    __slots__ = ("transfers",)
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferExtension]
    def __init__(self, transfers: _Optional[_Iterable[_Union[TransferExtension, _Mapping]]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("tp_rank", "agent_name", "lease_expires_at_ms", "num_regions", "num_blocks", "page_bytes", "registered_at_ms")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    agent_name: str
    lease_expires_at_ms: int
    num_regions: int
    num_blocks: int
    page_bytes: int
    registered_at_ms: int
    def __init__(self, tp_rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., lease_expires_at_ms: _Optional[int] = ..., num_regions: _Optional[int] = ..., num_blocks: _Optional[int] = ..., page_bytes: _Optional[int] = ..., registered_at_ms: _Optional[int] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "role", "tp_size", "model_fingerprint", "generation", "complete", "ranks")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: Role
    tp_size: int
    model_fingerprint: str
    generation: int
    complete: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., tp_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., generation: _Optional[int] = ..., complete: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "prefill_engine_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prefill_engine_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., prefill_engine_id: _Optional[str] = ...) -> None: ...

class TimelineEvent(_message.Message):
    __slots__ = ("at_ms", "event", "detail")
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    at_ms: int
    event: str
    detail: str
    def __init__(self, at_ms: _Optional[int] = ..., event: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class PlanInfo(_message.Message):
    __slots__ = ("plan_id", "decode_rank", "prefill_ranks", "total_bytes", "num_descriptors", "handed_out", "status", "bytes_moved", "duration_us", "error")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    HANDED_OUT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    decode_rank: int
    prefill_ranks: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    num_descriptors: int
    handed_out: bool
    status: ReportStatus
    bytes_moved: int
    duration_us: int
    error: str
    def __init__(self, plan_id: _Optional[str] = ..., decode_rank: _Optional[int] = ..., prefill_ranks: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., handed_out: _Optional[bool] = ..., status: _Optional[_Union[ReportStatus, str]] = ..., bytes_moved: _Optional[int] = ..., duration_us: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PrefillRankRelease(_message.Message):
    __slots__ = ("tp_rank", "reason", "consumers")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    reason: ReleaseReason
    consumers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tp_rank: _Optional[int] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ..., consumers: _Optional[_Iterable[int]] = ...) -> None: ...

class GetTransferResponse(_message.Message):
    __slots__ = ("transfer_id", "state", "prefill_engine_id", "decode_engine_id", "num_tokens", "block_ids", "published_at_ms", "expires_at_ms", "plans", "releases", "timeline", "finished_at_ms", "traceparent", "now_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    state: TransferState
    prefill_engine_id: str
    decode_engine_id: str
    num_tokens: int
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    published_at_ms: int
    expires_at_ms: int
    plans: _containers.RepeatedCompositeFieldContainer[PlanInfo]
    releases: _containers.RepeatedCompositeFieldContainer[PrefillRankRelease]
    timeline: _containers.RepeatedCompositeFieldContainer[TimelineEvent]
    finished_at_ms: int
    traceparent: str
    now_ms: int
    def __init__(self, transfer_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., prefill_engine_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., published_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., plans: _Optional[_Iterable[_Union[PlanInfo, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[PrefillRankRelease, _Mapping]]] = ..., timeline: _Optional[_Iterable[_Union[TimelineEvent, _Mapping]]] = ..., finished_at_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., now_ms: _Optional[int] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("include_finished", "limit")
    INCLUDE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    include_finished: bool
    limit: int
    def __init__(self, include_finished: _Optional[bool] = ..., limit: _Optional[int] = ...) -> None: ...

class TransferSummary(_message.Message):
    __slots__ = ("transfer_id", "state", "prefill_engine_id", "decode_engine_id", "num_tokens", "published_at_ms", "expires_at_ms", "finished_at_ms", "plans", "plans_reported", "traceparent")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    PLANS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    state: TransferState
    prefill_engine_id: str
    decode_engine_id: str
    num_tokens: int
    published_at_ms: int
    expires_at_ms: int
    finished_at_ms: int
    plans: int
    plans_reported: int
    traceparent: str
    def __init__(self, transfer_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., prefill_engine_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., published_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., finished_at_ms: _Optional[int] = ..., plans: _Optional[int] = ..., plans_reported: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class TransferStateCount(_message.Message):
    __slots__ = ("state", "count")
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    count: int
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ..., count: _Optional[int] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("now_ms", "counts", "transfers")
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    now_ms: int
    counts: _containers.RepeatedCompositeFieldContainer[TransferStateCount]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferSummary]
    def __init__(self, now_ms: _Optional[int] = ..., counts: _Optional[_Iterable[_Union[TransferStateCount, _Mapping]]] = ..., transfers: _Optional[_Iterable[_Union[TransferSummary, _Mapping]]] = ...) -> None: ...
