from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class CacheCommit(_message.Message):
    __slots__ = ("cache_len", "prefix_hash", "append_tokens")
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    prefix_hash: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cache_len: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerTiming(_message.Message):
    __slots__ = ("compute_ms", "fed_tokens", "prefilled_tokens", "catchup_ms", "draft_steps", "queue_ms", "batch_sessions", "batch_rows", "worker_utilisation", "worker_waiting", "batch_prompt_rows")
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    WORKER_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_WAITING_FIELD_NUMBER: _ClassVar[int]
    BATCH_PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    compute_ms: float
    fed_tokens: int
    prefilled_tokens: int
    catchup_ms: float
    draft_steps: int
    queue_ms: float
    batch_sessions: float
    batch_rows: float
    worker_utilisation: float
    worker_waiting: int
    batch_prompt_rows: float
    def __init__(self, compute_ms: _Optional[float] = ..., fed_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., catchup_ms: _Optional[float] = ..., draft_steps: _Optional[int] = ..., queue_ms: _Optional[float] = ..., batch_sessions: _Optional[float] = ..., batch_rows: _Optional[float] = ..., worker_utilisation: _Optional[float] = ..., worker_waiting: _Optional[int] = ..., batch_prompt_rows: _Optional[float] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: bool = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "model_ref", "vocab_size", "max_context", "eos_token_ids", "tokenizer_fingerprint", "sessions", "cache_bytes", "cache_budget_bytes", "forward_costs", "gemm_path", "max_batch", "batching", "utilisation", "active_calls", "waiting_calls", "branch_slots", "decode_path")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_REF_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COSTS_FIELD_NUMBER: _ClassVar[int]
    GEMM_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CALLS_FIELD_NUMBER: _ClassVar[int]
    WAITING_CALLS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PATH_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_ref: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    sessions: int
    cache_bytes: int
    cache_budget_bytes: int
    forward_costs: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    gemm_path: str
    max_batch: int
    batching: str
    utilisation: float
    active_calls: int
    waiting_calls: int
    branch_slots: int
    decode_path: str
    def __init__(self, role: _Optional[str] = ..., model_ref: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., sessions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_budget_bytes: _Optional[int] = ..., forward_costs: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ..., gemm_path: _Optional[str] = ..., max_batch: _Optional[int] = ..., batching: _Optional[str] = ..., utilisation: _Optional[float] = ..., active_calls: _Optional[int] = ..., waiting_calls: _Optional[int] = ..., branch_slots: _Optional[int] = ..., decode_path: _Optional[str] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("tokens", "context", "ms")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    context: int
    ms: float
    def __init__(self, tokens: _Optional[int] = ..., context: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...
