from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "commit", "k", "sampling", "min_draft_prob", "slot", "fork_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROB_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit: _common_pb2.CacheCommit
    k: int
    sampling: _common_pb2.SamplingParams
    min_draft_prob: float
    slot: int
    fork_from: int
    def __init__(self, session_id: _Optional[str] = ..., commit: _Optional[_Union[_common_pb2.CacheCommit, _Mapping]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_draft_prob: _Optional[float] = ..., slot: _Optional[int] = ..., fork_from: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "q", "token_probs", "cache_len", "timing", "confidences", "alt_tokens", "alt_probs", "slot")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    ALT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    cache_len: int
    timing: _common_pb2.WorkerTiming
    confidences: _containers.RepeatedScalarFieldContainer[float]
    alt_tokens: _containers.RepeatedScalarFieldContainer[int]
    alt_probs: _containers.RepeatedScalarFieldContainer[float]
    slot: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., token_probs: _Optional[_Iterable[float]] = ..., cache_len: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.WorkerTiming, _Mapping]] = ..., confidences: _Optional[_Iterable[float]] = ..., alt_tokens: _Optional[_Iterable[int]] = ..., alt_probs: _Optional[_Iterable[float]] = ..., slot: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "commit", "draft_tokens", "q", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit: _common_pb2.CacheCommit
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    sampling: _common_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., commit: _Optional[_Union[_common_pb2.CacheCommit, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_len", "next_token", "cache_len", "timing")
    ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    accepted_len: int
    next_token: int
    cache_len: int
    timing: _common_pb2.WorkerTiming
    def __init__(self, accepted_len: _Optional[int] = ..., next_token: _Optional[int] = ..., cache_len: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.WorkerTiming, _Mapping]] = ...) -> None: ...
