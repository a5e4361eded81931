"""The learner's control service: Status (step, weight version, last metrics) and Stop, plus health and reflection.

`LoopState` is the plain domain object the loop updates; `LearnerServicer` only converts it. Stop sets a flag the
loop reads between steps (it finishes the step in progress and writes a checkpoint), so stopping is never abrupt.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from dgrpo.common import grpc_server
from dgrpo.common.auth import server_credentials, server_interceptors
from dgrpo.common.auth_config import Credentials
from dgrpo.common.logs import printable
from dgrpo.v1 import learner_pb2, learner_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name


@dataclass
class LoopState:
    """What the loop is doing; read by Status, written by the loop (one event loop thread: no locking)."""

    step: int = 0
    total_steps: int = 0
    weight_version: int = 0
    epoch: int = 0
    phase: str = "setup"
    metrics: dict[str, float] = field(default_factory=dict)
    stop_requested: bool = False
    stop_reason: str = ""
    stopped_by_rpc: bool = False  # the operator's Stop, not a signal: the run is over (learner/records/run_end.py)

    @property
    def ended(self) -> bool:
        return self.phase in ("done", "stopped")

    def request_stop(self, reason: str, by_rpc: bool = False) -> None:
        """Any client may send the reason: it is kept and logged escaped and bounded (one line, 200 characters)."""
        if self.ended:
            return
        reason = printable(reason) if reason else "no reason given"
        if not self.stop_requested:
            log.info("stop requested (%s): finishing step %d first", reason, self.step + 1)
        self.stop_requested, self.stop_reason = True, reason
        self.stopped_by_rpc = self.stopped_by_rpc or by_rpc


class LearnerServicer(learner_pb2_grpc.LearnerServicer):
    def __init__(self, state: LoopState):
        self.state = state

    async def Status(self, request, context) -> learner_pb2.LearnerStatus:
        s = self.state
        return learner_pb2.LearnerStatus(
            step=s.step, total_steps=s.total_steps, weight_version=s.weight_version, epoch=s.epoch, phase=s.phase,
            metrics={k: float(v) for k, v in s.metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)},
            stop_requested=s.stop_requested,
        )

    async def Stop(self, request, context) -> learner_pb2.StopResponse:
        self.state.request_stop(request.reason, by_rpc=True)
        return learner_pb2.StopResponse(stopping_after_step=self.state.step + (0 if self.state.ended else 1))


async def start_control_server(state: LoopState, host: str, port: int,
                               credentials: Credentials | None = None) -> grpc_server.GrpcServer:
    """Serve Status/Stop with health and reflection, SERVING at once: the loop state answers from setup on. With a
    token in `credentials`, Status and Stop must carry it: Stop ends the run; with TLS, it listens with TLS
    (`common/auth.py`)."""
    creds = credentials or Credentials()
    server = grpc_server.create_server(
        LearnerServicer(state), learner_pb2_grpc.add_LearnerServicer_to_server, SERVICE_NAME, host=host, port=port,
        config_key="learner.trainer.control_port",
        interceptors=server_interceptors(creds.token, host=host, config_key="learner.trainer.control_host"),
        credentials=server_credentials(creds))
    await server.start()
    await server.set_serving(True)
    log.info("learner control service on %s:%d (Status, Stop; health, reflection)", host, server.port)
    return server
