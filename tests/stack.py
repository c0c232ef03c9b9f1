"""Start real gRPC servers (draft, target, orchestrator) on 127.0.0.1:0 inside the test's event loop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from draft_worker.servicer import SERVICE_NAME as DRAFT_SERVICE, DraftServicer, register as register_draft
from orchestrator.app import OrchestratorConfig, start_orchestrator
from orchestrator.config import SpeculationConfig
from orchestrator.api import EngineLimits
from specdec import grpc_util
from specdec.models import load_model
from specdec.scheduler import BatchLimits
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc, worker_pb2_grpc
from specdec.worker_core import StoreLimits, WorkerCore
from target_worker.servicer import SERVICE_NAME as TARGET_SERVICE, TargetServicer, register as register_target

_MODEL_CACHE: dict[tuple[str, torch.dtype], Any] = {}


def cached_model(ref: str, dtype: torch.dtype = torch.float32):
    """Tiny models are deterministic: build each once per test process."""
    if (ref, dtype) not in _MODEL_CACHE:
        _MODEL_CACHE[ref, dtype] = load_model(ref, dtype)
    return _MODEL_CACHE[ref, dtype]


async def start_worker(role: str, ref: str, limits: StoreLimits = StoreLimits(), port: int = 0,
                       dtype: torch.dtype = torch.float32, credentials: grpc.ServerCredentials | None = None,
                       batch: BatchLimits = BatchLimits(), call_delay_ms: float = 0.0):
    """call_delay_ms: every call waits this long before it is served (a worker on a far node)."""
    core = WorkerCore(cached_model(ref, dtype), role, limits)
    servicer: Any
    if role == "draft":
        servicer = DraftServicer(core, limits=batch)
    else:
        servicer = TargetServicer(core, batch)
    if call_delay_ms:
        for name in ("GetInfo", "EndSession", "Propose", "Verify"):
            if hasattr(servicer, name):
                setattr(servicer, name, grpc_util.delayed_call(getattr(servicer, name), call_delay_ms))
    if role == "draft":
        handle = await grpc_util.start_server(lambda s: register_draft(servicer, s), [DRAFT_SERVICE], port=port,
                                              credentials=credentials)
    else:
        handle = await grpc_util.start_server(lambda s: register_target(servicer, s), [TARGET_SERVICE], port=port,
                                              credentials=credentials)
    return handle, servicer


@dataclass
class Stack:
    draft_handle: Any
    draft: DraftServicer
    target_handle: Any
    target: TargetServicer
    orch_handle: Any
    orch: Any
    backends: tuple
    channel: grpc.aio.Channel
    stub: orchestrator_pb2_grpc.OrchestratorStub
    extra: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.orch_handle.port}"

    async def generate(self, timeout: float = 60.0, **kwargs: Any) -> orchestrator_pb2.GenerateResponse:
        return await self.stub.Generate(request(**kwargs), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()
        for backend in self.backends:
            await backend.close()
        for handle in (self.orch_handle, self.draft_handle, self.target_handle):
            await handle.stop(0)
        self.draft.close()
        self.target.close()


def request(prompt_ids: list[int] | None = None, prompt: str | None = None,
            messages: list[tuple[str, str]] | None = None, speculation: dict | None = None,
            **fields: Any) -> orchestrator_pb2.GenerateRequest:
    req = orchestrator_pb2.GenerateRequest(**fields)
    if prompt_ids is not None:
        req.prompt_ids.ids.extend(prompt_ids)
    if prompt is not None:
        req.prompt = prompt
    if messages is not None:
        for role, content in messages:
            req.messages.messages.add(role=role, content=content)
    for key, value in (speculation or {}).items():
        setattr(req.speculation, key, value)
    return req


async def start_stack(target_ref: str = "tiny:seed=0", draft_ref: str = "tiny:seed=0",
                      speculation: SpeculationConfig = SpeculationConfig(),
                      worker_limits: StoreLimits = StoreLimits(), engine_limits: EngineLimits = EngineLimits(),
                      max_concurrent: int = 8, max_queue: int = 32,
                      draft_dtype: torch.dtype = torch.float32, trace_file: str | None = None,
                      batch: BatchLimits = BatchLimits(), draft_call_delay_ms: float = 0.0,
                      target_call_delay_ms: float = 0.0) -> Stack:
    draft_handle, draft = await start_worker("draft", draft_ref, worker_limits, dtype=draft_dtype, batch=batch,
                                             call_delay_ms=draft_call_delay_ms)
    target_handle, target = await start_worker("target", target_ref, worker_limits, batch=batch,
                                               call_delay_ms=target_call_delay_ms)
    cfg = OrchestratorConfig(f"127.0.0.1:{draft_handle.port}", f"127.0.0.1:{target_handle.port}", target_ref,
                             speculation, engine_limits, max_concurrent, max_queue, connect_timeout_s=10.0,
                             trace_file=trace_file)
    orch_handle, orch, backends = await start_orchestrator(cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orch_handle.port}")
    return Stack(draft_handle, draft, target_handle, target, orch_handle, orch, backends, channel,
                 orchestrator_pb2_grpc.OrchestratorStub(channel))


def draft_stub(stack: Stack) -> worker_pb2_grpc.DraftWorkerStub:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft_handle.port}")
    stack.extra.append(channel)
    return worker_pb2_grpc.DraftWorkerStub(channel)


def target_stub(stack: Stack) -> worker_pb2_grpc.TargetWorkerStub:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.target_handle.port}")
    stack.extra.append(channel)
    return worker_pb2_grpc.TargetWorkerStub(channel)


async def cancel_stream_after(stack: Stack, tokens: int, **fields: Any) -> None:
    """A client that goes away mid-stream: read GenerateStream until `tokens` tokens came, then cancel."""
    call = stack.stub.GenerateStream(request(**fields), timeout=60)
    seen = 0
    async for chunk in call:
        seen += len(chunk.token_ids)
        if seen >= tokens:
            break
    call.cancel()
