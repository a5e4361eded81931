from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_ERROR: _ClassVar[ScoreStatus]
    SCORE_STATUS_NO_REWARD: _ClassVar[ScoreStatus]
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_ERROR: ScoreStatus
SCORE_STATUS_NO_REWARD: ScoreStatus

class RewardChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[RewardToolCall]
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[RewardToolCall, _Mapping]]] = ..., name: _Optional[str] = ...) -> None: ...

class RewardToolCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class RewardChat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[RewardChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[RewardChatMessage, _Mapping]]] = ...) -> None: ...

class ScoreGroup(_message.Message):
    __slots__ = ("prompt_id", "text", "chat", "completions", "extra", "completion_ids", "completion_chats")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_CHATS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    text: str
    chat: RewardChat
    completions: _containers.RepeatedScalarFieldContainer[str]
    extra: _struct_pb2.Struct
    completion_ids: _containers.RepeatedCompositeFieldContainer[CompletionTokenIds]
    completion_chats: _containers.RepeatedCompositeFieldContainer[RewardChat]
    def __init__(self, prompt_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[RewardChat, _Mapping]] = ..., completions: _Optional[_Iterable[str]] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., completion_ids: _Optional[_Iterable[_Union[CompletionTokenIds, _Mapping]]] = ..., completion_chats: _Optional[_Iterable[_Union[RewardChat, _Mapping]]] = ...) -> None: ...

class CompletionTokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RewardTrainerState(_message.Message):
    __slots__ = ("global_step", "max_steps", "epoch")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    max_steps: int
    epoch: float
    def __init__(self, global_step: _Optional[int] = ..., max_steps: _Optional[int] = ..., epoch: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("groups", "group_size", "trainer_state")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STATE_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[ScoreGroup]
    group_size: int
    trainer_state: RewardTrainerState
    def __init__(self, groups: _Optional[_Iterable[_Union[ScoreGroup, _Mapping]]] = ..., group_size: _Optional[int] = ..., trainer_state: _Optional[_Union[RewardTrainerState, _Mapping]] = ...) -> None: ...

class CompletionScore(_message.Message):
    __slots__ = ("reward", "breakdown", "status", "message")
    class BreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reward: float
    breakdown: _containers.ScalarMap[str, float]
    status: ScoreStatus
    message: str
    def __init__(self, reward: _Optional[float] = ..., breakdown: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[ScoreStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class GroupScores(_message.Message):
    __slots__ = ("prompt_id", "scores", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    scores: _containers.RepeatedCompositeFieldContainer[CompletionScore]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, prompt_id: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[CompletionScore, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RewardSpecRef(_message.Message):
    __slots__ = ("name", "version", "content_hash")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    content_hash: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., content_hash: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("groups", "spec")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupScores]
    spec: RewardSpecRef
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupScores, _Mapping]]] = ..., spec: _Optional[_Union[RewardSpecRef, _Mapping]] = ...) -> None: ...

class RewarderInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardFunctionInfo(_message.Message):
    __slots__ = ("name", "kind", "weight", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    weight: float
    source: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., weight: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class RewarderInfo(_message.Message):
    __slots__ = ("spec", "functions", "workers", "workers_alive", "on_error", "in_flight_requests")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    ON_ERROR_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    spec: RewardSpecRef
    functions: _containers.RepeatedCompositeFieldContainer[RewardFunctionInfo]
    workers: int
    workers_alive: int
    on_error: str
    in_flight_requests: int
    def __init__(self, spec: _Optional[_Union[RewardSpecRef, _Mapping]] = ..., functions: _Optional[_Iterable[_Union[RewardFunctionInfo, _Mapping]]] = ..., workers: _Optional[int] = ..., workers_alive: _Optional[int] = ..., on_error: _Optional[str] = ..., in_flight_requests: _Optional[int] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("spec_text",)
    SPEC_TEXT_FIELD_NUMBER: _ClassVar[int]
    spec_text: str
    def __init__(self, spec_text: _Optional[str] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("spec", "previous", "changed")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    spec: RewardSpecRef
    previous: RewardSpecRef
    changed: bool
    def __init__(self, spec: _Optional[_Union[RewardSpecRef, _Mapping]] = ..., previous: _Optional[_Union[RewardSpecRef, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...
