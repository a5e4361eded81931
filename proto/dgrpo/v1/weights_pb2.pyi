from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_TCP: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_COLLECTIVE: _ClassVar[WeightTransport]
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_SHM: WeightTransport
WEIGHT_TRANSPORT_TCP: WeightTransport
WEIGHT_TRANSPORT_COLLECTIVE: WeightTransport

class WeightTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "xxh3")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    xxh3: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., xxh3: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("run_id", "version", "dtype", "tensors", "adapter_config")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    dtype: str
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensor]
    adapter_config: str
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., dtype: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[WeightTensor, _Mapping]]] = ..., adapter_config: _Optional[str] = ...) -> None: ...

class WeightAnnouncement(_message.Message):
    __slots__ = ("protocol", "run_id", "version", "slot", "seq", "transport", "segment", "nbytes", "manifest_xxh3", "manifest", "streaming", "incarnation", "traceparent")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_XXH3_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    run_id: str
    version: int
    slot: int
    seq: int
    transport: WeightTransport
    segment: str
    nbytes: int
    manifest_xxh3: int
    manifest: WeightManifest
    streaming: bool
    incarnation: int
    traceparent: str
    def __init__(self, protocol: _Optional[int] = ..., run_id: _Optional[str] = ..., version: _Optional[int] = ..., slot: _Optional[int] = ..., seq: _Optional[int] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., segment: _Optional[str] = ..., nbytes: _Optional[int] = ..., manifest_xxh3: _Optional[int] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., streaming: _Optional[bool] = ..., incarnation: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class WeightControlRequest(_message.Message):
    __slots__ = ("protocol", "latest", "fetch", "join")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    latest: LatestWeightsRequest
    fetch: FetchWeightsRequest
    join: JoinCollectiveRequest
    def __init__(self, protocol: _Optional[int] = ..., latest: _Optional[_Union[LatestWeightsRequest, _Mapping]] = ..., fetch: _Optional[_Union[FetchWeightsRequest, _Mapping]] = ..., join: _Optional[_Union[JoinCollectiveRequest, _Mapping]] = ...) -> None: ...

class JoinCollectiveRequest(_message.Message):
    __slots__ = ("host_key", "host_name", "address")
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    host_key: str
    host_name: str
    address: str
    def __init__(self, host_key: _Optional[str] = ..., host_name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class CollectiveGroup(_message.Message):
    __slots__ = ("port", "backend", "timeout_s")
    PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    port: int
    backend: str
    timeout_s: float
    def __init__(self, port: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LatestWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "slot")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    version: int
    slot: int
    def __init__(self, version: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class WeightControlReply(_message.Message):
    __slots__ = ("protocol", "latest", "fetched", "error", "group")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    latest: WeightAnnouncement
    fetched: FetchedWeights
    error: str
    group: CollectiveGroup
    def __init__(self, protocol: _Optional[int] = ..., latest: _Optional[_Union[WeightAnnouncement, _Mapping]] = ..., fetched: _Optional[_Union[FetchedWeights, _Mapping]] = ..., error: _Optional[str] = ..., group: _Optional[_Union[CollectiveGroup, _Mapping]] = ...) -> None: ...

class FetchedWeights(_message.Message):
    __slots__ = ("version", "seq", "nbytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    seq: int
    nbytes: int
    def __init__(self, version: _Optional[int] = ..., seq: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...
