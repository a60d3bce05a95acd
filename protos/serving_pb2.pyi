from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "skip_special_tokens", "logit_bias", "n", "best_of", "prompt_logprobs", "structured_outputs", "priority", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    skip_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    best_of: int
    prompt_logprobs: int
    structured_outputs: StructuredOutputs
    priority: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., priority: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("kind", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "prefill_endpoint", "router_queue_s", "peer_fetch", "lora_name", "lora_digest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    prefill_endpoint: str
    router_queue_s: float
    peer_fetch: PeerFetch
    lora_name: str
    lora_digest: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_endpoint: _Optional[str] = ..., router_queue_s: _Optional[float] = ..., peer_fetch: _Optional[_Union[PeerFetch, _Mapping]] = ..., lora_name: _Optional[str] = ..., lora_digest: _Optional[str] = ...) -> None: ...

class PeerFetch(_message.Message):
    __slots__ = ("endpoint", "worker_id", "num_blocks")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    worker_id: str
    num_blocks: int
    def __init__(self, endpoint: _Optional[str] = ..., worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("fetch_id", "block_hashes", "first_block", "receiver_endpoint", "receiver_worker_id")
    FETCH_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    fetch_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_block: int
    receiver_endpoint: str
    receiver_worker_id: str
    def __init__(self, fetch_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., first_block: _Optional[int] = ..., receiver_endpoint: _Optional[str] = ..., receiver_worker_id: _Optional[str] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "seconds")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    seconds: float
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class StopReason(_message.Message):
    __slots__ = ("stop_string", "stop_token_id")
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    stop_string: str
    stop_token_id: int
    def __init__(self, stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("router_queue_s", "decode_queue_s", "prefill_queue_s", "prefill_s", "kv_transfer_s", "kv_transfer_bytes", "peer_fetch_s", "peer_fetch_bytes")
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    router_queue_s: float
    decode_queue_s: float
    prefill_queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_transfer_bytes: int
    peer_fetch_s: float
    peer_fetch_bytes: int
    def __init__(self, router_queue_s: _Optional[float] = ..., decode_queue_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., peer_fetch_s: _Optional[float] = ..., peer_fetch_bytes: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "logprobs", "finish_reason", "stop_reason", "error", "usage", "timings", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    stop_reason: StopReason
    error: str
    usage: Usage
    timings: StageTimings
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[StopReason, _Mapping]] = ..., error: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "decode_endpoint", "decode_worker_id", "transfer_id", "decode_cached_blocks", "decode_tensor_parallel_size", "decode_rank_endpoints")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_RANK_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    decode_endpoint: str
    decode_worker_id: str
    transfer_id: str
    decode_cached_blocks: int
    decode_tensor_parallel_size: int
    decode_rank_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., decode_endpoint: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., decode_cached_blocks: _Optional[int] = ..., decode_tensor_parallel_size: _Optional[int] = ..., decode_rank_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprobs", "finish_reason", "stop_reason", "text", "error", "num_cached_tokens", "timings", "prompt_logprobs", "error_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprobs: TokenLogprobs
    finish_reason: str
    stop_reason: StopReason
    text: str
    error: str
    num_cached_tokens: int
    timings: StageTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    error_reason: str
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[StopReason, _Mapping]] = ..., text: _Optional[str] = ..., error: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., error_reason: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset", "kv_blocks_used")
    RESET_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    kv_blocks_used: int
    def __init__(self, reset: _Optional[bool] = ..., kv_blocks_used: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "worker_id", "role", "model", "incarnation", "engine_model", "load_format", "block_size", "max_model_len", "kv_cache_dtype", "quantization", "scheduling_policy", "max_logprobs")
    OK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    worker_id: str
    role: str
    model: str
    incarnation: int
    engine_model: str
    load_format: str
    block_size: int
    max_model_len: int
    kv_cache_dtype: str
    quantization: str
    scheduling_policy: str
    max_logprobs: int
    def __init__(self, ok: _Optional[bool] = ..., worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., incarnation: _Optional[int] = ..., engine_model: _Optional[str] = ..., load_format: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., scheduling_policy: _Optional[str] = ..., max_logprobs: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CpuKernel(_message.Message):
    __slots__ = ("kernel", "variant")
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    kernel: str
    variant: str
    def __init__(self, kernel: _Optional[str] = ..., variant: _Optional[str] = ...) -> None: ...

class KVNamespace(_message.Message):
    __slots__ = ("model", "block_size", "kv_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    kv_dtype: str
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ...) -> None: ...

class LoadStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free", "kv_blocks_total", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_transfer_bytes", "kv_transfer_seconds", "num_kv_transfers", "num_kv_transfer_failures", "incarnation", "cpu_kernels", "max_num_seqs", "kv_namespace", "prefix_index_up", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "spec_decode_chosen_k", "num_queued_prompt_tokens", "kv_transfers_rejected", "quantization", "prefix_cache_hits_by_tier", "kv_offload_bytes", "ranks", "kv_peer_fetch_blocks", "kv_peer_fetch_bytes", "kv_peer_fetch_seconds", "kv_peer_fetch_failures", "kv_block_bytes", "num_requests_receiving_kv", "lora_adapters", "max_loras", "lora_requests_running", "lora_requests_waiting")
    class KvTransfersRejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefixCacheHitsByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvOffloadBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvPeerFetchFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoraRequestsRunningEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoraRequestsWaitingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_INDEX_UP_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_CHOSEN_K_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RECEIVING_KV_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_requests_running: int
    num_requests_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    num_kv_transfers: int
    num_kv_transfer_failures: int
    incarnation: int
    cpu_kernels: _containers.RepeatedCompositeFieldContainer[CpuKernel]
    max_num_seqs: int
    kv_namespace: KVNamespace
    prefix_index_up: bool
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    spec_decode_chosen_k: _containers.RepeatedScalarFieldContainer[int]
    num_queued_prompt_tokens: int
    kv_transfers_rejected: _containers.ScalarMap[str, int]
    quantization: str
    prefix_cache_hits_by_tier: _containers.ScalarMap[str, int]
    kv_offload_bytes: _containers.ScalarMap[str, int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStats]
    kv_peer_fetch_blocks: int
    kv_peer_fetch_bytes: int
    kv_peer_fetch_seconds: float
    kv_peer_fetch_failures: _containers.ScalarMap[str, int]
    kv_block_bytes: int
    num_requests_receiving_kv: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    max_loras: int
    lora_requests_running: _containers.ScalarMap[str, int]
    lora_requests_waiting: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., num_kv_transfers: _Optional[int] = ..., num_kv_transfer_failures: _Optional[int] = ..., incarnation: _Optional[int] = ..., cpu_kernels: _Optional[_Iterable[_Union[CpuKernel, _Mapping]]] = ..., max_num_seqs: _Optional[int] = ..., kv_namespace: _Optional[_Union[KVNamespace, _Mapping]] = ..., prefix_index_up: _Optional[bool] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., spec_decode_chosen_k: _Optional[_Iterable[int]] = ..., num_queued_prompt_tokens: _Optional[int] = ..., kv_transfers_rejected: _Optional[_Mapping[str, int]] = ..., quantization: _Optional[str] = ..., prefix_cache_hits_by_tier: _Optional[_Mapping[str, int]] = ..., kv_offload_bytes: _Optional[_Mapping[str, int]] = ..., ranks: _Optional[_Iterable[_Union[RankStats, _Mapping]]] = ..., kv_peer_fetch_blocks: _Optional[int] = ..., kv_peer_fetch_bytes: _Optional[int] = ..., kv_peer_fetch_seconds: _Optional[float] = ..., kv_peer_fetch_failures: _Optional[_Mapping[str, int]] = ..., kv_block_bytes: _Optional[int] = ..., num_requests_receiving_kv: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., lora_requests_running: _Optional[_Mapping[str, int]] = ..., lora_requests_waiting: _Optional[_Mapping[str, int]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "digest", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    path: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoRAAdapter
    def __init__(self, adapter: _Optional[_Union[LoRAAdapter, _Mapping]] = ...) -> None: ...

class RankStats(_message.Message):
    __slots__ = ("rank", "pid", "weight_bytes", "kv_cache_bytes", "kv_lane_bytes_sent", "kv_lane_bytes_received")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LANE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_LANE_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_lane_bytes_sent: int
    kv_lane_bytes_received: int
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_lane_bytes_sent: _Optional[int] = ..., kv_lane_bytes_received: _Optional[int] = ...) -> None: ...
