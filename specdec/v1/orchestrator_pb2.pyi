from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("policy", "min_k", "max_k", "fixed_k", "min_draft_prob", "pipeline", "pipeline_branches", "overlap_prefill")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MIN_K_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    FIXED_K_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROB_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_PREFILL_FIELD_NUMBER: _ClassVar[int]
    policy: str
    min_k: int
    max_k: int
    fixed_k: int
    min_draft_prob: float
    pipeline: bool
    pipeline_branches: int
    overlap_prefill: bool
    def __init__(self, policy: _Optional[str] = ..., min_k: _Optional[int] = ..., max_k: _Optional[int] = ..., fixed_k: _Optional[int] = ..., min_draft_prob: _Optional[float] = ..., pipeline: bool = ..., pipeline_branches: _Optional[int] = ..., overlap_prefill: bool = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "messages", "session_id", "max_new_tokens", "stop", "temperature", "top_k", "top_p", "seed", "speculation", "resume_session")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: TokenIds
    messages: ChatMessages
    session_id: str
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    speculation: SpeculationOptions
    resume_session: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ..., resume_session: bool = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "accepted_per_position", "k_per_round", "draft_ms", "verify_ms", "overhead_ms", "total_ms", "tokens_per_second", "new_tokens", "reprefills", "bytes_to_draft", "bytes_to_target", "seed", "fallback_rounds", "prompt_tokens", "cached_prompt_tokens", "bytes_from_draft", "bytes_from_target", "predraft_hits", "predraft_misses", "predraft_saved_ms", "predraft_branch_hits", "guard_off_rounds", "accepted_per_round")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    K_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPREFILLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_DRAFT_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_TARGET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_TARGET_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_SAVED_MS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_BRANCH_HITS_FIELD_NUMBER: _ClassVar[int]
    GUARD_OFF_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    k_per_round: _containers.RepeatedScalarFieldContainer[int]
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    total_ms: float
    tokens_per_second: float
    new_tokens: int
    reprefills: int
    bytes_to_draft: int
    bytes_to_target: int
    seed: int
    fallback_rounds: int
    prompt_tokens: int
    cached_prompt_tokens: int
    bytes_from_draft: int
    bytes_from_target: int
    predraft_hits: int
    predraft_misses: int
    predraft_saved_ms: float
    predraft_branch_hits: int
    guard_off_rounds: int
    accepted_per_round: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., k_per_round: _Optional[_Iterable[int]] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., overhead_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., new_tokens: _Optional[int] = ..., reprefills: _Optional[int] = ..., bytes_to_draft: _Optional[int] = ..., bytes_to_target: _Optional[int] = ..., seed: _Optional[int] = ..., fallback_rounds: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., bytes_from_draft: _Optional[int] = ..., bytes_from_target: _Optional[int] = ..., predraft_hits: _Optional[int] = ..., predraft_misses: _Optional[int] = ..., predraft_saved_ms: _Optional[float] = ..., predraft_branch_hits: _Optional[int] = ..., guard_off_rounds: _Optional[int] = ..., accepted_per_round: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "session_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    session_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("text_delta", "token_ids", "finish_reason", "stats", "session_id")
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    text_delta: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    session_id: str
    def __init__(self, text_delta: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...
