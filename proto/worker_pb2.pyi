from pdserve.proto import generation_pb2 as _generation_pb2
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

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_LOADING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_STANDBY: _ClassVar[WorkerState]

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_UNSPECIFIED: _ClassVar[PrefillMode]
    PREFILL_MODE_LOCAL: _ClassVar[PrefillMode]
    PREFILL_MODE_REMOTE: _ClassVar[PrefillMode]
    PREFILL_MODE_MIGRATE: _ClassVar[PrefillMode]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_LOADING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_STANDBY: WorkerState
PREFILL_MODE_UNSPECIFIED: PrefillMode
PREFILL_MODE_LOCAL: PrefillMode
PREFILL_MODE_REMOTE: PrefillMode
PREFILL_MODE_MIGRATE: PrefillMode

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "mode", "deadline_unix", "output_offset", "resumed_choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RESUMED_CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    mode: PrefillMode
    deadline_unix: float
    output_offset: int
    resumed_choices: _containers.RepeatedCompositeFieldContainer[ResumedChoice]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[PrefillMode, str]] = ..., deadline_unix: _Optional[float] = ..., output_offset: _Optional[int] = ..., resumed_choices: _Optional[_Iterable[_Union[ResumedChoice, _Mapping]]] = ...) -> None: ...

class ResumedChoice(_message.Message):
    __slots__ = ("index", "token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("transfer_ticket", "first_index", "token_ids", "finish_reason", "admitted_unix", "cached_tokens", "logprobs", "prompt_logprobs", "index")
    TRANSFER_TICKET_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    transfer_ticket: bytes
    first_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    admitted_unix: float
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    index: int
    def __init__(self, transfer_ticket: _Optional[bytes] = ..., first_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., admitted_unix: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "transfer_ticket", "deadline_unix", "attach_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TICKET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    ATTACH_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    transfer_ticket: bytes
    deadline_unix: float
    attach_key: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., transfer_ticket: _Optional[bytes] = ..., deadline_unix: _Optional[float] = ..., attach_key: _Optional[str] = ...) -> None: ...

class AttachTicketRequest(_message.Message):
    __slots__ = ("request_id", "transfer_ticket", "attach_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TICKET_FIELD_NUMBER: _ClassVar[int]
    ATTACH_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_ticket: bytes
    attach_key: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_ticket: _Optional[bytes] = ..., attach_key: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "prefill_seconds", "transfer_seconds", "transfer_bytes", "first_token_unix", "cached_tokens", "first_logprobs", "prompt_logprobs", "first_token_ids", "choice_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    first_token_unix: float
    cached_tokens: int
    first_logprobs: _generation_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    choice_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., first_token_unix: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., first_logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., choice_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "model", "dtype", "kv_blocks_total", "block_size", "pid", "metrics_url", "max_running", "context_length", "device", "standby", "quantization", "kv_layout", "tokenizer_digest", "instance", "prefix_cache_salt", "tensor_parallel_size", "rank_pids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_PIDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    address: str
    model: str
    dtype: str
    kv_blocks_total: int
    block_size: int
    pid: int
    metrics_url: str
    max_running: int
    context_length: int
    device: str
    standby: bool
    quantization: str
    kv_layout: str
    tokenizer_digest: str
    instance: str
    prefix_cache_salt: str
    tensor_parallel_size: int
    rank_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., block_size: _Optional[int] = ..., pid: _Optional[int] = ..., metrics_url: _Optional[str] = ..., max_running: _Optional[int] = ..., context_length: _Optional[int] = ..., device: _Optional[str] = ..., standby: _Optional[bool] = ..., quantization: _Optional[str] = ..., kv_layout: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., instance: _Optional[str] = ..., prefix_cache_salt: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., rank_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "state", "running", "queued", "queued_prefill_tokens", "kv_blocks_used", "kv_blocks_total", "kv_blocks_cached", "kv_events", "prefill_tokens_per_s", "standby")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: WorkerState
    running: int
    queued: int
    queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    kv_events: KvEvents
    prefill_tokens_per_s: float
    standby: bool
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., prefill_tokens_per_s: _Optional[float] = ..., standby: _Optional[bool] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("epoch", "seq", "snapshot", "stored", "removed", "stored_parents")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    STORED_PARENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    stored_parents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., stored_parents: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "drain", "standby", "kv_snapshot", "leaving")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    known: bool
    drain: bool
    standby: bool
    kv_snapshot: bool
    leaving: bool
    def __init__(self, known: _Optional[bool] = ..., drain: _Optional[bool] = ..., standby: _Optional[bool] = ..., kv_snapshot: _Optional[bool] = ..., leaving: _Optional[bool] = ...) -> None: ...

class WorkerEntry(_message.Message):
    __slots__ = ("info", "load", "last_heartbeat_unix")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    last_heartbeat_unix: float
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., last_heartbeat_unix: _Optional[float] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("router_address", "workers", "requests_running", "requests_waiting", "metrics_url", "http_url", "streams_moving")
    ROUTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    STREAMS_MOVING_FIELD_NUMBER: _ClassVar[int]
    router_address: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEntry]
    requests_running: int
    requests_waiting: int
    metrics_url: str
    http_url: str
    streams_moving: int
    def __init__(self, router_address: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerEntry, _Mapping]]] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., metrics_url: _Optional[str] = ..., http_url: _Optional[str] = ..., streams_moving: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PromoteWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class PromoteWorkerResponse(_message.Message):
    __slots__ = ("found", "serving")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    found: bool
    serving: bool
    def __init__(self, found: _Optional[bool] = ..., serving: _Optional[bool] = ...) -> None: ...

class SuspendRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SuspendResponse(_message.Message):
    __slots__ = ("output_token_ids", "kv_tokens")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_tokens: int
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("request_id", "transfer_ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_ticket: bytes
    def __init__(self, request_id: _Optional[str] = ..., transfer_ticket: _Optional[bytes] = ...) -> None: ...

class ExportKVResponse(_message.Message):
    __slots__ = ("transfer_bytes", "transfer_seconds")
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_bytes: int
    transfer_seconds: float
    def __init__(self, transfer_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...
