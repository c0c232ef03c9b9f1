"""DraftWorker gRPC servicer: protobuf <-> ProposeParams/ProposeResult, nothing else."""
from __future__ import annotations

import grpc

from draft_worker.engine import DraftEngine, ProposeParams
from specdec import grpc_util
from specdec.contract import Commit, SamplingConfig, slot_key
from specdec.scheduler import BatchLimits
from specdec.v1 import worker_pb2, worker_pb2_grpc
from specdec.worker_core import WorkerCore
from specdec.worker_server import WorkerServicerBase

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


class DraftServicer(WorkerServicerBase, worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, core: WorkerCore, max_q_entries: int = 256, limits: BatchLimits = BatchLimits()) -> None:
        super().__init__(core, limits)
        self.engine = DraftEngine(core, max_q_entries)

    async def Propose(self, request: worker_pb2.ProposeRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ProposeResponse:
        params = ProposeParams(session_id=request.session_id, commit=Commit.from_pb(request.commit),
                               k=request.k, sampling=SamplingConfig.from_pb(request.sampling),
                               min_draft_prob=request.min_draft_prob, slot=request.slot,
                               fork_from=request.fork_from if request.HasField("fork_from") else None)
        # Each slot is a cache of its own: a branch's call runs beside the session's own.
        result = await self.run_call(context, slot_key(params.session_id, params.slot),
                                     lambda: self.engine.propose_steps(params))
        return worker_pb2.ProposeResponse(tokens=result.tokens, q=[q.to_pb() for q in result.q],
                                          token_probs=result.token_probs, confidences=result.confidences,
                                          alt_tokens=[t for t, _ in result.alternatives],
                                          alt_probs=[p for _, p in result.alternatives],
                                          cache_len=result.cache_len, slot=result.slot,
                                          timing=result.stats.to_pb())


def register(servicer: DraftServicer, server: grpc.aio.Server) -> None:
    grpc_util.add_service(server, worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"], servicer)
