from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ERROR_UNSPECIFIED: _ClassVar[KVErrorKind]
    KV_ERROR_LAYOUT_MISMATCH: _ClassVar[KVErrorKind]
    KV_ERROR_CHECKSUM: _ClassVar[KVErrorKind]
KV_ERROR_UNSPECIFIED: KVErrorKind
KV_ERROR_LAYOUT_MISMATCH: KVErrorKind
KV_ERROR_CHECKSUM: KVErrorKind

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "kv_cache_dtype", "tensor_parallel_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class KVHandoffDescriptor(_message.Message):
    __slots__ = ("request_id", "transfer_id", "block_hashes", "num_tokens", "num_blocks", "layout", "source_endpoint", "source_worker_id", "transport", "pair_key", "torch_backend", "first_block", "ipc_device", "receiver_tensor_parallel_size", "lane", "lane_sender_rank", "lane_receiver_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PAIR_KEY_FIELD_NUMBER: _ClassVar[int]
    TORCH_BACKEND_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    IPC_DEVICE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    LANE_SENDER_RANK_FIELD_NUMBER: _ClassVar[int]
    LANE_RECEIVER_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    num_blocks: int
    layout: KVLayout
    source_endpoint: str
    source_worker_id: str
    transport: str
    pair_key: str
    torch_backend: str
    first_block: int
    ipc_device: str
    receiver_tensor_parallel_size: int
    lane: bool
    lane_sender_rank: int
    lane_receiver_rank: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., source_endpoint: _Optional[str] = ..., source_worker_id: _Optional[str] = ..., transport: _Optional[str] = ..., pair_key: _Optional[str] = ..., torch_backend: _Optional[str] = ..., first_block: _Optional[int] = ..., ipc_device: _Optional[str] = ..., receiver_tensor_parallel_size: _Optional[int] = ..., lane: _Optional[bool] = ..., lane_sender_rank: _Optional[int] = ..., lane_receiver_rank: _Optional[int] = ...) -> None: ...

class KVBlockChunk(_message.Message):
    __slots__ = ("block_index", "offset", "data", "last", "crc32c", "block_crc32c")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRC32C_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    offset: int
    data: bytes
    last: bool
    crc32c: int
    block_crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., crc32c: _Optional[int] = ..., block_crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class KVTransferMessage(_message.Message):
    __slots__ = ("descriptor", "chunk")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    descriptor: KVHandoffDescriptor
    chunk: KVBlockChunk
    def __init__(self, descriptor: _Optional[_Union[KVHandoffDescriptor, _Mapping]] = ..., chunk: _Optional[_Union[KVBlockChunk, _Mapping]] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("transfer_id", "crc32c", "device_digests", "ipc_buffer")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    IPC_BUFFER_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    device_digests: _containers.RepeatedScalarFieldContainer[int]
    ipc_buffer: KVIpcBuffer
    def __init__(self, transfer_id: _Optional[str] = ..., crc32c: _Optional[_Iterable[int]] = ..., device_digests: _Optional[_Iterable[int]] = ..., ipc_buffer: _Optional[_Union[KVIpcBuffer, _Mapping]] = ...) -> None: ...

class KVIpcBuffer(_message.Message):
    __slots__ = ("id", "num_bytes", "pid", "keep", "fd", "cuda_device", "cuda_handle", "cuda_storage_bytes", "cuda_storage_offset", "cuda_ref_counter_handle", "cuda_ref_counter_offset", "cuda_event_handle", "cuda_event_sync_required")
    ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    CUDA_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    id: str
    num_bytes: int
    pid: int
    keep: bool
    fd: int
    cuda_device: int
    cuda_handle: bytes
    cuda_storage_bytes: int
    cuda_storage_offset: int
    cuda_ref_counter_handle: bytes
    cuda_ref_counter_offset: int
    cuda_event_handle: bytes
    cuda_event_sync_required: bool
    def __init__(self, id: _Optional[str] = ..., num_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., keep: _Optional[bool] = ..., fd: _Optional[int] = ..., cuda_device: _Optional[int] = ..., cuda_handle: _Optional[bytes] = ..., cuda_storage_bytes: _Optional[int] = ..., cuda_storage_offset: _Optional[int] = ..., cuda_ref_counter_handle: _Optional[bytes] = ..., cuda_ref_counter_offset: _Optional[int] = ..., cuda_event_handle: _Optional[bytes] = ..., cuda_event_sync_required: _Optional[bool] = ...) -> None: ...

class KVIpcHandoff(_message.Message):
    __slots__ = ("descriptor", "commit")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    descriptor: KVHandoffDescriptor
    commit: KVCommit
    def __init__(self, descriptor: _Optional[_Union[KVHandoffDescriptor, _Mapping]] = ..., commit: _Optional[_Union[KVCommit, _Mapping]] = ...) -> None: ...

class KVTransferAck(_message.Message):
    __slots__ = ("ok", "error", "num_bytes", "error_kind", "ipc_doorbell")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    IPC_DOORBELL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    num_bytes: int
    error_kind: KVErrorKind
    ipc_doorbell: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_bytes: _Optional[int] = ..., error_kind: _Optional[_Union[KVErrorKind, str]] = ..., ipc_doorbell: _Optional[str] = ...) -> None: ...

class KVOpenAck(_message.Message):
    __slots__ = ("ok", "error", "store_endpoint", "pair_key", "error_kind")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STORE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PAIR_KEY_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    store_endpoint: str
    pair_key: str
    error_kind: KVErrorKind
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., store_endpoint: _Optional[str] = ..., pair_key: _Optional[str] = ..., error_kind: _Optional[_Union[KVErrorKind, str]] = ...) -> None: ...
