from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("step", "total_steps", "weight_version", "epoch", "phase", "metrics", "stop_requested")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STOP_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    weight_version: int
    epoch: int
    phase: str
    metrics: _containers.ScalarMap[str, float]
    stop_requested: bool
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., epoch: _Optional[int] = ..., phase: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., stop_requested: _Optional[bool] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("stopping_after_step",)
    STOPPING_AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    stopping_after_step: int
    def __init__(self, stopping_after_step: _Optional[int] = ...) -> None: ...
