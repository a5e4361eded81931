"""The weight transports, one strategy a file, and the factory that picks one from `weights.transport`.

Nothing outside this package asks which transport is in use: the publisher, the subscriber, `dgrpo doctor` and
`dgrpo plan`, the stack's checks and `dgrpo up` ask the strategy (`transport_for(cfg.weights)`) what to do, and a
sampler checks each announcement with the strategy of its sender (`transport_of_wire`); the wire protocol checks
fields only. The schema names the transports as values: its Literal, and the one option only collective reads
(weights/config.py). A new
transport is a new file here (a `WeightTransport` subclass), its entry in `TRANSPORTS`, its value in
`weights.transport`'s Literal (weights/config.py) and its wire value in weights.proto's `WeightTransport` enum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgrpo.weights.transports.base import WeightTransport
from dgrpo.weights.transports.collective import CollectiveTransport
from dgrpo.weights.transports.shm import ShmTransport
from dgrpo.weights.transports.tcp import TcpTransport

if TYPE_CHECKING:
    from dgrpo.weights.config import WeightSyncConfig

TRANSPORTS: dict[str, type[WeightTransport]] = {t.name: t for t in (ShmTransport, TcpTransport, CollectiveTransport)}
"""`weights.transport` value -> its strategy."""
_BY_WIRE = {t.wire: t for t in TRANSPORTS.values()}


def transport_for(cfg: WeightSyncConfig) -> WeightTransport:
    """The strategy of `cfg.transport`, bound to `cfg`."""
    return TRANSPORTS[cfg.transport](cfg)


def transport_of_wire(wire: int) -> type[WeightTransport]:
    """The strategy an announcement's `transport` field names; the base (no traits) for a value none has (version 0
    announcements leave it unset)."""
    return _BY_WIRE.get(wire, WeightTransport)


__all__ = ["TRANSPORTS", "WeightTransport", "transport_for", "transport_of_wire"]
