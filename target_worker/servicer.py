"""TargetWorker gRPC servicer: protobuf <-> VerifyParams/VerifyResult, nothing else."""
from __future__ import annotations

import grpc

from specdec import grpc_util
from specdec.contract import Commit, SamplingConfig
from specdec.scheduler import BatchLimits
from specdec.sampling import SparseDist
from specdec.v1 import worker_pb2, worker_pb2_grpc
from specdec.worker_core import WorkerCore
from specdec.worker_server import WorkerServicerBase
from target_worker.engine import TargetEngine, VerifyParams

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


class TargetServicer(WorkerServicerBase, worker_pb2_grpc.TargetWorkerServicer):
    def __init__(self, core: WorkerCore, limits: BatchLimits = BatchLimits()) -> None:
        super().__init__(core, limits)
        self.engine = TargetEngine(core)

    async def Verify(self, request: worker_pb2.VerifyRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.VerifyResponse:
        params = VerifyParams(session_id=request.session_id, commit=Commit.from_pb(request.commit),
                              draft_tokens=tuple(request.draft_tokens),
                              q=tuple(SparseDist.from_pb(q) for q in request.q),
                              sampling=SamplingConfig.from_pb(request.sampling))
        result = await self.run_call(context, params.session_id, lambda: self.engine.verify_steps(params))
        return worker_pb2.VerifyResponse(accepted_len=result.accepted_len, next_token=result.next_token,
                                         cache_len=result.cache_len, timing=result.stats.to_pb())


def register(servicer: TargetServicer, server: grpc.aio.Server) -> None:
    grpc_util.add_service(server, worker_pb2.DESCRIPTOR.services_by_name["TargetWorker"], servicer)
